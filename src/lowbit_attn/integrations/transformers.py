"""Hugging Face transformers: an attention implementation that runs lowbit_attn::

    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register()                                   # "lowbit", recipe "auto"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="lowbit")
    lowbit_hf.register("lowbit_fp16pv", recipe="qk_int8_pv_fp16")
    model.set_attn_implementation("lowbit_fp16pv")

The masks are built as for ``"sdpa"``, which leaves them out (``None``) when they are purely causal
or all-ones, so those calls reach the kernels with ``is_causal``. A mask that only hides padded
keys (an encoder's padded batch: every query of a row sees the same keys) is served too: the keys
are packed and each row runs as one sequence of :func:`lowbit_attn.attention_varlen`. So is a
decoder's mask for a padded batch (causal with left padding, and a layer's sliding window or
chunk): its real queries and the keys they see are packed, and the mask is checked to be exactly
the layer's pattern over them (``transformers_cache.local_visible``). Reading a mask happens on
the host: a GPU synchronisation per layer, and a graph break under ``torch.compile``.

A layer's sliding window (``sliding_window``: Gemma 2/3, gpt-oss, Mistral), chunk (Llama 4's
``chunked_attention`` layers), ``softcap`` (Gemma 2) and sinks (gpt-oss's ``s_aux``) are read
from the call (``transformers_cache.call_options``) and given to the kernels
(``attention(..., window=, chunk=, softcap=, sinks=)``) where they take them
(:data:`LOCAL_KERNELS`). Calls the kernels cannot take (other masks, attention dropout while
training, gradients, attention weights asked for) run an exact function instead, with one warning
per reason: transformers' SDPA function, or, where the call has a softcap or sinks (which SDPA
would drop or refuse), the model's own eager attention, so a fallback computes what the model
defines.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.arch import get_capability
from lowbit_attn.core.recipes import Recipe, resolve
from lowbit_attn.inference import attention, attention_varlen
from lowbit_attn.integrations.sdpa import (TORCH_SDPA, recipe_reason, sdpa_or_fallback,
                                           warn_fallback)

if TYPE_CHECKING:  # at run time, imported by __getattr__ below
    from lowbit_attn.integrations.transformers_cache import QuantizedCache

# Arguments some models pass that the kernels have no use for; when set, the model's call goes to
# an exact function (transformers' SDPA, or the model's eager attention).
_UNSERVED = ("position_bias", "cache")
# Whether the prefill kernels take a window, chunk, softcap and sinks (the public
# attention(..., window=, chunk=, softcap=, sinks=)); without them such calls run exactly.
LOCAL_KERNELS = all(name in inspect.signature(attention_varlen).parameters
                    for name in ("window", "chunk", "softcap", "sinks"))


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
    reach the kernels). A mask that hides padded keys only, or a decoder's mask that is its
    layer's pattern (causal, window or chunk) with left padding, runs as packed sequences through
    :func:`lowbit_attn.attention_varlen`; other masks, dropout, gradients and attention weights
    run an exact function with one warning per reason (transformers' SDPA function; the model's
    eager attention where the call has a softcap or sinks).

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
    # fallbacks call transformers' own SDPA function, taken from its module rather than from the
    # registry by name: after register("sdpa") that name is this function, and a fallback would
    # call itself (exact_fallback)
    from lowbit_attn.integrations.transformers_cache import PendingKV, attend, call_options

    def lowbit_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                 scaling=None, is_causal=None, **kwargs):
        if isinstance(key, PendingKV):  # a QuantizedCache step: its own path, never a fallback
            return attend(module, query, key, value, attention_mask, dropout=dropout,
                          scaling=scaling, **kwargs)
        window, chunk, softcap, sinks = call_options(module, kwargs)

        def fallback(reason):
            warn_fallback(reason)
            return exact_fallback(module, query, key, value, attention_mask, dropout, scaling,
                                  is_causal, softcap, sinks, kwargs)

        unserved = [k for k in _UNSERVED if kwargs.get(k) is not None]
        if kwargs.get("output_attentions"):
            unserved.append("output_attentions")
        if unserved:
            return fallback(f"the model passes {', '.join(unserved)}")
        if sinks is not None and not (isinstance(sinks, torch.Tensor) and sinks.dim() == 1):
            return fallback("sinks per row (the kernels take one per head)")
        capability = get_capability() if query.device.type == "cuda" else None
        reason = recipe_reason(resolve(recipe, capability), query.device, capability,
                               query.shape[-1])
        if reason is not None:  # on every path, as the SDPA drop-in's (not raised mid-model)
            return fallback(reason)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        other = checks.other_autodiff(query, key, value)
        if other is not None:
            return fallback(other)
        training = dropout != 0.0 or checks.needs_grad(query, key, value, sinks)
        local = [name for name, x in (("sliding window", window), ("chunk", chunk),
                                      ("softcap", softcap), ("sinks", sinks)) if x is not None]
        if local and (training or not causal):
            return fallback(f"the model's {', '.join(local)} "
                            f"{'while training or with dropout' if training else 'unmasked'}")
        packed = None
        if causal and isinstance(attention_mask, torch.Tensor) and not training:
            packed = _decoder_packing(attention_mask, query, key, window, chunk)
            if packed is None and local:
                return fallback("a mask that is not the layer's causal pattern with left padding")
            if packed is not None:
                window, chunk = packed[2:]  # None where they cut nothing
        elif local:  # no mask: causal (or one query), no padding; the window may cut nothing
            if 1 < query.shape[2] < key.shape[2]:
                # transformers leaves the mask out of a prefill into an empty static cache and
                # relies on SDPA's causal mask, aligned top-left: the keys past the queries are
                # the cache's empty slots, which no query sees
                key, value = (x[:, :, : query.shape[2]] for x in (key, value))
            window, chunk = _cutting(window, chunk, key.shape[2])
        options = _kernel_options(window, chunk, softcap, sinks)
        if options and not LOCAL_KERNELS:
            return fallback(f"the model's {', '.join(options)} need the kernels' local attention "
                            "options, which this build lacks")
        if packed is not None:
            return _packed(query, key, value, packed[:2], scaling, recipe, options)
        if options:
            out = attention(query, key, value, is_causal=bool(query.shape[2] > 1), scale=scaling,
                            recipe=recipe, **options)
            return out.transpose(1, 2).contiguous(), None
        keys = _key_padding(attention_mask, query, key, value, dropout)
        if keys is not None:
            return _key_padded(query, key, value, keys, scaling, recipe)
        if isinstance(attention_mask, torch.Tensor):  # named here: SDPA's reason would be vaguer
            return fallback("a mask while training or with dropout (the masked paths are "
                            "forward-only)" if training else
                            "a mask that is neither causal with left padding nor padded keys (a "
                            "right-padded batch, packed sequences or a custom mask)")
        # as transformers' SDPA path: causal only for more than one query and no explicit mask
        causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
        out = sdpa_or_fallback(query, key, value, attention_mask, dropout, causal, scaling,
                               key.shape[1] != query.shape[1], recipe=recipe, fallback=TORCH_SDPA)
        return out.transpose(1, 2).contiguous(), None

    return lowbit_attention_forward


def _kernel_options(window, chunk, softcap, sinks) -> dict:
    """The keyword arguments of ``attention``/``attention_varlen`` for a layer's window (keys
    back; causal, so nothing ahead), chunk, softcap and sinks; empty for plain attention."""
    options = {}
    if window is not None:
        options["window"] = (window, 0)
    if chunk is not None:
        options["chunk"] = chunk
    if softcap is not None:
        options["softcap"] = float(softcap)
    if sinks is not None:
        options["sinks"] = sinks
    return options


def _cutting(window, chunk, keys: int):
    """``(window, chunk)`` without those that cut nothing from ``keys`` keys in a row."""
    return (None if window is None or keys - 1 <= window else window,
            None if chunk is None or keys <= chunk else chunk)


def _decoder_packing(mask, query, key, window, chunk):
    """How a decoder's bool mask ``[B or 1, 1, Q, K]`` runs as packed sequences, or None when it
    is not the layer's pattern over them: ``(real queries [B, Q], kept keys [B, K], window,
    chunk)``, the last two None where they cut nothing from the kept keys. A query is
    real where it sees its own key (``K - Q + i``: left padding sees nothing); the keys kept are
    those some real query sees, which must run to the last key and the real queries to the last
    query (bottom-right alignment), and every real query must see exactly the keys that the
    causal pattern (with ``window``, ``chunk``: ``transformers_cache.local_visible``) gives in
    the kept keys' own positions. The last keys no query sees (a static cache's empty slots,
    behind a prefill's queries) are left out first. Reads the mask on the host."""
    from lowbit_attn.integrations.transformers_cache import local_visible

    b, _, n_q, n_k = query.shape[0], None, query.shape[2], key.shape[2]
    if (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] not in (1, b)
            or mask.shape[1] != 1 or mask.shape[2] != n_q or mask.shape[3] != n_k or n_k < n_q):
        return None
    mask = mask[:, 0].expand(b, -1, -1)
    seen = mask.any(dim=1).any(dim=0).nonzero()                       # keys some query sees
    n_all, n_k = n_k, int(seen.max()) + 1 if seen.numel() else 0
    if n_k < n_q:
        return None
    mask = mask[:, :, :n_k]
    real = torch.diagonal(mask[:, :, n_k - n_q:], dim1=1, dim2=2)      # [B, Q]
    kept = (mask & real[:, :, None]).any(dim=1)                        # [B, K]
    lq, lk = real.sum(dim=1), kept.sum(dim=1)
    cols = torch.arange(n_k, device=mask.device)
    rows = torch.arange(n_q, device=mask.device)
    if (not bool((lq > 0).all()) or not torch.equal(real, rows[None, :] >= n_q - lq[:, None])
            or not torch.equal(kept, cols[None, :] >= n_k - lk[:, None])):
        return None
    pos = cols[None, :] - (n_k - lk)[:, None]                          # the kept keys' positions
    want = kept[:, None, :] & local_visible(pos, pos[:, n_k - n_q:], window, chunk)
    if bool(((mask != want) & real[:, :, None]).any()):
        return None
    kept = torch.nn.functional.pad(kept, (0, n_all - n_k))           # the empty slots: not kept
    return (real, kept, *_cutting(window, chunk, int(lk.max())))


def _packed(query, key, value, packed, scaling, recipe, options):
    """Attention of each row's real queries to its kept keys as packed sequences (causal,
    bottom-right; ``options`` as :func:`_kernel_options`); the other queries give 0. Output
    ``[B, Q, H, D]``."""
    real, kept = packed
    b, h, n_q, d = query.shape
    q = query.transpose(1, 2)[real]                                    # [total_q, H, D]
    k, v = (x.transpose(1, 2)[kept] for x in (key, value))             # [total_k, Hkv, D]
    lq, lk = real.sum(dim=-1), kept.sum(dim=-1)
    cu_q, cu_k = (torch.nn.functional.pad(x.cumsum(0), (1, 0)).to(torch.int32) for x in (lq, lk))
    out = attention_varlen(q, k, v, cu_q, cu_k, int(lq.max()), int(lk.max()), is_causal=True,
                           scale=scaling, recipe=recipe, check_seqlens=False, **options)
    full = torch.zeros(b, n_q, h, d, dtype=out.dtype, device=out.device)
    full[real] = out
    return full, None


def _exact(query, key, value, mask, scaling, softcap, sinks, dropout, position_bias=None):
    """Attention by its definition, in fp32: ``softcap·tanh(S/softcap)`` on the scaled scores,
    the additive ``mask`` and ``position_bias`` (T5's, added after the softcap as eager adds a
    mask), the sinks (``[H]``, or per row ``[B or 1, H, Q or 1, 1]``) as one more logit of each
    row's denominator. Output ``[B, Q, H, D]`` in query's dtype."""
    group = query.shape[1] // key.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (key, value))
    s = torch.matmul(query.float(), k.transpose(-1, -2)) * (
        query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if position_bias is not None:
        s = s + position_bias[..., : k.shape[2]].float()
    if mask is not None:
        s = s + mask[..., : k.shape[2]].float()
    if sinks is not None:
        sink = sinks.float()
        sink = sink.reshape(1, -1, 1, 1) if sink.dim() == 1 else sink
        s = torch.cat([s, sink.expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., : k.shape[2]]
    p = torch.nn.functional.dropout(p, p=dropout, training=dropout > 0)
    return torch.matmul(p, v).to(query.dtype).transpose(1, 2).contiguous()


def exact_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                   softcap, sinks, kwargs):
    """The exact attention a call falls back to: transformers' SDPA function, or with a softcap
    or sinks (SDPA refuses the one and would drop the other), or where the attention weights are
    asked for (``output_attentions``: SDPA returns none), the eager attention of the model's
    own module (``eager_attention_forward`` beside its class), given the mask in eager's additive
    form (the causal one built here where the SDPA mask was left out); where that function would
    not apply the softcap or sinks either (it takes no ``softcap``; the sinks are not the
    module's ``sinks``), attention by its definition (``_exact``). Returns ``(output
    [B, Q, H, D], weights or None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    weights = bool(kwargs.get("output_attentions")) and eager is not None
    if softcap is None and sinks is None and not weights:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    takes = eager is not None and (
        (softcap is None or "softcap" in inspect.signature(eager).parameters)
        and (sinks is None or getattr(module, "sinks", None) is sinks))
    n_q, n_k = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is None and n_q > 1 and (is_causal if is_causal is not None
                                     else getattr(module, "is_causal", True)):
        # where transformers leaves the mask out it relies on SDPA's causal mask, aligned
        # top-left (the same as bottom-right but for a prefill into an empty static cache,
        # whose keys past the queries are empty slots)
        rows = torch.arange(n_q, device=query.device)[:, None]
        mask = (torch.arange(n_k, device=query.device)[None, :] <= rows)[None, None]
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    if not takes:  # the model's eager would not apply them either: the definitions, here
        return _exact(query, key, value, mask, scaling, softcap, sinks, dropout,
                      kwargs.get("position_bias")), None
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _key_padding(mask, query, key, value, dropout) -> torch.Tensor | None:
    """``[B, K]`` bool: the keys each batch row sees, when ``mask`` (``[B or 1, 1, Q or 1, K]``)
    hides padded keys only (the same keys for every query and head, at least one per row) and the
    call is otherwise one the kernels take; else ``None``."""
    if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
            or mask.shape[0] not in (1, query.shape[0]) or mask.shape[1] != 1
            or mask.shape[2] not in (1, query.shape[2]) or mask.shape[-1] != key.shape[2]
            or dropout != 0.0 or checks.needs_grad(query, key, value)):
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
