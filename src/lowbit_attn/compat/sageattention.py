"""SageAttention 2.x's public functions, with their signatures (names, order, defaults, ``**kwargs``),
on lowbit_attn's recipes: change ``from sageattention import sageattn`` to
``from lowbit_attn.compat.sageattention import sageattn`` (or see
:func:`lowbit_attn.compat.install_sageattention_alias`) and the call sites stay as they are.

What differs from SageAttention, for every function:

* The caller's tensors are never modified (SageAttention3 subtracts K's mean from ``k`` in place).
* CPU tensors work (the PyTorch reference with the same numerics); any strides; float32 too.
* ``attn_mask`` (a parameter of some functions, or passed through ``**kwargs`` to the others) is
  not ignored: the call warns and computes exact attention with the mask (PyTorch's
  ``scaled_dot_product_attention``, not low-bit; see :func:`masked_exact`). SageAttention's CUDA
  functions ignore it; its Triton one applies it, a float mask to base-2 scores (a bias ``b`` acts
  as ``b·ln 2``), where ours gives a float mask PyTorch's meaning.
* Other keyword arguments a function does not name are ignored, as SageAttention ignores them, with
  one warning per function and name; ``scale`` (PyTorch SDPA's name, when ``sageattn`` replaces
  ``F.scaled_dot_product_attention``) is honoured where ``sm_scale`` is not given.
* Flags (``is_causal``, ``return_lse``, ``smooth_k``, …) are read as SageAttention reads them,
  ``if flag:``, for a bool, ``None``, 0 or 1 (also as a one-element tensor); other values are a
  ``TypeError``. ``sm_scale`` may be a one-element float tensor.
* ``return_lse`` gives the natural-log log-sum-exp of each row of the true scores
  ``q·kᵀ·sm_scale`` (before any smoothing), ``[B, Hq, Nq]`` fp32 in either layout: SageAttention 2.x
  returns its kernels' base-2 LSE divided by log2(e) plus the K-smoothing correction
  ``q·mean(k)·sm_scale``, which is this same quantity. Rows that see no key give ``-inf``.
* ``is_causal`` with ``Nq != Nk`` aligns the mask top-left, as SageAttention's kernels and
  PyTorch's ``scaled_dot_product_attention`` do: query ``i`` sees keys ``j <= i`` (SageAttention
  documents causal only for ``Nq == Nk``; ``lowbit_attn.attention`` itself aligns bottom-right).
* Q/K/V head dims: 1 to 256 (fast path 64 and 128); SageAttention pads to 64/128 and rejects > 128.
* Our INT8 recipes also balance Q/K channels (``Recipe.balance_qk``, exact in real arithmetic);
  P·V always accumulates in fp32 (SageAttention's fp16 / fp22 accumulators are not reproduced).
"""

from __future__ import annotations

import numbers
import sys
import threading
import warnings
from typing import Any, Optional

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.recipes import Recipe, get_recipe, resolve_for
from lowbit_attn.inference import attention, attention_varlen
from lowbit_attn.integrations.sdpa import exact_sdpa

LAYOUTS = ("HND", "NHD")
QK_QUANT_GRANS = ("per_warp", "per_thread")
QUANTIZATION_BACKENDS = ("triton", "cuda")
PV_ACCUM_FP16 = ("fp32", "fp16+fp32", "fp16")
PV_ACCUM_FP8 = ("fp32", "fp32+fp32", "fp32+fp16")
PV_ACCUM_FP8_SM90 = ("fp32", "fp32+fp32")
# SageAttention's INT8 scale groups → ours: per thread → our per-thread groups, their sm90 layout
# (Q's rows r, r + 8 of 16-row slices; K's keys 2c, 2c + 1 mod 8 of 128-key blocks), with
# 128-key blocks and our 128-row query blocks (their kernel's are 64 rows; the groups, and so
# the results, do not depend on it, and the Triton kernel runs half the instructions per score
# with 128, NOTES §17); a warp's 16-32 query rows → per block.
GRANULARITY = {"per_thread": {"granularity": "per_thread", "block_k": 128},
               "per_warp": {"granularity": "per_block"}}

# The functions for SageAttention's CUDA INT8 kernels: the recipe they run, their
# ``pv_accum_dtype`` choices, and the one mode with which they apply ``smooth_v`` (None: no
# ``smooth_v`` parameter).
INT8_CUDA = {
    "sageattn_qk_int8_pv_fp16_cuda": ("qk_int8_pv_fp16", PV_ACCUM_FP16, "fp16"),
    "sageattn_qk_int8_pv_fp8_cuda": ("qk_int8_pv_fp8", PV_ACCUM_FP8, "fp32"),
    "sageattn_qk_int8_pv_fp8_cuda_sm90": ("qk_int8_pv_fp8", PV_ACCUM_FP8_SM90, None),
}

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn(message: str) -> None:
    """A warning attributed to the first caller outside this module (the public functions reach
    it through different numbers of helpers)."""
    frame, level = sys._getframe(1), 2  # level 2: the function that called this one
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def _warn_once(function: str, key: str, message: str) -> None:
    with _warned_lock:
        if (function, key) in _warned:
            return
        _warned.add((function, key))
    _warn(f"{function}: {message}")


def _flag(name: str, value) -> bool:
    """A flag as SageAttention reads one (``if is_causal:``): a bool, ``None``, or 0/1 as an int or
    a one-element integer or bool tensor. Anything else (a string, 2, a float) is a TypeError."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not (
            value.is_floating_point() or value.is_complex()):
        value = value.item()
    if value is None:
        return False
    if (isinstance(value, numbers.Integral) or checks.is_numpy_bool(value)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (or None, 0, 1), got {checks.shown(value)}")


def _scale(sm_scale):
    """``sm_scale`` as :func:`lowbit_attn.attention` takes it: a one-element float tensor read as
    its value (theirs multiplies by it); anything else passed on to be checked there."""
    if isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1 and sm_scale.is_floating_point():
        return float(sm_scale)
    return sm_scale


def _keywords(function: str, attn_mask, sm_scale, kwargs: dict, *, scale_keyword: bool = True):
    """The mask (the parameter, or ``attn_mask=`` in ``**kwargs``) and the scale: ``sm_scale``, or
    where it is None and ``scale_keyword``, a ``scale=`` keyword (PyTorch SDPA's name, for a
    function put in place of ``F.scaled_dot_product_attention``). Warns once for each other keyword,
    which is ignored."""
    extra = dict(kwargs)
    if "attn_mask" in extra:
        passed = extra.pop("attn_mask")
        attn_mask = passed if attn_mask is None else attn_mask
    if scale_keyword and "scale" in extra:
        passed = extra.pop("scale")
        sm_scale = passed if sm_scale is None else sm_scale
    for name in sorted(extra):
        _warn_once(function, name, f"keyword argument {name!r} is ignored (as SageAttention "
                                   "ignores keywords it does not name)")
    return attn_mask, sm_scale


def _layout(tensor_layout) -> str:
    return checks.choice("tensor_layout", tensor_layout, LAYOUTS)


def masked_exact(function: str, q, k, v, attn_mask, *, layout: str = "HND", is_causal=False,
                 scale=None, return_lse=False):
    """Exact attention with a mask, for the calls SageAttention would have run without it: warns,
    then PyTorch's ``scaled_dot_product_attention`` (the function as imported before any
    :func:`lowbit_attn.patch_sdpa`) in the inputs' dtype on a GPU, in float32 for float16/bfloat16
    CPU tensors (``integrations.sdpa.exact_sdpa``).

    Args:
        attn_mask: bool (True = attend) or additive float, broadcastable to ``[B, Hq, Nq, Nk]`` (in
            either layout), as PyTorch's SDPA takes it.
        is_causal: combined with the mask, aligned top-left (query ``i`` sees keys ``j <= i``), as
            SageAttention's kernels and PyTorch's SDPA.
    Returns:
        as :func:`lowbit_attn.attention`: rows that see no key give 0 (and ``-inf`` LSE). The LSE
            is computed from the dense fp32 scores (``Nq × Nk`` per head in memory).
    """
    _warn(f"{function}: attn_mask was given: computing exact attention with the mask "
          "(PyTorch's scaled_dot_product_attention, not low-bit)")
    qh, kh, vh = checks.dense_qkv(q, k, v, layout)
    is_causal = _flag("is_causal", is_causal)
    return_lse = _flag("return_lse", return_lse)
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        # as PyTorch's SDPA: an integer 0/1 mask would otherwise be read as a +0/+1 bias
        raise TypeError(f"attn_mask must be bool (True = attend) or a float bias, got "
                        f"{attn_mask.dtype}")
    full = (qh.shape[0], qh.shape[1], qh.shape[2], kh.shape[2])
    try:
        fits = torch.broadcast_shapes(attn_mask.shape, full) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"attn_mask must broadcast to [B, Hq, Nq, Nk] = {list(full)}, got shape "
                         f"{tuple(attn_mask.shape)}")
    sm_scale = checks.softmax_scale(scale, q.shape[-1])
    groups = qh.shape[1] // kh.shape[1]
    if groups > 1:
        kh, vh = (x.repeat_interleave(groups, dim=1) for x in (kh, vh))
    nq, nk = qh.shape[2], kh.shape[2]
    allowed = attn_mask.to(q.device)
    if allowed.dtype not in (torch.bool, qh.dtype):
        # PyTorch's SDPA adds a float32 bias as it is (a cast to fp16 would turn a bias past
        # 65504, or float32's min, into an infinity); a float64 or other bias as float32
        allowed = allowed.float()
    if is_causal:
        rows = torch.arange(nq, device=q.device)[:, None]
        causal = torch.arange(nk, device=q.device)[None, :] <= rows
        allowed = (allowed & causal if allowed.dtype == torch.bool
                   else allowed.masked_fill(~causal, float("-inf")))
    out = exact_sdpa(qh, kh, vh, attn_mask=allowed, scale=sm_scale)
    visible = allowed if allowed.dtype == torch.bool else allowed != float("-inf")
    dead = ~visible.any(dim=-1)
    out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    out = out.transpose(1, 2) if layout == "NHD" else out
    if not return_lse:
        return out
    scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) * sm_scale
    scores = (scores.masked_fill(~allowed, float("-inf")) if allowed.dtype == torch.bool
              else scores + allowed.float())
    return out, torch.logsumexp(scores, dim=-1)


def _top_left(q, k, v, layout: str, is_causal: bool):
    """``k``, ``v`` and :func:`lowbit_attn.attention`'s mask arguments for SageAttention's causal
    mask, top-left: query ``i`` sees keys ``j <= i``. With ``Nq < Nk`` no query sees the keys past
    ``Nq`` (they are left out: the same rows, the same LSE); with ``Nq > Nk`` a window's right
    side of ``Nq - Nk`` (bottom-right aligned) is the same mask. Inputs that are not 4-D tensors
    of one shape pass unchanged, for ``attention`` to report."""
    if not is_causal or not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return k, v, {"is_causal": is_causal}
    axis = 2 if layout == "HND" else 1
    nq, nk = q.shape[axis], k.shape[axis]
    if nq < nk and k.shape == v.shape:
        return k.narrow(axis, 0, nq), v.narrow(axis, 0, nq), {"is_causal": True}
    if nq > nk:
        return k, v, {"is_causal": False, "window": (-1, nq - nk)}
    return k, v, {"is_causal": True}


def _run(function: str, q, k, v, *, tensor_layout, is_causal, sm_scale, return_lse, recipe,
         attn_mask):
    layout = _layout(tensor_layout)
    is_causal, return_lse = _flag("is_causal", is_causal), _flag("return_lse", return_lse)
    sm_scale = _scale(sm_scale)
    if attn_mask is not None:
        return masked_exact(function, q, k, v, attn_mask, layout=layout, is_causal=is_causal,
                            scale=sm_scale, return_lse=return_lse)
    k, v, mask = _top_left(q, k, v, layout, is_causal)
    return attention(q, k, v, scale=sm_scale, layout=layout, recipe=recipe,
                     return_lse=return_lse, **mask)


def _int8_recipe(name: str, *, qk_quant_gran=None, smooth_k=True, smooth_v=False) -> Recipe:
    changes = {"smooth_k": _flag("smooth_k", smooth_k), "smooth_v": _flag("smooth_v", smooth_v)}
    if qk_quant_gran is not None:
        changes.update(GRANULARITY[checks.choice("qk_quant_gran", qk_quant_gran,
                                                 QK_QUANT_GRANS)])
    return get_recipe(name).replace(**changes)


def _smooth_v_used(function: str, smooth_v, pv_accum_dtype: str, uses: str) -> bool:
    """SageAttention applies ``smooth_v`` with one accumulation mode only and warns otherwise."""
    smooth_v = _flag("smooth_v", smooth_v)
    if smooth_v and pv_accum_dtype != uses:
        _warn(f"{function}: pv_accum_dtype is {pv_accum_dtype!r}, smooth_v will be ignored (as "
              "in SageAttention)")
        return False
    return smooth_v


def _int8_cuda(function: str, q, k, v, kwargs: dict, *, pv_accum_dtype, qk_quant_gran, smooth_k,
               smooth_v=False, **run):
    """The functions of :data:`INT8_CUDA`: their options checked and mapped onto the recipe, then
    :func:`_run` with ``run``'s arguments."""
    name, accum_modes, smooth_v_mode = INT8_CUDA[function]
    checks.choice("pv_accum_dtype", pv_accum_dtype, accum_modes)
    mask, run["sm_scale"] = _keywords(function, None, run["sm_scale"], kwargs)
    if smooth_v_mode is not None:
        smooth_v = _smooth_v_used(function, smooth_v, pv_accum_dtype, smooth_v_mode)
    recipe = _int8_recipe(name, qk_quant_gran=qk_quant_gran, smooth_k=smooth_k, smooth_v=smooth_v)
    return _run(function, q, k, v, recipe=recipe, attn_mask=mask, **run)


def sageattn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "HND",
    is_causal: bool = False,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    **kwargs: Any,
):
    """SageAttention's automatic choice per GPU → ``lowbit_attn.attention(recipe="auto")``.

    The choice: SageAttention picks by GPU (sm80: INT8 Q·Kᵀ + FP16 P·V; sm86: the Triton FP16 P·V
    kernel; sm89/sm120: FP8 P·V; sm90: FP8 P·V with its sm90 kernel; others raise). ``"auto"``
    runs FP8 P·V (per-token INT8 scales) on sm_89 and newer, FP16 P·V (per-block scales) before
    and on CPU, and never raises for the GPU generation.

    Args:
        q: ``[B, Hq, Nq, D]`` (``tensor_layout="HND"``) or ``[B, Nq, Hq, D]`` (``"NHD"``);
            float16, bfloat16 or float32, on a GPU or a CPU.
        k: ``[B, Hkv, Nk, D]`` or ``[B, Nk, Hkv, D]``, q's dtype and device; ``Hq`` a multiple of
            ``Hkv``.
        v: the same shape as k.
        tensor_layout: ``"HND"`` or ``"NHD"`` (→ ``layout``).
        is_causal: → ``is_causal``; when ``Nq != Nk`` aligned top-left as theirs and PyTorch's
            SDPA (query ``i`` sees keys ``j <= i``; see :func:`_top_left`).
        sm_scale: → ``scale`` (``D ** -0.5`` by default, as theirs).
        return_lse: → ``return_lse`` (natural log of the true scores, ``[B, Hq, Nq]`` fp32; see
            the module notes).
        **kwargs: ignored as in SageAttention (one warning per name), except ``attn_mask``: exact
            attention with the mask and a warning (SageAttention ignores it), and ``smooth_k``
            (SageAttention 1.x's parameter in this position): → ``Recipe.smooth_k`` of the
            automatic recipe, and ``scale`` (PyTorch SDPA's name, for ``sageattn`` put in place
            of ``F.scaled_dot_product_attention``): the scale where ``sm_scale`` is None.

    Returns:
        The output in q's dtype, shape and layout, or with ``return_lse`` a tuple of the output
            and the LSE.

    Raises:
        TypeError: as :func:`lowbit_attn.attention`; a flag such as ``smooth_k`` that is not a
            bool; an ``attn_mask`` that is not a tensor.
        ValueError: as :func:`lowbit_attn.attention`; a ``tensor_layout`` other than ``"HND"`` or
            ``"NHD"``; an ``attn_mask`` that does not broadcast to ``[B, Hq, Nq, Nk]``.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat import sageattention
        >>> q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
        >>> sageattention.sageattn(q, k, v, tensor_layout="HND", is_causal=True).shape
        torch.Size([1, 2, 64, 64])
    """
    extra = dict(kwargs)
    recipe = "auto"
    if "smooth_k" in extra:  # SageAttention 1.x: sageattn(..., sm_scale=None, smooth_k=True)
        smooth_k = _flag("smooth_k", extra.pop("smooth_k"))
        if isinstance(q, torch.Tensor):  # (else the interface reports the bad q)
            recipe = resolve_for("auto", q.device).replace(smooth_k=smooth_k)
    mask, sm_scale = _keywords("sageattn", None, sm_scale, extra)
    return _run("sageattn", q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                sm_scale=sm_scale, return_lse=return_lse, recipe=recipe, attn_mask=mask)


def sageattn_qk_int8_pv_fp16_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "HND",
    quantization_backend: str = "triton",
    is_causal: bool = False,
    attn_mask: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    smooth_k: bool = True,
    return_lse: bool = False,
    **kwargs: Any,
):
    """INT8 Q·Kᵀ with per-block scales, FP16 P·V → recipe ``"qk_int8_pv_fp16"``.

    Same scale groups as theirs (one per 128 query rows, per 64 key rows). Differences: P·V
    accumulates in fp32 (theirs: fp16, added into an fp32 buffer after each key block); Q/K
    channels are balanced.

    Args:
        q: as for :func:`sageattn`.
        k: as for :func:`sageattn`.
        v: as for :func:`sageattn`.
        tensor_layout: as for :func:`sageattn`.
        quantization_backend: ``"triton"`` or ``"cuda"`` (which of their quantization kernels
            runs); checked, no effect: our quantization is one pass on the Triton path (the
            reference on CPU).
        is_causal: as for :func:`sageattn`.
        attn_mask: ``None``, or a mask: exact attention with the mask and a warning (see
            :func:`masked_exact`). Theirs (2.2) applies it in the low-bit kernel: a bool mask the
            same (True = attend), a float mask added to base-2 scores (a bias ``b`` acts as
            ``b·ln 2``; ours: PyTorch's meaning, ``b``).
        sm_scale: as for :func:`sageattn`.
        smooth_k: → ``Recipe.smooth_k``.
        return_lse: as for :func:`sageattn`.
        **kwargs: ignored with a warning per name, except ``attn_mask``, as for :func:`sageattn`.

    Returns:
        As :func:`sageattn`.

    Raises:
        TypeError: as :func:`sageattn`.
        ValueError: as :func:`sageattn`; a ``quantization_backend`` other than ``"triton"`` or
            ``"cuda"`` (as theirs).

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat import sageattention
        >>> # [B, N, H, D]
        >>> q, k, v = (torch.randn(1, 64, 2, 64) for _ in range(3))
        >>> fn = sageattention.sageattn_qk_int8_pv_fp16_triton
        >>> out = fn(q, k, v, tensor_layout="NHD", smooth_k=False)
        >>> out.shape
        torch.Size([1, 64, 2, 64])
    """
    checks.choice("quantization_backend", quantization_backend, QUANTIZATION_BACKENDS)
    name = "sageattn_qk_int8_pv_fp16_triton"
    mask, sm_scale = _keywords(name, attn_mask, sm_scale, kwargs)
    recipe = _int8_recipe("qk_int8_pv_fp16", smooth_k=smooth_k)
    return _run(name, q, k, v, tensor_layout=tensor_layout, is_causal=is_causal, sm_scale=sm_scale,
                return_lse=return_lse, recipe=recipe, attn_mask=mask)


def sageattn_qk_int8_pv_fp16_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "HND",
    is_causal: bool = False,
    qk_quant_gran: str = "per_thread",
    sm_scale: Optional[float] = None,
    pv_accum_dtype: str = "fp32",
    smooth_k: bool = True,
    smooth_v: bool = False,
    return_lse: bool = False,
    **kwargs: Any,
):
    """INT8 Q·Kᵀ, FP16 P·V (their CUDA kernels, sm80+) → recipe ``"qk_int8_pv_fp16"``.

    Args:
        q: as for :func:`sageattn`.
        k: as for :func:`sageattn`.
        v: as for :func:`sageattn`.
        tensor_layout: as for :func:`sageattn`.
        is_causal: as for :func:`sageattn`.
        qk_quant_gran: ``"per_thread"`` → ``granularity="per_thread"`` with 128-key blocks
            (their sm90 groups; on sm80/sm89 theirs are 4 query rows and 16 keys);
            ``"per_warp"`` → ``granularity="per_block"`` (one scale per 128 query rows and 64 key
            rows; their warp groups are 16-32 query rows, 64 keys).
        sm_scale: as for :func:`sageattn`.
        pv_accum_dtype: ``"fp32"``, ``"fp16+fp32"`` or ``"fp16"``: checked; ours always
            accumulates P·V in fp32 (equal to ``"fp32"``, more accurate than the others).
        smooth_k: → ``Recipe.smooth_k``.
        smooth_v: → ``Recipe.smooth_v`` with ``pv_accum_dtype="fp16"``; with the other modes it is
            ignored with a warning, as theirs does.
        return_lse: as for :func:`sageattn`.
        **kwargs: ignored with a warning per name, except ``attn_mask``, as for :func:`sageattn`.

    Returns:
        As :func:`sageattn`.

    Raises:
        TypeError: as :func:`sageattn`.
        ValueError: as :func:`sageattn`; a ``qk_quant_gran`` or ``pv_accum_dtype`` outside
            its choices.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.sageattention import sageattn_qk_int8_pv_fp16_cuda
        >>> q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
        >>> out, lse = sageattn_qk_int8_pv_fp16_cuda(q, k, v, qk_quant_gran="per_warp",
        ...                                          return_lse=True)
        >>> lse.shape
        torch.Size([1, 2, 64])
    """
    return _int8_cuda("sageattn_qk_int8_pv_fp16_cuda", q, k, v, kwargs,
                      pv_accum_dtype=pv_accum_dtype, qk_quant_gran=qk_quant_gran,
                      smooth_k=smooth_k, smooth_v=smooth_v, tensor_layout=tensor_layout,
                      is_causal=is_causal, sm_scale=sm_scale, return_lse=return_lse)


def sageattn_qk_int8_pv_fp8_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "HND",
    is_causal: bool = False,
    qk_quant_gran: str = "per_thread",
    sm_scale: Optional[float] = None,
    pv_accum_dtype: str = "fp32+fp16",
    smooth_k: bool = True,
    smooth_v: bool = False,
    return_lse: bool = False,
    **kwargs: Any,
):
    """INT8 Q·Kᵀ, FP8 (E4M3) P·V (their sm89 kernels) → recipe ``"qk_int8_pv_fp8"``.

    Args:
        q: as for :func:`sageattn`.
        k: as for :func:`sageattn`.
        v: as for :func:`sageattn`.
        tensor_layout: as for :func:`sageattn`.
        is_causal: as for :func:`sageattn`.
        qk_quant_gran: as :func:`sageattn_qk_int8_pv_fp16_cuda`: ``"per_thread"`` →
            ``granularity="per_thread"`` with 128-key blocks (their sm90 groups; their sm89
            kernel's blocks are 128 query rows and 64 keys); ``"per_warp"`` →
            ``granularity="per_block"``.
        sm_scale: as for :func:`sageattn`.
        pv_accum_dtype: ``"fp32"``, ``"fp32+fp32"`` or ``"fp32+fp16"``: checked; ours adds each
            key block's FP8 product into an fp32 accumulator (as ``"fp32+fp32"``; their ``"fp32"``
            accumulates in the MMA's 22-bit accumulator, ``"fp32+fp16"`` in fp16 with V's scale
            capped at 2.25).
        smooth_k: → ``Recipe.smooth_k``.
        smooth_v: → ``Recipe.smooth_v`` with ``pv_accum_dtype="fp32"``; ignored with a warning
            otherwise, as theirs does.
        return_lse: as for :func:`sageattn`.
        **kwargs: ignored with a warning per name, except ``attn_mask``, as for :func:`sageattn`.

    Returns:
        As :func:`sageattn`.

    Raises:
        TypeError: as :func:`sageattn`.
        ValueError: as :func:`sageattn`; a ``qk_quant_gran`` or ``pv_accum_dtype`` outside
            its choices; a GPU without FP8 tensor cores (compute capability below 8.9).

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.sageattention import sageattn_qk_int8_pv_fp8_cuda
        >>> q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
        >>> out = sageattn_qk_int8_pv_fp8_cuda(q, k, v, is_causal=True, smooth_v=True)
        >>> out.shape
        torch.Size([1, 2, 64, 64])
    """
    return _int8_cuda("sageattn_qk_int8_pv_fp8_cuda", q, k, v, kwargs,
                      pv_accum_dtype=pv_accum_dtype, qk_quant_gran=qk_quant_gran,
                      smooth_k=smooth_k, smooth_v=smooth_v, tensor_layout=tensor_layout,
                      is_causal=is_causal, sm_scale=sm_scale, return_lse=return_lse)


def sageattn_qk_int8_pv_fp8_cuda_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "HND",
    is_causal: bool = False,
    qk_quant_gran: str = "per_thread",
    sm_scale: Optional[float] = None,
    pv_accum_dtype: str = "fp32+fp32",
    smooth_k: bool = True,
    return_lse: bool = False,
    **kwargs: Any,
):
    """INT8 Q·Kᵀ, FP8 P·V (their sm90 kernel) → recipe ``"qk_int8_pv_fp8"``, as
    :func:`sageattn_qk_int8_pv_fp8_cuda` (runs on any device here, not only sm_90).

    Args:
        q: as for :func:`sageattn`.
        k: as for :func:`sageattn`.
        v: as for :func:`sageattn`.
        tensor_layout: as for :func:`sageattn`.
        is_causal: as for :func:`sageattn`.
        qk_quant_gran: as :func:`sageattn_qk_int8_pv_fp16_cuda` (``"per_thread"`` is this
            kernel's own layout: the same groups and blocks).
        sm_scale: as for :func:`sageattn`.
        pv_accum_dtype: ``"fp32+fp32"`` or ``"fp32"`` (theirs raises NotImplementedError for
            ``"fp32"``; ours computes it as ``"fp32+fp32"``).
        smooth_k: → ``Recipe.smooth_k``.
        return_lse: as for :func:`sageattn`.
        **kwargs: ignored with a warning per name, except ``attn_mask``, as for :func:`sageattn`.

    Returns:
        As :func:`sageattn`.

    Raises:
        TypeError: as :func:`sageattn`.
        ValueError: as :func:`sageattn`; a ``qk_quant_gran`` or ``pv_accum_dtype`` outside
            its choices; a GPU without FP8 tensor cores (compute capability below 8.9).

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat import sageattention
        >>> q = torch.randn(1, 4, 64, 128)
        >>> k = v = torch.randn(1, 2, 64, 128)                     # GQA 2:1
        >>> out = sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, sm_scale=0.1)
        >>> out.shape
        torch.Size([1, 4, 64, 128])
    """
    return _int8_cuda("sageattn_qk_int8_pv_fp8_cuda_sm90", q, k, v, kwargs,
                      pv_accum_dtype=pv_accum_dtype, qk_quant_gran=qk_quant_gran,
                      smooth_k=smooth_k, tensor_layout=tensor_layout, is_causal=is_causal,
                      sm_scale=sm_scale, return_lse=return_lse)


def sageattn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    sm_scale: Optional[float] = None,
    smooth_k: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """Packed sequences (their Triton varlen kernel) → ``lowbit_attn.attention_varlen`` with recipe
    ``"qk_int8_pv_fp16"`` (per-block scales, as theirs).

    Args:
        q: ``[total_q, Hq, D]``.
        k: ``[total_k, Hkv, D]``.
        v: the same shape as k.
        cu_seqlens_q: int32 ``[B + 1]`` offsets (theirs also takes int64: cast to int32 here).
        cu_seqlens_k: likewise for k and v.
        max_seqlen_q: at least the longest query sequence.
        max_seqlen_k: at least the longest key sequence.
        is_causal: → ``is_causal``, per sequence, aligned top-left as theirs (query ``i`` sees
            keys ``j <= i``): where a sequence's query and key counts differ, one
            :func:`lowbit_attn.attention` call per sequence.
        sm_scale: → ``scale``.
        smooth_k: → ``Recipe.smooth_k`` (ours subtracts each sequence's own mean; theirs one mean
            over all sequences packed together).
        **kwargs: ignored with a warning per name; an ``attn_mask`` raises (no mask over packed
            sequences).

    Returns:
        The output ``[total_q, Hq, D]`` only, as theirs.

    Raises:
        TypeError: a ``cu_seqlens`` that is not an int32 or int64 tensor; the type checks of
            :func:`lowbit_attn.attention_varlen`.
        ValueError: an ``attn_mask`` in ``**kwargs``; an int64 ``cu_seqlens`` with an offset
            outside int32's range; the checks of :func:`lowbit_attn.attention_varlen`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat import sageattention
        >>> cu = torch.tensor([0, 37, 101], dtype=torch.int32)
        >>> q, k, v = (torch.randn(101, 2, 64) for _ in range(3))
        >>> out = sageattention.sageattn_varlen(q, k, v, cu, cu, 64, 64, is_causal=True)
        >>> out.shape
        torch.Size([101, 2, 64])
    """
    name = "sageattn_varlen"
    mask, sm_scale = _keywords(name, None, sm_scale, kwargs)
    if mask is not None:
        raise ValueError("sageattn_varlen: attn_mask is not supported over packed sequences "
                         "(SageAttention ignores it); call sageattn on padded tensors with the mask")
    cu = []
    for arg, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{arg} must be an int32 or int64 tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dtype == torch.int64 and x.numel():
            lo, hi = (int(t) for t in x.aminmax())  # one read on the host
            if not 0 <= lo <= hi <= torch.iinfo(torch.int32).max:
                raise ValueError(f"{arg} must hold offsets from 0 to 2**31 - 1 (they are cast to "
                                 f"int32), got values from {lo} to {hi}")
        cu.append(x.to(torch.int32))
    recipe = _int8_recipe("qk_int8_pv_fp16", smooth_k=smooth_k)
    is_causal, sm_scale = _flag("is_causal", is_causal), _scale(sm_scale)
    if is_causal and not (cu[0].shape == cu[1].shape and torch.equal(cu[0], cu[1])):
        return _varlen_top_left(q, k, v, cu[0], cu[1], max_seqlen_q, max_seqlen_k, scale=sm_scale,
                                recipe=recipe)
    return attention_varlen(q, k, v, cu[0], cu[1], max_seqlen_q, max_seqlen_k,
                            is_causal=is_causal, scale=sm_scale, recipe=recipe)


def _varlen_top_left(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, recipe) -> torch.Tensor:
    """Causal packed sequences whose query and key counts differ, with SageAttention's top-left
    mask (:func:`_top_left`), which no single :func:`lowbit_attn.attention_varlen` call expresses:
    one :func:`lowbit_attn.attention` call per sequence (the offsets read on the host)."""
    parts = []
    for q0, q1, k0, k1 in checks.sequences(q, k, v, cu_q, cu_k, max_q, max_k):
        if q0 == q1 or k0 == k1:  # no rows, or rows that see no key: 0, as attention_varlen's
            parts.append(q.new_zeros(q1 - q0, q.shape[1], v.shape[-1]))
            continue
        qs, ks, vs = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
        ks, vs, mask = _top_left(qs, ks, vs, "NHD", True)
        parts.append(attention(qs, ks, vs, scale=scale, layout="NHD", recipe=recipe, **mask)[0])
    return torch.cat(parts)


def sageattn3_blackwell(q, k, v, attn_mask=None, is_causal=False, per_block_mean=True, **kwargs):
    """SageAttention3 (FP4 on Blackwell) → recipe ``"qk_fp4_pv_fp4"`` (NVFP4 Q·Kᵀ and P·V, K
    smoothed, Q smoothed per block of 128 rows with the ΔS correction, two-level P̃). Runs on FP4
    tensor cores on sm_100/sm_120 and as an exact emulation elsewhere (CPU included). Unlike
    theirs, ``k`` is not modified (their preprocessing subtracts K's mean in place).

    Args:
        q: ``[B, Hq, N, D]`` only (HND, as theirs); D a multiple of 32 for NVFP4 (theirs falls
            back to SDPA for D >= 256).
        k: ``[B, Hkv, N, D]``, q's dtype and device.
        v: the same shape as k.
        attn_mask: ``None``, or exact attention with the mask and a warning (theirs ignores it).
        is_causal: → ``is_causal``.
        per_block_mean: ``True`` (their default: Q's mean per 128-row block, the ΔS correction) →
            ``Recipe.smooth_q=True`` with ``block_q=128``, the same; ``False`` (one Q mean per
            head) has no per-head form here and also runs per-block smoothing (finer).
        **kwargs: ignored with a warning per name (theirs ignores them; ``sm_scale`` and
            ``scale`` included: the scale is ``D ** -0.5``, as theirs).

    Returns:
        The output, q's dtype and shape.

    Raises:
        TypeError: as :func:`lowbit_attn.attention`; ``per_block_mean`` not a bool; an
            ``attn_mask`` that is not a tensor.
        ValueError: as :func:`lowbit_attn.attention`, including a head dim that is not a multiple
            of 32.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat import sageattention
        >>> q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))   # [B, H, N, D]
        >>> sageattention.sageattn3_blackwell(q, k, v, is_causal=True).shape
        torch.Size([1, 2, 64, 64])
    """
    name = "sageattn3_blackwell"
    _flag("per_block_mean", per_block_mean)
    mask, _ = _keywords(name, attn_mask, None, kwargs, scale_keyword=False)
    return _run(name, q, k, v, tensor_layout="HND", is_causal=is_causal, sm_scale=None,
                return_lse=False, recipe=get_recipe("qk_fp4_pv_fp4"), attn_mask=mask)


__all__ = [
    "sageattn", "sageattn_qk_int8_pv_fp16_triton", "sageattn_qk_int8_pv_fp16_cuda",
    "sageattn_qk_int8_pv_fp8_cuda", "sageattn_qk_int8_pv_fp8_cuda_sm90", "sageattn_varlen",
    "sageattn3_blackwell",
]
