"""diffusers: run a pipeline's (or a model's) attention on lowbit_attn in one line::

    from lowbit_attn.integrations import diffusers as lowbit_diffusers

    lowbit_diffusers.enable(pipe, recipe="qk_int8_pv_fp8")     # the denoiser: transformer(s) / unet
    image = pipe(prompt).images[0]
    lowbit_diffusers.disable(pipe)

diffusers' attention processors and its native attention backend call
``torch.nn.functional.scaled_dot_product_attention``; while a hooked model runs its forward, those
calls (in that thread or task only: see :func:`lowbit_attn.integrations.sdpa.routed`) run the recipe, and
calls the kernels cannot take (masks, dropout, gradients) run PyTorch's exact SDPA, with one
warning per reason. Models whose processors pick another diffusers backend (flash-attn, sage,
xformers) are not affected: keep the default ``native`` backend.
"""

from __future__ import annotations

import threading

import torch

from lowbit_attn.integrations.sdpa import routed
from lowbit_attn.core.recipes import Recipe, resolve

DENOISERS = ("transformer", "transformer_2", "unet", "prior", "decoder")
"""The pipeline components :func:`enable` hooks when ``components`` is not given."""
_HOOKS = "_lowbit_attn_hooks"


def _modules(target, components) -> list[tuple[str, torch.nn.Module]]:
    if isinstance(target, torch.nn.Module):
        if components is not None:
            raise ValueError("components selects a pipeline's models; got a model")
        return [(type(target).__name__, target)]
    found = getattr(target, "components", None)
    if not isinstance(found, dict):
        raise TypeError(f"enable() takes a diffusers pipeline or a torch.nn.Module, got "
                        f"{type(target).__name__}")
    models = {k: v for k, v in found.items() if isinstance(v, torch.nn.Module)}
    if isinstance(components, str):  # one name, not its letters
        components = (components,)
    names = DENOISERS if components is None else tuple(components)
    unknown = [n for n in names if components is not None and n not in models]
    chosen = [(n, models[n]) for n in names if n in models]
    if unknown or not chosen:
        raise ValueError(f"components must name models of the pipeline {sorted(models)}; got "
                         f"{list(names) if components is not None else 'none of ' + str(DENOISERS)}")
    return chosen


def enable(target, recipe: str | Recipe = "auto", *, components=None) -> list[str]:
    """Route the attention of ``target``'s denoiser to ``recipe`` during each of its forwards.

    While a hooked model runs its forward, its ``torch.nn.functional.scaled_dot_product_attention``
    calls (in that thread or task only) run the recipe, and calls the kernels cannot take (masks,
    dropout, gradients) run PyTorch's exact SDPA, with one warning per reason. Keep diffusers'
    default ``native`` attention backend. With ``torch.compile``, wrap the pipeline call in
    :func:`lowbit_attn.patch_sdpa` instead (the per-thread routing is a graph break).

    Args:
        target: a diffusers pipeline (its models in ``target.components``) or one
            ``torch.nn.Module``.
        recipe: the inference recipe, a name or a :class:`~lowbit_attn.Recipe`. Enabling again
            replaces it.
        components: names of the pipeline's models to hook (a list, or one name as a string);
            ``None`` hooks those of :data:`DENOISERS` that it has. Not for a module.

    Returns:
        The names of the models hooked.

    Raises:
        TypeError: ``target`` is neither a pipeline nor a module; ``recipe`` of the wrong type.
        ValueError: an unknown recipe name; ``components`` given with a module, naming a model
            the pipeline lacks, or a pipeline without any of :data:`DENOISERS`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.integrations import diffusers as lowbit_diffusers
        >>> # a pipeline's transformer, say
        >>> model = torch.nn.Linear(8, 8)
        >>> names = lowbit_diffusers.enable(model, "qk_int8_pv_fp16")
        >>> lowbit_diffusers.disable(model) == names
        True
    """
    resolve(recipe, None)
    chosen = _modules(target, components)
    for _, module in chosen:
        _unhook(module)
        scopes = threading.local()  # each thread's open forwards of this module, innermost last

        def enter(mod, args, kwargs, scopes=scopes):
            scope = routed(recipe)
            scope.__enter__()
            scopes.__dict__.setdefault("stack", []).append(scope)

        def leave(mod, args, kwargs, output, scopes=scopes):
            scopes.stack.pop().__exit__(None, None, None)

        setattr(module, _HOOKS, (
            module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, with_kwargs=True, always_call=True),
        ))
    return [name for name, _ in chosen]


def _unhook(module: torch.nn.Module) -> bool:
    hooks = getattr(module, _HOOKS, None)
    if hooks is None:
        return False
    for h in hooks:
        h.remove()
    delattr(module, _HOOKS)
    return True


def disable(target, *, components=None) -> list[str]:
    """Undo :func:`enable`.

    Args:
        target: the pipeline or module given to :func:`enable`.
        components: as for :func:`enable`.

    Returns:
        The names of the models that were hooked.

    Raises:
        TypeError: ``target`` is neither a pipeline nor a module.
        ValueError: ``components`` given with a module, or naming a model the pipeline lacks.

    Examples:
        >>> import torch
        >>> from lowbit_attn.integrations.diffusers import disable
        >>> # never enabled: nothing unhooked
        >>> disable(torch.nn.Linear(8, 8))
        []
    """
    return [name for name, module in _modules(target, components) if _unhook(module)]


__all__ = ["DENOISERS", "disable", "enable"]
