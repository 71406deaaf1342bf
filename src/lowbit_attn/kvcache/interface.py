"""The public functions of the KV cache: argument checks, then the split-KV Triton kernel
(``kernel_decode``; on CUDA tensors, or on CPU tensors under ``LOWBIT_ATTN_BACKEND=triton`` with
the interpreter) or its twin (``naive``), chosen here by ``core.arch.backend_for``, with the same
arguments. With launch plans (``LOWBIT_ATTN_LAUNCH=plan``, the default), an eager call whose
configuration was seen twice replays its launches (``kvcache/planned.py``)."""

from __future__ import annotations

import torch

from lowbit_attn.core import checks, plans, variants
from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.options import check_env
from lowbit_attn.kvcache import planned
from lowbit_attn.kvcache.cache import QuantizedKVCache
from lowbit_attn.kvcache.naive import attention_with_kv_cache_naive


def attention_with_kv_cache(q: torch.Tensor, cache: QuantizedKVCache, layer: int, *,
                            scale: float | None = None, return_lse: bool = False,
                            softcap: float | None = None, sinks: torch.Tensor | None = None):
    """Attention of new queries against the tokens stored in one layer of a
    :class:`QuantizedKVCache` (append the step's K and V first: a query sees its own token).

    Causal, aligned bottom-right: row ``i`` of sequence ``b`` sees its first
    ``length[b] - n + i + 1`` tokens (in a left-padded batch the valid rows of each sequence are
    its last ones, as they should be; in a right-padded prefill they are not, while decode steps,
    ``n = 1``, are aligned either way); a row that sees no key gives 0 and LSE ``-inf``.
    Numerics: ``lowbit_attn/kvcache/naive.py`` (INT8 Q·Kᵀ per token with K smoothed by its frozen
    prompt mean and Q, K balanced by the factors frozen with it; P̃ in E4M3 or fp16; V per page
    per channel).

    Args:
        q: ``[B, Hq, n, D]`` in the cache's dtype and on its device; ``Hq`` a multiple of the
            cache's ``kv_heads`` (GQA/MQA). ``n`` rows per sequence: 1 for a decode step, the
            prompt for a prefill.
        cache: the cache.
        layer: which of its layers, an int in ``[0, num_layers)``.
        scale: softmax scale, ``D ** -0.5`` by default.
        return_lse: also return the natural-log log-sum-exp of each row's scores.
        softcap: a positive float ``c``: the scaled scores become ``c·tanh(S/c)`` before the
            softmax (Gemma 2), or None.
        sinks: ``[Hq]`` float, or None: one more logit per query head in each row's softmax
            denominator, contributing no value (gpt-oss's ``s_aux``); the LSE counts it, and a
            row that sees no key gives 0 and LSE ``sink`` (to fp32 rounding).

    Returns:
        The output ``[B, Hq, n, D]`` in q's dtype, or with ``return_lse`` a tuple of the output
            and the LSE ``[B, Hq, n]`` fp32.

    Raises:
        TypeError: ``cache`` is not a :class:`QuantizedKVCache`; ``layer`` is not an int; q is not
            a 4-D float tensor in the cache's dtype; ``return_lse`` is not a bool; ``scale`` is
            not a real number; ``softcap`` not a real number, ``sinks`` not a float tensor.
        ValueError: ``softcap`` not positive and finite; ``sinks`` not of shape ``[Hq]`` on q's
            device; in a local layer, rows whose window reaches keys already given back (more
            rows than the last append's tokens); ``layer`` out of range; q on another device, of another batch size or head
            dim, or with a head count that is not a multiple of ``kv_heads``; ``scale`` not
            positive and finite; q requires grad while autograd is on.
        RuntimeError: under CUDA graph capture (the grid follows the host's lengths; use
            :class:`DecodeStep`); after a replayed :class:`DecodeStep` ran past the pages it
            reserved, until :meth:`QuantizedKVCache.reset`.

    Examples:
        >>> import torch, lowbit_attn
        >>> cache = lowbit_attn.QuantizedKVCache(2, 1, 1, 32, max_tokens=64,
        ...                                    dtype=torch.float32)
        >>> # the prompt, 5 tokens, one KV head
        >>> for layer in range(2):
        ...     k, v = torch.randn(1, 1, 5, 32), torch.randn(1, 1, 5, 32)
        ...     cache.append(layer, k, v)
        >>> q = torch.randn(1, 2, 1, 32)
        >>> out, lse = lowbit_attn.attention_with_kv_cache(q, cache, 1,
        ...                                                return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 2, 1, 32]), torch.Size([1, 2, 1]))
    """
    if not isinstance(cache, QuantizedKVCache):
        raise TypeError(f"cache must be a QuantizedKVCache, got {type(cache).__name__}")
    q, sinks = checks.resolved(q, sinks)  # the kernels read memory (a negation flag is not in it)
    plan_key = planned.read_key(q, cache, layer, scale, return_lse, softcap, sinks)
    if plan_key is not None:
        found = cache.plans.replay(plan_key, (q, *cache.layers[layer].launch_inputs))
        if found is not plans.MISSING:
            return found
    cache.refuse_graph_capture("attention_with_kv_cache")
    store = cache.store(layer)
    checks.tensor("q", q, 4)
    if q.dtype != cache.dtype:
        raise TypeError(f"q must have the cache's dtype {cache.dtype}, got {q.dtype}")
    if q.device != cache.device:
        raise ValueError(f"q must be on the cache's device {cache.device}, got {q.device}")
    b, hq, n, d = q.shape
    if b != cache.batch or d != cache.head_dim:
        raise ValueError(f"q must have shape [batch={cache.batch}, Hq, n, head_dim={cache.head_dim}], "
                         f"got {tuple(q.shape)}")
    if hq == 0 or hq % cache.kv_heads != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the cache's "
                         f"kv_heads ({cache.kv_heads})")
    return_lse = checks.flag("return_lse", return_lse)
    sm_scale = checks.softmax_scale(scale, d)
    checks.forward_only(q, names="q")
    check_env()
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q)
    if store.local:
        _check_window(store, n)
    if n == 0:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((b, hq, 0), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    backend = backend_for(q.device)
    if backend != "triton":
        out, lse = attention_with_kv_cache_naive(q, store, cache.recipe, scale=sm_scale,
                                                 softcap=softcap, sinks=sinks)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
    from lowbit_attn.kvcache import kernel_decode  # Triton only where it runs

    def read():
        out, lse = kernel_decode.attention(q, store, cache.recipe, scale=sm_scale,
                                           softcap=softcap, sinks=sinks)
        return (out, lse) if return_lse else out

    if plan_key is None:
        return read()
    return cache.plans.call(plan_key, read, (q, *store.launch_inputs), backend)


def check_softcap(softcap) -> float | None:
    """``softcap`` checked as :func:`~lowbit_attn.core.variants.check_softcap` does it: None
    (or 0: off), or a positive float."""
    return variants.check_softcap(softcap) or None


def check_sinks(sinks, q: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` checked against ``q [B, Hq, n, D]``: None, or fp32 contiguous ``[Hq]``."""
    variants.check_sinks(sinks, q.shape[1], q.device)
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


def _check_window(store, n: int) -> None:
    """A local layer's ``n`` rows (the last ``n`` positions of each sequence) must see no key
    before the sequence's first held page: those were given back when it grew past them."""
    size = store.page_size
    for b, length in enumerate(store.host_lengths):
        if length and store.first_key(max(length - n, 0)) < store.host_first[b] * size:
            raise ValueError(
                f"the cache's layer keeps only its window (window={store.window}, "
                f"chunk={store.chunk}): n={n} query rows of sequence {b} reach tokens it gave "
                "back; read at most the tokens of the last append")
