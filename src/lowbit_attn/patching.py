"""Replace ``torch.nn.functional.scaled_dot_product_attention`` with ours, and put it back.

Every model that calls ``F.scaled_dot_product_attention`` (or ``torch.nn.functional.…``) at run time
then runs the low-bit kernels; calls they cannot serve (masks, dropout, gradients, unsupported
shapes) go to the function that was there before, with one warning per reason. Code that bound the
function at import (``from torch.nn.functional import scaled_dot_product_attention``) keeps its
own reference and is not affected.

Patches nest: each :func:`patch_sdpa` pushes a recipe, the innermost one is used, and the original
function object is restored when the last one is removed. The bookkeeping is under a lock; the
replacement is process-wide (as the function it replaces is), and ``torch.compile(fullgraph=True)``
traces through it. :func:`routed` routes only the calls made in the current context (thread or
asyncio task): what the framework integrations use around one model's forward (under
``torch.compile`` the context lookup is a graph break; use :func:`patch_sdpa` there).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings

import torch.nn.functional as F

from .api import sdpa_or_fallback
from .recipes import Recipe, resolve, resolve_train

_lock = threading.Lock()
_active: list["SDPAPatch"] = []
_original = None  # what F.scaled_dot_product_attention was before the first active patch
# (innermost patch or None, the function to fall back to): replaced whole under the lock, read
# once per call, so a call racing with patch/unpatch sees one consistent pair.
_state: tuple = (None, None)
_routed_users = 0  # active routed() scopes, in any context
_route: contextvars.ContextVar = contextvars.ContextVar("lowbit_attn_sdpa_route", default=None)


class SDPAPatch:
    """One active patch (returned by :func:`patch_sdpa`); a context manager that removes itself
    on exit."""

    def __init__(self, recipe: "str | Recipe", train_recipe=None):
        self.recipe = recipe
        self.train_recipe = train_recipe

    def __enter__(self) -> "SDPAPatch":
        return self

    def __exit__(self, *exc) -> None:
        unpatch_sdpa(self)

    def __repr__(self) -> str:
        name = self.recipe if isinstance(self.recipe, str) else self.recipe.name
        train = self.train_recipe if self.train_recipe is None or isinstance(
            self.train_recipe, str) else self.train_recipe.name
        return f"SDPAPatch(recipe={name!r}, train_recipe={train!r}, active={self in _active})"


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` as patched by
    :func:`lowbit_attn.patch_sdpa`: the innermost patch's recipe, or the function it replaced for
    the calls the kernels cannot serve."""
    patch, original = _state
    # only read the context when a routed() scope exists: torch.compile cannot trace
    # ContextVar.get, and patch_sdpa alone should compile without a graph break
    route = _route.get() if _routed_users else None
    if route is None:
        route = patch
    if route is None:  # not routed here, or the last patch went away while this call started
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return sdpa_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            recipe=route.recipe, train_recipe=route.train_recipe,
                            fallback=original)


def _install() -> None:
    """Put the wrapper in place if nothing holds it yet (under the lock)."""
    global _original
    if not _active and not _routed_users:
        _original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _patched_sdpa


def _release() -> None:
    """Restore the original when no patch or routed scope holds the wrapper (under the lock)."""
    global _original, _state
    if _active:
        _state = (_active[-1], _original)
        return
    _state = (None, _original)
    if _routed_users:
        return
    if F.scaled_dot_product_attention is _patched_sdpa:
        F.scaled_dot_product_attention = _original
    else:
        warnings.warn(
            "lowbit_attn: torch.nn.functional.scaled_dot_product_attention was replaced by someone "
            "else after patch_sdpa; leaving their function in place",
            stacklevel=3,
        )
    _original = None


@contextlib.contextmanager
def routed(recipe: "str | Recipe" = "auto"):
    """Within the block, ``F.scaled_dot_product_attention`` calls made in this context (thread,
    asyncio task) run ``recipe``; other threads' calls are untouched."""
    resolve(recipe, None)
    global _routed_users, _state
    with _lock:
        _install()
        _routed_users += 1
        _state = (_state[0], _original)
    token = _route.set(SDPAPatch(recipe))
    try:
        yield
    finally:
        _route.reset(token)
        with _lock:
            _routed_users -= 1
            _release()


def patch_sdpa(recipe: "str | Recipe" = "auto", *, train_recipe=None) -> SDPAPatch:
    """Make ``torch.nn.functional.scaled_dot_product_attention`` run ``recipe`` (see
    :func:`lowbit_attn.attention`) until the returned patch is removed::

        with lowbit_attn.patch_sdpa("qk_int8_pv_fp8"):
            image = pipe(prompt).images[0]

        lowbit_attn.patch_sdpa()        # or for the rest of the program ...
        lowbit_attn.unpatch_sdpa()      # ... until this

    Calls that need gradients run PyTorch's exact attention, or, with ``train_recipe`` (e.g.
    ``"sagebwd_int8"``, see :func:`lowbit_attn.trainable_attention`), the trainable 8-bit
    attention (fp16/bf16 on a GPU; causal only with as many queries as keys).
    """
    resolve(recipe, None)  # an unknown recipe fails here, not in the middle of a model
    if train_recipe is not None:
        resolve_train(train_recipe)
    patch = SDPAPatch(recipe, train_recipe)
    global _state
    with _lock:
        _install()
        _active.append(patch)
        _state = (patch, _original)
    return patch


def unpatch_sdpa(patch: SDPAPatch | None = None) -> bool:
    """Remove ``patch`` (by default the most recent one); when none is left, restore the original
    function object. Returns whether a patch was removed."""
    with _lock:
        if patch is None and _active:
            patch = _active[-1]
        if patch is None or patch not in _active:
            return False
        _active.remove(patch)
        _release()
    return True


def sdpa_patched() -> bool:
    """Whether a patch is active."""
    return bool(_active)
