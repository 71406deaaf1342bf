"""The public inference functions: argument checks, the recipe, then the custom op."""

from __future__ import annotations

import torch

from lowbit_attn.core import checks, variants
from lowbit_attn.core.recipes import Recipe, resolve_for
from lowbit_attn.inference import op, planned


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "HND",
    recipe: str | Recipe = "auto",
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
):
    """Low-bit attention ``softmax(q·kᵀ·scale)·v``.

    On a CUDA GPU the Triton kernels run; on a CPU the PyTorch reference with the same numerics.
    With launch plans (``LOWBIT_ATTN_LAUNCH=plan``, the default), an eager call whose
    configuration was seen twice replays its launches (:mod:`lowbit_attn.inference.planned`).
    The caller's tensors are never modified. NaN or Inf in an input is never hidden: it reaches
    the outputs that depend on it, and may reach more (K smoothing and the per-head scales
    spread one in Q or K over its head, and Q/K balancing over the query heads that share its
    KV head; one in V reaches the rows that mask its key too, a zero weight times NaN, as in
    PyTorch's math SDPA).

    Args:
        q: ``[B, Hq, Nq, D]`` (layout ``"HND"``) or ``[B, Nq, Hq, D]`` (``"NHD"``); float16, bfloat16
            or float32; any strides and storage offset. Under ``torch.autocast``, q, k and v are
            cast to its dtype first, as PyTorch's SDPA does.
        k: ``[B, Hkv, Nk, D]`` or ``[B, Nk, Hkv, D]``, same dtype and device as q; ``Hq`` must be a
            multiple of ``Hkv`` (GQA/MQA). Head dims 64 and 128 are the fast path; 1 to 256 work.
        v: the same shape, dtype and device as k.
        is_causal: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq`` (aligned bottom-right, as in
            FlashAttention; rows that see no key give 0). ``bool`` or ``numpy.bool_``.
        scale: softmax scale, ``D ** -0.5`` by default; any real number from ``2**-125`` to
            ``2**126`` (what stays a normal float32 in the kernels). A score ``scale·q·k`` past
            float32's range makes its row NaN, as in PyTorch's SDPA.
        layout: ``"HND"`` or ``"NHD"``; the output has the same layout.
        recipe: ``"auto"`` (FP8 P·V on sm_89 and newer, FP16 P·V before and on CPU),
            ``"qk_int8_pv_fp8"``, ``"qk_int8_pv_fp16"``, ``"qk_fp4_pv_fp4"`` (NVFP4; head dim a
            multiple of 32), ``"qk_mxfp4_pv_mxfp4"``, ``"exact"``, or a :class:`Recipe`. FP4
            recipes run on FP4 tensor cores on Blackwell (sm_100, sm_120) and as an exact
            emulation elsewhere (see ``lowbit-attn doctor``).
        return_lse: also return the natural-log log-sum-exp of each row's true scores (what K
            smoothing removed is added back, so outputs over different key ranges merge as
            FlashAttention's do).
        window: ``(left, right)``, FlashAttention's ``window_size``: query ``i`` sees key ``j``
            only if ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (aligned bottom-right);
            ``-1`` leaves that side unbounded; ``None`` or ``(-1, -1)``: no window. With
            ``is_causal`` the right bound is 0 whatever ``right`` says. Mistral's
            ``sliding_window=W`` (and Gemma's sliding layers) is ``window=(W - 1, 0)`` with
            ``is_causal=True``. The kernels visit only the key blocks a query block's window
            meets, so a window costs in proportion to its width.
        softcap: ``c > 0``: the scaled scores become ``c·tanh(S/c)`` before the masks and the
            softmax (Gemma 2's ``attn_logit_softcapping``); ``None`` or 0: off.
        sinks: ``[Hq]`` float32, bfloat16 or float16 on q's device, one logit per query head
            (gpt-oss): it joins every row's softmax denominator and contributes no value,
            ``out_i = Σ_j e^{S_ij}·v_j / (Σ_j e^{S_ij} + e^{sink_h})``. A row that sees no key
            gives 0. The LSE (``return_lse``) includes the sink term.
        chunk: ``C > 0``: chunked local attention (Llama 4's ``attention_chunk_size``): key ``j``
            is visible to query ``i`` only if ``j // C == (i + Nk - Nq) // C``, on top of the
            causal mask and the window when given (both rules apply).

    Returns:
        The output (q's dtype, shape and layout), or with ``return_lse`` a tuple of the output and
            the LSE ``[B, Hq, Nq]`` fp32 (``-inf`` for rows that see no key and no sink).

    Raises:
        TypeError: q, k or v is not a tensor, or not float16, bfloat16 or float32, or their dtypes
            differ; ``is_causal`` or ``return_lse`` is not a bool; ``scale`` is not a real number;
            ``recipe`` is neither a str nor a :class:`Recipe`; ``window`` not a pair of ints,
            ``softcap`` or ``chunk`` of another type, ``sinks`` not a tensor or of another dtype.
        ValueError: a window side below -1, ``softcap`` not positive or above 2**16, ``chunk`` not
            positive, ``sinks`` of another shape than ``[Hq]``, on another device or requiring
            grad; a tensor is not 4-D; an unknown ``layout`` or recipe name; q, k, v on
            different devices; k and v of different shapes; batch sizes or head dims that differ,
            a head dim outside 1 to 256, ``Hq`` not a multiple of ``Hkv``, or no key tokens;
            ``scale`` not positive and finite; an input that requires grad while autograd is on
            or carries a forward-mode tangent (``torch.autograd.forward_ad``, ``torch.func``'s
            differentiating transforms): the kernels are forward-only; a recipe this GPU cannot run (INT8 needs compute
            capability 8.0, FP8 P·V 8.9) or an FP4 recipe with a head dim that is not a multiple
            of 32; a ``LOWBIT_ATTN_*`` variable set to a value outside its choices.
        RuntimeError: ``LOWBIT_ATTN_BACKEND=triton`` for CPU tensors without
            ``TRITON_INTERPRET=1``.

    Examples:
        >>> import torch, lowbit_attn
        >>> # [B, H, N, D], on the CPU here
        >>> q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
        >>> out = lowbit_attn.attention(q, k, v, is_causal=True)
        >>> out.shape
        torch.Size([1, 2, 64, 32])
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention
        >>> exact = sdpa(q, k, v, is_causal=True)
        >>> lowbit_attn.errors(out, exact).cosine > 0.999
        True
        >>> out, lse = lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8",
        ...                                  return_lse=True)
        >>> lse.shape, lse.dtype
        (torch.Size([1, 2, 64]), torch.float32)
    """
    q, k, v = checks.operands(q, k, v)
    plan_key = planned.key(q, k, v, is_causal, scale, layout, recipe, return_lse,
                           (window, softcap, chunk), sinks)
    if plan_key is not None:
        found = planned.replay(plan_key, (q, k, v))
        if found is not None:
            return found if return_lse else found[0]
    qh, kh, vh = checks.dense_qkv(q, k, v, layout)
    is_causal = checks.flag("is_causal", is_causal)
    return_lse = checks.flag("return_lse", return_lse)
    checks.forward_only(q, k, v)
    variant = variants.check(is_causal=is_causal, window=window, softcap=softcap, chunk=chunk,
                             sinks=sinks, hq=qh.shape[1], device=q.device)
    r = resolve_for(recipe, q.device)
    checks.recipe_fits(r, q.shape[-1])
    sm_scale = checks.softmax_scale(scale, q.shape[-1])
    b, hq, nq, _ = qh.shape
    nk = kh.shape[2]
    if nq == 0 or hq == 0:  # nothing to compute (the quantizers' reductions need elements)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    out, lse = op.call(
        q, k, v, r, scale=sm_scale, is_causal=variant.causal, causal_offset=nk - nq,
        nhd=layout == "NHD", return_lse=return_lse, plan_key=plan_key, variant=variant,
        sinks=sinks,
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
    recipe: str | Recipe = "auto",
    return_lse: bool = False,
    check_seqlens: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
):
    """Attention over packed sequences, as FlashAttention's ``flash_attn_varlen_func``.

    Smoothing and quantization statistics are per sequence, never across sequences.

    Args:
        q: ``[total_q, Hq, D]``; sequence ``b`` holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
            float16, bfloat16 or float32 (cast under ``torch.autocast``, as :func:`attention`).
        k: ``[total_k, Hkv, D]``, q's dtype and device; ``Hq`` a multiple of ``Hkv``.
        v: the same shape, dtype and device as k.
        cu_seqlens_q: int32 (or int64) ``[B + 1]`` offsets into q on q's device, from 0 to
            ``total_q``, non-decreasing.
        cu_seqlens_k: the same for k and v, for the same ``B`` sequences.
        max_seqlen_q: an int at least the longest query sequence.
        max_seqlen_k: an int at least the longest key sequence.
        is_causal: per sequence, aligned bottom-right.
        scale: softmax scale, ``D ** -0.5`` by default.
        recipe: as for :func:`attention`.
        return_lse: also return the natural-log LSE of each row.
        check_seqlens: verify the offsets and maxima (reads ``cu_seqlens`` on the host: a GPU
            synchronisation and, under ``torch.compile``, a graph break). ``False`` for offsets
            known good, inside CUDA graphs or compiled code.
        window: as for :func:`attention`, each sequence aligned bottom-right on its own
            (``Nq``, ``Nk``: that sequence's lengths).
        softcap: as for :func:`attention`.
        sinks: as for :func:`attention`.
        chunk: as for :func:`attention`, each sequence on its own.

    Returns:
        The output ``[total_q, Hq, D]`` (q's dtype), or with ``return_lse`` a tuple of the output
            and the LSE ``[Hq, total_q]`` fp32.

    Raises:
        TypeError: as :func:`attention` for q, k, v, the flags, ``scale``, ``recipe`` and the
            variants; a ``cu_seqlens`` that is not a tensor; a maximum that is not an int.
        ValueError: as :func:`attention` (tensors here are 3-D); a ``cu_seqlens`` that is not a
            1-D integer tensor of at least two offsets on q's device, or (with ``check_seqlens``)
            does not run from 0 to the packed length without decreasing; ``cu_seqlens_q`` and
            ``cu_seqlens_k`` of different lengths; a maximum below the longest sequence.
        RuntimeError: as :func:`attention`.

    Examples:
        >>> import torch, lowbit_attn
        >>> # two sequences, packed
        >>> lengths = [37, 64]
        >>> cu = torch.tensor([0, 37, 101], dtype=torch.int32)  # cumulative lengths
        >>> # [total, H, D]
        >>> q, k, v = (torch.randn(sum(lengths), 2, 32) for _ in range(3))
        >>> n = max(lengths)
        >>> out = lowbit_attn.attention_varlen(q, k, v, cu, cu, n, n, is_causal=True)
        >>> out.shape
        torch.Size([101, 2, 32])
    """
    q, k, v = checks.operands(q, k, v)
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
    checks.same_sequence_count(cu_seqlens_q, cu_seqlens_k)
    max_seqlen_q = checks.max_seqlen("max_seqlen_q", max_seqlen_q, bq)
    max_seqlen_k = checks.max_seqlen("max_seqlen_k", max_seqlen_k, bk)
    variant = variants.check(is_causal=is_causal, window=window, softcap=softcap, chunk=chunk,
                             sinks=sinks, hq=q.shape[1], device=q.device)
    r = resolve_for(recipe, q.device)
    checks.recipe_fits(r, q.shape[-1])
    sm_scale = checks.softmax_scale(scale, q.shape[-1])
    if q.shape[1] == 0:  # no query heads: nothing to compute, as in attention()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((0, q.shape[0]), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    out, lse = op.call_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, r,
                               scale=sm_scale, is_causal=variant.causal, return_lse=return_lse,
                               variant=variant, sinks=sinks)
    return (out, lse) if return_lse else out
