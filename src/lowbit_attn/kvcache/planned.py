"""The eager paths of a decode step: launch plans (:mod:`lowbit_attn.core.plans`) for
:func:`~lowbit_attn.attention_with_kv_cache` and :meth:`~lowbit_attn.QuantizedKVCache.append`,
held by the cache (``cache.plans``: its layers' tensors never move).

A key holds everything the call's checks and launches read besides the host's lengths: the
call's tensors (shape, strides, dtype, device, alignment), the layer, the arguments, the grad
mode and the environment; for a read also the number of splits, which follows the longest
sequence. What a call checks of the lengths is checked again on every call, before a replay:
an append past ``max_tokens``, a sequence's first append (which freezes its statistics), a page
pool run dry, or a cache read after a captured decode step (its host mirror is stale) goes the
normal way. A call under CUDA graph capture gets no key (``plans.eager``; the normal way refuses
it).
"""

from __future__ import annotations

import torch

from lowbit_attn.core import plans


def _layer(cache, layer):
    """The storage of layer ``layer`` of ``cache`` (a ``QuantizedKVCache``) when a plan may apply
    to it: an int layer in range, a host mirror that is current; else None."""
    if layer.__class__ is not int or not 0 <= layer < cache.num_layers:
        return None
    store = cache.layers[layer]
    return None if store.host_stale else store


def read_key(q, cache, layer, scale, return_lse, softcap=None, sinks=None) -> tuple | None:
    """The plan key of ``attention_with_kv_cache(q, cache, layer, scale=, return_lse=,
    softcap=)``, or None (with ``sinks``: the normal way, whose copy of them a plan would not
    follow)."""
    store = _layer(cache, layer)
    if (store is None or sinks is not None or not plans.eager(q)
            or return_lse.__class__ is not bool
            or not (scale is None or scale.__class__ is float)
            or not (softcap is None or softcap.__class__ is float)):
        return None
    from lowbit_attn.kvcache import kernel_decode

    return ("read", layer, plans.tensor_key(q), scale, return_lse, softcap,
            torch.is_grad_enabled(), kernel_decode.splits_of(store, n=q.shape[2]),
            plans.env_key())


def append_key(cache, layer, k, v, valid, q) -> tuple | None:
    """The plan key of ``cache.append(layer, k, v)`` (without ``valid`` or ``q``: those appends
    take the normal way), or None."""
    store = _layer(cache, layer)
    if store is None or valid is not None or q is not None or not plans.eager(k, v):
        return None
    return ("append", layer, plans.tensor_key(k), plans.tensor_key(v),
            plans.shared_memory((k, v)), plans.env_key())
