"""Public functions: argument checks, layout handling, dispatch."""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F

from . import checks, forward, ops
from .arch import backend_for, get_capability
from .recipes import Recipe, resolve

# Captured at import, before anyone patches F.scaled_dot_product_attention with ours.
TORCH_SDPA = F.scaled_dot_product_attention


def _resolve(recipe, device: torch.device) -> Recipe:
    capability = get_capability() if device.type == "cuda" else None
    r = resolve(recipe, capability)
    checks.recipe_runs_here(r, device, capability)
    return r


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "HND",
    recipe: "str | Recipe" = "auto",
    return_lse: bool = False,
):
    """Low-bit attention ``softmax(q·kᵀ·scale)·v``.

    Args:
        q: ``[B, Hq, Nq, D]`` (layout ``"HND"``) or ``[B, Nq, Hq, D]`` (``"NHD"``); float16, bfloat16
            or float32; any strides.
        k, v: ``[B, Hkv, Nk, D]`` or ``[B, Nk, Hkv, D]``, same dtype and device as q; ``Hq`` must be a
            multiple of ``Hkv`` (GQA/MQA). Head dims 64 and 128 are the fast path; 1 to 256 work.
        is_causal: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq`` (aligned bottom-right, as in
            FlashAttention; rows that see no key give 0).
        scale: softmax scale, ``D ** -0.5`` by default.
        layout: ``"HND"`` or ``"NHD"``; the output has the same layout.
        recipe: ``"auto"`` (FP8 P·V on sm_89 and newer, FP16 P·V before and on CPU),
            ``"qk_int8_pv_fp8"``, ``"qk_int8_pv_fp16"``, ``"qk_fp4_pv_fp4"`` (NVFP4; head dim a
            multiple of 32), ``"qk_mxfp4_pv_mxfp4"``, ``"exact"``, or a :class:`Recipe`. FP4
            recipes run on FP4 tensor cores on Blackwell (sm_100, sm_120) and as an exact
            emulation elsewhere (see ``lowbit-attn doctor``).
        return_lse: also return the natural-log log-sum-exp of each row's scores.
    Returns:
        the output (q's dtype, shape and layout), and with ``return_lse`` the LSE ``[B, Hq, Nq]``
        fp32 (``-inf`` for rows that see no key).

    On a CUDA GPU the Triton kernels run; on a CPU the PyTorch reference with the same numerics.
    """
    qh, kh, vh = checks.dense_qkv(q, k, v, layout)
    is_causal = checks.flag("is_causal", is_causal)
    return_lse = checks.flag("return_lse", return_lse)
    checks.forward_only(q, k, v)
    r = _resolve(recipe, q.device)
    checks.recipe_fits(r, q.shape[-1])
    sm_scale = checks.softmax_scale(scale, q.shape[-1])
    b, hq, nq, _ = qh.shape
    nk = kh.shape[2]
    if nq == 0 or hq == 0:  # nothing to compute (the quantizers' reductions need elements)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    out, lse = ops.call(
        q, k, v, r, scale=sm_scale, is_causal=is_causal, causal_offset=nk - nq,
        nhd=layout == "NHD", return_lse=return_lse,
    )
    return (out, lse) if return_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    recipe: "str | Recipe" = "auto",
    return_lse: bool = False,
    check_seqlens: bool = True,
):
    """Attention over packed sequences, as FlashAttention's ``flash_attn_varlen_func``.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]``; sequence ``b`` holds rows
            ``cu_seqlens[b]:cu_seqlens[b+1]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` offsets on q's device, starting at 0.
        max_seqlen_q, max_seqlen_k: at least the longest sequence.
        is_causal: per sequence, aligned bottom-right.
        check_seqlens: verify the offsets and maxima (reads ``cu_seqlens`` on the host: a GPU
            synchronisation and, under ``torch.compile``, a graph break). ``False`` for offsets
            known good, inside CUDA graphs or compiled code.
    Returns:
        the output ``[total_q, Hq, D]`` (q's dtype), and with ``return_lse`` the LSE ``[Hq, total_q]``.

    Smoothing and quantization statistics are per sequence, never across sequences.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, x, 3)
    is_causal = checks.flag("is_causal", is_causal)
    return_lse = checks.flag("return_lse", return_lse)
    check_seqlens = checks.flag("check_seqlens", check_seqlens)
    checks.same_kind(q, k, v)
    checks.forward_only(q, k, v)
    checks.heads_and_dims(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), batch_dim=None, head_dim_axis=1,
        seq_axis=None,
    )
    bq = checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, values=check_seqlens)
    bk = checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, values=check_seqlens)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    for name, value, bounds in (("max_seqlen_q", max_seqlen_q, bq), ("max_seqlen_k", max_seqlen_k, bk)):
        longest = 0 if bounds is None else max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        if isinstance(value, bool) or not isinstance(value, int) or value < longest:
            raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), got {value!r}")
    r = _resolve(recipe, q.device)
    checks.recipe_fits(r, q.shape[-1])
    sm_scale = checks.softmax_scale(scale, q.shape[-1])
    if q.shape[1] == 0:  # no query heads: nothing to compute, as in attention()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((0, q.shape[0]), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    out, lse = ops.call_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, r,
                               scale=sm_scale, is_causal=is_causal, return_lse=return_lse)
    return (out, lse) if return_lse else out


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_fallback(reason: str) -> None:
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(
        f"lowbit_attn.scaled_dot_product_attention: {reason}; falling back to PyTorch's exact "
        "attention for such calls",
        stacklevel=3,
    )


def _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                     scale) -> str | None:
    """Why the kernels cannot serve this ``scaled_dot_product_attention`` call (then PyTorch's
    function does, raising only where it would), or None. Only a reason, never an exception: any
    argument PyTorch takes must reach it."""
    if not all(isinstance(x, torch.Tensor) for x in (query, key, value)):
        return "inputs are not tensors"
    if attn_mask is not None:
        return "an attn_mask was given"
    if dropout_p != 0.0:
        return "dropout_p > 0"
    if not all(isinstance(flag, (bool, torch.SymBool)) for flag in (is_causal, enable_gqa)):
        # PyTorch takes only a bool (a SymBool when traced symbolically) and raises for "False", 1,
        # numpy.bool_ or None: its function decides, rather than bool() reading "False" as true
        return "is_causal or enable_gqa is not a bool"
    if not (query.dim() == key.dim() == value.dim() and query.dim() in (3, 4)):
        return f"only 3-D and 4-D inputs are supported (got {query.dim()}-D)"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in checks.FLOAT_DTYPES:
        return f"dtype {query.dtype} is not supported"
    if not (query.device == key.device == value.device):
        return "inputs are on different devices"
    if key.shape != value.shape or query.shape[-1] != key.shape[-1]:
        return "value's head dim differs from query's"
    if not 1 <= query.shape[-1] <= checks.MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} is not supported"
    if query.shape[0] != key.shape[0] or query.shape[-2] == 0 or key.shape[-2] == 0:
        return "shapes need broadcasting or are empty"
    if query.dim() == 4:
        hq, hkv = query.shape[1], key.shape[1]
        if hq == 0 or hkv == 0:
            return "shapes need broadcasting or are empty"
        if hq != hkv and (not enable_gqa or hq % hkv != 0):
            return "query and key heads differ without enable_gqa"
    try:
        checks.softmax_scale(scale, query.shape[-1])
    except (TypeError, ValueError):
        return f"scale is not a positive finite real number (got {type(scale).__name__})"
    return None


def _training_reason(query, key, is_causal, train_recipe) -> str | None:
    """Why a call that needs gradients cannot go to :func:`trainable_attention`, or None."""
    if train_recipe is None:
        return ("a gradient is required (these kernels are forward-only; "
                "patch_sdpa(train_recipe='sagebwd_int8') trains with trainable_attention)")
    if backend_for(query.device) == "triton" and query.dtype not in (torch.float16, torch.bfloat16):
        return f"training on the kernels takes float16 or bfloat16, got {query.dtype}"
    if is_causal and query.shape[-2] != key.shape[-2]:
        return "causal training with different query and key lengths (PyTorch aligns top-left)"
    return None


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` with the same
    signature and semantics (causal masks aligned top-left, as PyTorch does), computed with the
    ``"auto"`` recipe (another recipe: :func:`lowbit_attn.patch_sdpa`). Calls the kernels cannot
    serve (an ``attn_mask``, dropout, autograd, a scale that is not a positive finite real number,
    an ``is_causal`` or ``enable_gqa`` that is not a bool, empty or unsupported shapes or dtypes)
    go to PyTorch's own function, with one warning per reason, so it raises only where PyTorch
    does, and as PyTorch does.
    """
    return sdpa_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            recipe="auto", fallback=TORCH_SDPA)


def _recipe_reason(r: Recipe, device: torch.device, capability, head_dim: int) -> str | None:
    """Why the kernels cannot run recipe ``r`` for this call (the GPU is too old for it, or an FP4
    recipe meets a head dim it cannot group), or None: ``attention`` raises there, the drop-in
    hands the call to PyTorch."""
    try:
        checks.recipe_runs_here(r, device, capability)
        checks.recipe_fits(r, head_dim)
    except ValueError as err:
        return str(err)
    return None


def sdpa_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *,
                     recipe, fallback, train_recipe=None):
    """:func:`scaled_dot_product_attention` with the function that serves what the kernels
    cannot (``fallback``, called with the same arguments); calls that need gradients go to
    :func:`trainable_attention` with ``train_recipe`` when one is given."""
    reason = _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                              scale)
    train = reason is None and torch.is_grad_enabled() and any(
        x.requires_grad for x in (query, key, value))
    if train:
        reason = _training_reason(query, key, is_causal, train_recipe)
    elif reason is None:
        capability = get_capability() if query.device.type == "cuda" else None
        r = resolve(recipe, capability)  # an unknown recipe is the caller's error: it raises
        reason = _recipe_reason(r, query.device, capability, query.shape[-1])
    if reason is not None:
        warn_fallback(reason)
        return fallback(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa,
        )
    squeeze = query.dim() == 3
    q, k, v = (x.unsqueeze(1) for x in (query, key, value)) if squeeze else (query, key, value)
    if train:
        from .trainable import trainable_attention

        out = trainable_attention(q, k, v, is_causal=bool(is_causal), scale=scale,
                                  recipe=train_recipe)
    else:
        out, _ = ops.call(
            q, k, v, r, scale=checks.softmax_scale(scale, q.shape[-1]), is_causal=bool(is_causal),
            causal_offset=0, nhd=False, return_lse=False,
        )
    return out.squeeze(1) if squeeze else out
