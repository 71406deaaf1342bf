"""The attention forwards (dense and packed) as ``torch.library`` custom ops with fake
implementations, so ``torch.compile`` traces calls to the public functions without graph breaks and
the ops stay opaque to it (quantization and kernel launches inside).

Inside an op, :func:`run` picks the implementation once, by the backend that
:func:`~lowbit_attn.core.arch.backend_for` chose: :func:`kernel` (quantizers and attention on
Triton) or its twin :func:`naive` (PyTorch), called with the same arguments."""

from __future__ import annotations

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.counters import count_call
from lowbit_attn.core.operands import Seqs
from lowbit_attn.core.options import KernelOptions
from lowbit_attn.core.recipes import Recipe, recipe_from_key, recipe_key
from lowbit_attn.core.variants import PLAIN, Variant
from lowbit_attn.inference import planned
from lowbit_attn.inference.naive import exact_attention, fp4_attention, quantized_attention
from lowbit_attn.inference.prepare import quantize_qkv, quantize_qkv_fp4


def kernel(q, k, v, *, out: torch.Tensor, recipe: Recipe, scale: float, causal_offset: int | None,
           return_lse: bool, seqs: tuple[Seqs, Seqs] | None,
           options: KernelOptions, variant: Variant = PLAIN,
           sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """The Triton path: quantizers and attention kernel (INT8 dense or packed, FP4 dense), or
    :func:`naive` for what has no kernel (the exact recipe). Arguments and result: :func:`run`.
    With ``options.kernel`` ``"sm90"`` or ``"gluon"`` the INT8 attention goes through
    :func:`lowbit_attn.inference.sm90_check.attention` (the one-warpgroup Hopper forward where it
    applies and passed its check, the Triton kernel otherwise); with ``"gluon"`` the FP4
    attention goes through :func:`lowbit_attn.inference.gluon_fp4_check.attention` (the Gluon
    FP4 forward on sm_100 likewise). A ``variant`` other than plain attention runs on the
    Triton kernels, but for the sm90 forward, which takes windows, chunks and sinks (not
    softcap: a tanh per score in its loop)."""
    if recipe.is_exact:
        return naive(q, k, v, out=out, recipe=recipe, scale=scale, causal_offset=causal_offset,
                     return_lse=return_lse, seqs=seqs, options=options, variant=variant,
                     sinks=sinks)
    # softcap and sinks read K smoothing's per-row shift (the true scores' offset)
    need_shift = return_lse or variant.softcap > 0 or variant.sinks
    if recipe.is_fp4:
        if seqs is not None:  # no packed FP4 kernel
            return _per_sequence(kernel, q, k, v, out=out, recipe=recipe, scale=scale,
                                 causal_offset=causal_offset, return_lse=return_lse, seqs=seqs,
                                 options=options, variant=variant, sinks=sinks)
        from lowbit_attn.inference import kernel_fp4

        qz = quantize_qkv_fp4(q, k, v, recipe, scale, need_lse_shift=need_shift, backend="triton")
        fp4_forward = kernel_fp4.attention
        if not variant.plain:
            return fp4_forward(
                qz, out=out, head_dim=q.shape[-1], block_q=recipe.block_q,
                block_k=recipe.block_k, causal_offset=causal_offset, two_level=recipe.two_level_p,
                return_lse=return_lse, variant=variant, sinks=sinks,
            )
        if options.forward_kernel(q.device) == "gluon":  # where it applies, passed its check
            from lowbit_attn.inference import gluon_fp4_check

            fp4_forward = gluon_fp4_check.attention
        return fp4_forward(
            qz, out=out, head_dim=q.shape[-1], block_q=recipe.block_q, block_k=recipe.block_k,
            causal_offset=causal_offset, two_level=recipe.two_level_p, return_lse=return_lse,
        )
    from lowbit_attn.inference import kernel_int8, sm90_check

    seqs_q, seqs_k = seqs if seqs is not None else (None, None)
    # The one-warpgroup Hopper forward where it covers the call and is admitted on this device:
    # decided before quantizing, because it takes V's keys permuted.
    chosen = options.forward_kernel(q.device)
    sm90 = (variant.softcap == 0 and chosen in ("sm90", "gluon") and sm90_check.applies(q.device)
            and sm90_check.wanted(recipe, q.shape[-1], packed=seqs is not None)
            and sm90_check.admitted(q.device))
    qz = quantize_qkv(
        q, k, v, recipe, scale, need_lse_shift=need_shift, backend="triton", seqs_q=seqs_q,
        seqs_k=seqs_k, permute_v=sm90 and recipe.pv == "fp8",
    )
    forward = sm90_check.attention if sm90 else kernel_int8.attention
    return forward(
        qz, out=out, pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
        block_k=recipe.block_k, causal_offset=causal_offset, return_lse=return_lse,
        seqs_q=seqs_q, seqs_k=seqs_k, variant=variant, sinks=sinks,
    )


def naive(q, k, v, *, out: torch.Tensor, recipe: Recipe, scale: float, causal_offset: int | None,
          return_lse: bool, seqs: tuple[Seqs, Seqs] | None,
          options: KernelOptions, variant: Variant = PLAIN,
          sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """The PyTorch twin of :func:`kernel`, the same arguments and result (packed sequences one
    at a time)."""
    if seqs is not None:
        return _per_sequence(naive, q, k, v, out=out, recipe=recipe, scale=scale,
                             causal_offset=causal_offset, return_lse=return_lse, seqs=seqs,
                             options=options, variant=variant, sinks=sinks)
    need_shift = return_lse or variant.softcap > 0 or variant.sinks
    if recipe.is_exact:
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        o, lse = exact_attention(q, k, v, scale=scale, causal_offset=causal_offset, dtype=dtype,
                                 variant=variant, sinks=sinks)
    elif recipe.is_fp4:
        qz = quantize_qkv_fp4(q, k, v, recipe, scale, need_lse_shift=need_shift,
                              backend="reference")
        o, lse = fp4_attention(
            qz, head_dim=q.shape[-1], block_q=recipe.block_q, block_k=recipe.block_k,
            causal_offset=causal_offset, two_level=recipe.two_level_p, variant=variant,
            sinks=sinks,
        )
    else:
        qz = quantize_qkv(q, k, v, recipe, scale, need_lse_shift=need_shift, backend="reference")
        o, lse = quantized_attention(
            qz, pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
            block_k=recipe.block_k, causal_offset=causal_offset, variant=variant, sinks=sinks,
        )
    out.copy_(o)
    return lse.float() if return_lse else None


def _as_dense(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a packed ``[total, H, D]`` tensor as a ``[1, H, n, D]`` view."""
    return x[lo:hi].transpose(0, 1).unsqueeze(0)


def _per_sequence(attend, q, k, v, *, out, recipe, scale, causal_offset, return_lse, seqs,
                  options, variant=PLAIN, sinks=None):
    """Packed sequences through ``attend``'s dense path, one sequence at a time (each aligned
    bottom-right when causal)."""
    bounds_q, bounds_k = (s.cu_seqlens.tolist() for s in seqs)  # host offsets for the loop
    lse_all = (torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                          device=q.device) if return_lse else None)
    for b in range(seqs[0].batch):
        q0, q1 = bounds_q[b], bounds_q[b + 1]
        k0, k1 = bounds_k[b], bounds_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # no key: 0 (NaN under a NaN sink), and with sinks an LSE of the sink alone
            out[q0:q1].zero_()
            if sinks is not None:
                out[q0:q1].masked_fill_(sinks.isnan()[:, None], float("nan"))
            if return_lse and sinks is not None:
                lse_all[:, q0:q1] = sinks.float()[:, None]
            continue
        lse = attend(
            _as_dense(q, q0, q1), _as_dense(k, k0, k1), _as_dense(v, k0, k1),
            out=_as_dense(out, q0, q1), recipe=recipe, scale=scale,
            causal_offset=None if causal_offset is None else (k1 - k0) - (q1 - q0),
            return_lse=return_lse, seqs=None, options=options, variant=variant, sinks=sinks,
        )
        if return_lse:
            lse_all[:, q0:q1] = lse[0]
    return lse_all


def run(q, k, v, *, out: torch.Tensor, recipe: Recipe, scale: float, causal_offset: int | None,
        return_lse: bool, backend: str, seqs: tuple[Seqs, Seqs] | None = None,
        options: KernelOptions = KernelOptions(), variant: Variant = PLAIN,
        sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of logical ``[B, H, N, D]`` views (or packed ``[total, H, D]`` tensors with
    ``seqs``) written into ``out``; returns the natural-log LSE (``[B, Hq, Nq]`` or
    ``[Hq, total]`` fp32) when ``return_lse``. ``causal_offset``: key ``j`` is visible to query
    ``i`` iff ``j <= i + causal_offset``; None when not causal (packed sequences: any int, each
    sequence is aligned bottom-right). ``backend``: ``"triton"`` or ``"reference"``; ``options``:
    where the Triton path does some of its work (the same values either way). ``variant``:
    window, chunk, softcap and whether ``sinks`` (``[Hq]``) are given
    (:class:`~lowbit_attn.core.variants.Variant`; with a window or chunk ``causal_offset`` is
    unused: its ``right`` holds the causal bound)."""
    attend = kernel if backend == "triton" else naive
    with checks.no_autocast(q):
        return attend(q, k, v, out=out, recipe=recipe, scale=scale, causal_offset=causal_offset,
                      return_lse=return_lse, seqs=seqs, options=options, variant=variant,
                      sinks=sinks)


def forward(q, k, v, recipe: Recipe, scale: float, is_causal: bool, causal_offset: int, nhd: bool,
            return_lse: bool, variant: Variant = PLAIN,
            sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of validated ``q, k, v`` in layout HND (``nhd`` False) or NHD; returns the output
    in q's shape (contiguous) and the LSE ``[B, Hq, Nq]`` (an empty tensor unless
    ``return_lse``): what :func:`attention_fwd` computes, called directly in eager mode."""
    qh, kh, vh = (x.transpose(1, 2) if nhd else x for x in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = run(
        qh, kh, vh, out=out.transpose(1, 2) if nhd else out, recipe=recipe,
        scale=scale, causal_offset=causal_offset if is_causal else None, return_lse=return_lse,
        backend=backend_for(q.device), options=KernelOptions.from_env(), variant=variant,
        sinks=sinks,
    )
    return out, _lse_or_empty(lse, q)


def _variant(left: int, right: int, chunk: int, softcap: float, sinks) -> Variant:
    return Variant(left=left, right=right, chunk=chunk, softcap=softcap, sinks=sinks is not None)


@torch.library.custom_op("lowbit_attn::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: str, scale: float, is_causal: bool,
    causal_offset: int, nhd: bool, return_lse: bool, left: int = -1, right: int = -1,
    chunk: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` with the recipe :func:`~lowbit_attn.core.recipes.recipe_key` encodes, as an
    op ``torch.compile`` and other tracers see whole; ``left`` to ``sinks``: the
    :class:`~lowbit_attn.core.variants.Variant` and the sinks tensor."""
    count_call("attention")
    return forward(q, k, v, recipe_from_key(recipe), scale, is_causal, causal_offset, nhd,
                   return_lse, _variant(left, right, chunk, softcap, sinks), sinks)


def _lse_or_empty(lse: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.float32, device=q.device) if lse is None else lse


@attention_fwd.register_fake
def _(q, k, v, recipe, scale, is_causal, causal_offset, nhd, return_lse, left=-1, right=-1,
      chunk=0, softcap=0.0, sinks=None):
    b, hq, nq = (q.shape[0], q.shape[2], q.shape[1]) if nhd else q.shape[:3]
    lse = q.new_empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), lse  # the op returns a contiguous output


@torch.library.custom_op("lowbit_attn::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, recipe: str, scale: float,
    is_causal: bool, return_lse: bool, left: int = -1, right: int = -1, chunk: int = 0,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of validated packed ``[total, H, D]`` sequences; the output in q's shape and
    the LSE ``[Hq, total_q]`` (an empty tensor unless ``return_lse``)."""
    count_call("attention")
    batch = cu_seqlens_q.numel() - 1
    seqs = tuple(Seqs(batch, max(n, 1), cu.to(torch.int32))
                 for cu, n in ((cu_seqlens_q, max_seqlen_q), (cu_seqlens_k, max_seqlen_k)))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = run(
        q, k, v, out=out, recipe=recipe_from_key(recipe), scale=scale,
        causal_offset=0 if is_causal else None, return_lse=return_lse,
        backend=backend_for(q.device), seqs=seqs, options=KernelOptions.from_env(),
        variant=_variant(left, right, chunk, softcap, sinks), sinks=sinks,
    )
    return out, _lse_or_empty(lse, q)


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, recipe, scale, is_causal,
      return_lse, left=-1, right=-1, chunk=0, softcap=0.0, sinks=None):
    lse = q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), lse


def _variant_args(variant: Variant, sinks) -> tuple:
    return (variant.left, variant.right, variant.chunk, variant.softcap, sinks)


def call(q, k, v, recipe: Recipe, *, scale: float, is_causal: bool, causal_offset: int,
         nhd: bool, return_lse: bool, plan_key: tuple | None = None, variant: Variant = PLAIN,
         sinks: torch.Tensor | None = None):
    """Run the dense op with a :class:`Recipe`: :func:`forward` directly with a ``plan_key``
    (an eager call; see :mod:`lowbit_attn.inference.planned`), else the custom op."""
    if plan_key is None:
        if variant.plain:
            return attention_fwd(q, k, v, recipe_key(recipe), scale, is_causal, causal_offset,
                                 nhd, return_lse)
        return attention_fwd(q, k, v, recipe_key(recipe), scale, is_causal, causal_offset, nhd,
                             return_lse, *_variant_args(variant, sinks))
    count_call("attention")
    return planned.call(
        plan_key,
        lambda: forward(q, k, v, recipe, scale, is_causal, causal_offset, nhd, return_lse,
                        variant, sinks),
        (q, k, v), backend_for(q.device),
    )


def call_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, recipe: Recipe, *, scale: float,
                is_causal: bool, return_lse: bool, variant: Variant = PLAIN,
                sinks: torch.Tensor | None = None):
    """Run the packed op with a :class:`Recipe`."""
    if variant.plain:
        return attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, recipe_key(recipe), scale,
                                    is_causal, return_lse)
    return attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, recipe_key(recipe), scale,
                                is_causal, return_lse, *_variant_args(variant, sinks))
