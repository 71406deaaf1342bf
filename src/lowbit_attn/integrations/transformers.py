"""Hugging Face transformers: an attention implementation that runs lowbit_attn::

    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register()                                   # "lowbit", recipe "auto"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="lowbit")
    lowbit_hf.register("lowbit_fp16pv", recipe="qk_int8_pv_fp16")
    model.set_attn_implementation("lowbit_fp16pv")

The masks are built as for ``"sdpa"``, which leaves them out (``None``) when they are purely causal
or all-ones, so those calls reach the kernels with ``is_causal``. A mask that only hides padded
keys (an encoder's padded batch: every query of a row sees the same keys) is served too: the keys
are packed and each row runs as one sequence of :func:`lowbit_attn.attention_varlen` (finding that
out reads the mask on the host: a GPU synchronisation per layer, and a graph break under
``torch.compile``). Calls the kernels cannot take (other masks, such as causal with padding or
sliding windows, attention dropout while training, gradients, ``softcap``, attention weights asked
for) run PyTorch's exact SDPA instead, with one warning per reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lowbit_attn.core.recipes import Recipe, resolve
from lowbit_attn.inference import attention_varlen
from lowbit_attn.integrations.sdpa import TORCH_SDPA, sdpa_or_fallback, warn_fallback

if TYPE_CHECKING:  # at run time, imported by __getattr__ below
    from lowbit_attn.integrations.transformers_cache import QuantizedCache

# Arguments some models pass that the kernels have no use for; when set, the model's call goes to
# transformers' own SDPA function.
_UNSERVED = ("softcap", "position_bias", "cache", "s_aux", "sinks")


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "lowbit_attn.integrations.transformers needs transformers: "
            "pip install 'lowbit-attention[transformers]'"
        ) from exc
    return transformers


def attention_function(recipe: str | Recipe = "auto"):
    """The function transformers calls for each attention layer, running ``recipe``.

    Masks are built as for ``"sdpa"`` (left out when purely causal or all ones, so those calls
    reach the kernels). A mask that hides padded keys only runs as packed sequences through
    :func:`lowbit_attn.attention_varlen`; other masks (causal with padding, sliding windows),
    dropout, gradients, ``softcap`` and attention weights run transformers' SDPA function with one
    warning per reason.

    Args:
        recipe: the inference recipe, a name or a :class:`~lowbit_attn.Recipe`.

    Returns:
        A function of the ``AttentionInterface`` contract: ``(module, query [B, H, N, D], key,
            value, attention_mask, dropout, scaling, is_causal, **kwargs) → (output [B, N, H, D],
            None)``.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``recipe`` is neither a str nor a :class:`~lowbit_attn.Recipe`.
        ValueError: an unknown recipe name.

    Examples:
        >>> import torch
        >>> from lowbit_attn.integrations import transformers as lowbit_transformers
        >>> fn = lowbit_transformers.attention_function("qk_int8_pv_fp16")
        >>> q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
        >>> out, weights = fn(torch.nn.Module(), q, k, v, None)
        >>> out.shape, weights                              # [B, N, H, D]
        (torch.Size([1, 64, 2, 32]), None)
    """
    resolve(recipe, None)
    _transformers()
    # transformers' own SDPA function, taken from its module rather than from the registry by
    # name: after register("sdpa") that name is this function, and a fallback would call itself.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lowbit_attn.integrations.transformers_cache import PendingKV, attend

    def lowbit_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                 scaling=None, is_causal=None, **kwargs):
        if isinstance(key, PendingKV):  # a QuantizedCache step: its own path, never a fallback
            return attend(module, query, key, value, attention_mask, dropout=dropout,
                          scaling=scaling, **kwargs)
        unserved = [k for k in _UNSERVED if kwargs.get(k) is not None]
        if kwargs.get("output_attentions"):
            unserved.append("output_attentions")
        if unserved:
            warn_fallback(f"the model passes {', '.join(unserved)}")
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, is_causal=is_causal,
                                          **kwargs)
        keys = _key_padding(attention_mask, query, key, dropout)
        if keys is not None:
            return _key_padded(query, key, value, keys, scaling, recipe)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # as transformers' SDPA path: causal only for more than one query and no explicit mask
        causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
        out = sdpa_or_fallback(query, key, value, attention_mask, dropout, causal, scaling,
                               key.shape[1] != query.shape[1], recipe=recipe, fallback=TORCH_SDPA)
        return out.transpose(1, 2).contiguous(), None

    return lowbit_attention_forward


def _key_padding(mask, query, key, dropout) -> torch.Tensor | None:
    """``[B, K]`` bool: the keys each batch row sees, when ``mask`` (``[B or 1, 1, Q or 1, K]``)
    hides padded keys only (the same keys for every query and head, at least one per row) and the
    call is otherwise one the kernels take; else ``None``."""
    if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
            or mask.shape[0] not in (1, query.shape[0]) or mask.shape[1] != 1
            or mask.shape[2] not in (1, query.shape[2]) or mask.shape[-1] != key.shape[2]
            or dropout != 0.0
            or (torch.is_grad_enabled() and any(x.requires_grad for x in (query, key)))):
        return None
    mask = mask.expand(query.shape[0], -1, -1, -1)  # a batch of 1 broadcasts, as SDPA does
    keys = mask[:, 0, 0, :]
    if not bool(keys.any(dim=-1).all()) or not torch.equal(mask, keys[:, None, None, :].expand_as(mask)):
        return None
    return keys


def _key_padded(query, key, value, keys, scaling, recipe):
    """Attention of every query ``[B, H, Q, D]`` to its row's unpadded keys, as packed sequences
    (row ``b``: all ``Q`` queries, the keys where ``keys[b]``); output ``[B, Q, H, D]``."""
    b, h, n_q, d = query.shape
    q = query.transpose(1, 2).reshape(b * n_q, h, d)
    k, v = (x.transpose(1, 2)[keys] for x in (key, value))       # [total_k, Hkv, D]
    lengths = keys.sum(dim=-1)
    cu_k = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    cu_q = torch.arange(0, (b + 1) * n_q, n_q, device=query.device, dtype=torch.int32)
    out = attention_varlen(q, k, v, cu_q, cu_k, n_q, int(lengths.max()), scale=scaling,
                           recipe=recipe, check_seqlens=False)
    return out.reshape(b, n_q, h, d), None


def register(name: str = "lowbit", recipe: str | Recipe = "auto") -> str:
    """Register ``name`` as an ``attn_implementation`` running ``recipe``, its masks built as for
    ``"sdpa"``. Then ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)``. Registering again replaces it; registering as
    ``"sdpa"`` is safe (fallbacks call transformers' own SDPA function, not the name).

    Args:
        name: the implementation's name, a non-empty str.
        recipe: the inference recipe, a name or a :class:`~lowbit_attn.Recipe`.

    Returns:
        ``name``.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``name`` is not a non-empty str; ``recipe`` is neither a str nor a
            :class:`~lowbit_attn.Recipe`.
        ValueError: an unknown recipe name.

    Examples:
        >>> from lowbit_attn.integrations import transformers as lowbit_transformers
        >>> lowbit_transformers.register("lowbit", recipe="qk_int8_pv_fp16")
        'lowbit'

        Then load a model with ``attn_implementation="lowbit"``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    tf = _transformers()
    from transformers.masking_utils import sdpa_mask

    tf.AttentionInterface.register(name, attention_function(recipe))
    tf.AttentionMaskInterface.register(name, sdpa_mask)
    return name


def __getattr__(name: str):
    # QuantizedCache subclasses transformers' Cache: imported on first use, so that importing
    # this module does not import transformers
    if name == "QuantizedCache":
        _transformers()
        from lowbit_attn.integrations.transformers_cache import QuantizedCache

        return QuantizedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["QuantizedCache", "attention_function", "register"]
