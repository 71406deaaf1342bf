"""The trainable attention's public function: argument checks, recipe, dispatch to the custom op."""

from __future__ import annotations

import torch

from lowbit_attn.core import checks, variants
from lowbit_attn.training import op as train_ops
from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.options import check_env
from lowbit_attn.core.recipes import TrainRecipe, resolve_train

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def trainable_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "HND",
    recipe: str | TrainRecipe = "sagebwd_int8",
    smooth_k: bool | None = None,
    smooth_q: bool | None = None,
    keep_16bit: tuple[str, ...] | None = None,
    balance_qk: bool | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    sinks: None = None,
) -> torch.Tensor:
    """Differentiable 8-bit attention ``softmax(q·kᵀ·scale)·v`` for training (SageBwd).

    The backward recomputes the scores from the saved LSE (no ``N×N`` tensor on the GPU path) and
    takes Δ from the same P and dP that dS uses, so every row of dS sums to zero up to rounding.
    Inputs that do not require grad get none.

    Args:
        q: ``[B, Hq, Nq, D]`` (``"HND"``) or ``[B, Nq, Hq, D]`` (``"NHD"``). float16 or bfloat16 on a
            GPU; the CPU reference also takes float32 and float64. Under ``torch.autocast``, q,
            k and v are cast to its dtype first (float64 kept), as PyTorch's SDPA does.
        k: ``[B, Hkv, Nk, D]`` or ``[B, Nk, Hkv, D]``, q's dtype and device; ``Hq`` a multiple
            of ``Hkv`` (GQA). Head dims 64 and 128 are the fast path; 1 to 256 work.
        v: the same shape, dtype and device as k.
        is_causal: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq`` (bottom-right, as
            FlashAttention).
        scale: softmax scale, ``D ** -0.5`` by default.
        layout: ``"HND"`` or ``"NHD"``; the output and the gradients keep the inputs' layout.
        recipe: ``"sagebwd_int8"`` (INT8 in six of the seven matmuls, ``dP = dO·Vᵀ`` in 16-bit),
            ``"exact"`` (no quantization; fp16/bf16 operands with fp32 accumulation on a GPU, the
            input precision on a CPU), or a :class:`TrainRecipe`.
        smooth_k: subtract K's per-channel mean before quantizing it (exact; recommended).
            ``None``: the recipe's setting (on for ``"sagebwd_int8"``).
        smooth_q: subtract each 64-row block's mean from Q and add the correction back in fp32
            (exact; costs an ``[Nq/64, Nk]`` fp32 correction per head, so not O(N) memory).
            ``None``: the recipe's setting (off).
        keep_16bit: matmuls to keep in 16-bit (names among ``"qk"``, ``"pv"``, ``"dp"``, ``"dv"``,
            ``"dq"``, ``"dk"``); the others of a quantized recipe run in INT8. ``()`` puts dP in
            INT8 too. ``None`` keeps the recipe's choice.
        balance_qk: rescale Q's and K's channels by ``α``/``1/α`` before quantizing (exact; the
            gradients are scaled back): for models with outlier channels in Q or K. Not part of
            SageBwd; ``None``: the recipe's setting (off).
        window: ``(left, right)`` as for :func:`~lowbit_attn.attention` (FlashAttention's
            ``window_size``, aligned bottom-right; with ``is_causal`` the right bound is 0); the
            gradients see the same mask.
        softcap: ``c > 0``: scores ``c·tanh(S/c)`` (Gemma 2); the backward multiplies dS by
            ``1 - tanh²``. With K smoothed, the tanh takes the true scores (each row's ``q·mean
            K`` added back) and dQ gets ``Σ_j dS_ij·mean K`` (a softcap's dS rows do not sum to
            zero).
        chunk: ``C > 0``: chunked local attention as for :func:`~lowbit_attn.attention`.
        sinks: not supported in training (``None`` only).

    Returns:
        The output, q's shape, dtype and layout. Rows that see no key give 0 (and zero
            gradients).

    Raises:
        TypeError: q, k or v is not a tensor, has another dtype than float16, bfloat16, float32
            or float64, or their dtypes differ; a flag that is not a bool; ``scale`` not a real
            number; ``recipe`` neither a str nor a :class:`TrainRecipe`; ``keep_16bit`` not a
            tuple of names; inputs other than float16/bfloat16 where the Triton kernels run.
        ValueError: the checks of ``window``, ``softcap`` and ``chunk`` of :func:`attention`;
            ``sinks`` given; the shape and device checks of :func:`attention`; an unknown
            ``layout``,
            recipe name or matmul name in ``keep_16bit``; ``scale`` not positive and finite; a
            ``LOWBIT_ATTN_*`` variable set to a value outside its choices; inputs differentiated
            other than in reverse mode (a forward-mode tangent, ``torch.func.grad``/``vjp``/
            ``jvp``).
        RuntimeError: a double backward (gradients of the gradients);
            ``LOWBIT_ATTN_BACKEND=triton`` for CPU tensors without ``TRITON_INTERPRET=1``.

    Examples:
        >>> import torch, lowbit_attn
        >>> q, k, v = (torch.randn(1, 2, 64, 32).requires_grad_() for _ in range(3))
        >>> out = lowbit_attn.trainable_attention(q, k, v, is_causal=True)
        >>> out.sum().backward()
        >>> q.grad.shape
        torch.Size([1, 2, 64, 32])
    """
    q, k, v = checks.operands(q, k, v)
    qh, kh, vh = checks.dense_qkv(q, k, v, layout, dtypes=checks.FLOAT_DTYPES + (torch.float64,))
    other = checks.other_autodiff(q, k, v)
    if other is not None:
        raise ValueError(
            f"trainable_attention's gradients are reverse-mode only (loss.backward(), "
            f"torch.autograd.grad); {other} cannot differentiate it: use "
            "torch.nn.functional.scaled_dot_product_attention there")
    is_causal = checks.flag("is_causal", is_causal)
    for name, value in (("smooth_k", smooth_k), ("smooth_q", smooth_q), ("balance_qk", balance_qk)):
        if value is not None:
            checks.flag(name, value)
    if sinks is not None:
        refused = ("sinks are not supported by trainable_attention (forward-only: "
                   "lowbit_attn.attention); pass sinks=None")
        if not isinstance(sinks, torch.Tensor):  # not even what attention() takes
            raise TypeError(f"{refused}, got {checks.shown(sinks)}")
        raise ValueError(refused)
    variant = variants.check(is_causal=is_causal, window=window, softcap=softcap, chunk=chunk,
                             sinks=None, hq=qh.shape[1], device=q.device)
    r = resolve_train(recipe, smooth_k=smooth_k, smooth_q=smooth_q, keep_16bit=keep_16bit,
                      balance_qk=balance_qk)
    if backend_for(q.device) == "triton" and q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"trainable_attention's kernels take float16 or bfloat16 inputs, got {q.dtype}; cast q, "
            "k, v (e.g. under torch.autocast) or use LOWBIT_ATTN_BACKEND=reference"
        )
    sm_scale = checks.softmax_scale(scale, q.shape[-1])
    check_env()  # the backward reads them: a bad value raises here, not in it
    nq, nk = qh.shape[2], kh.shape[2]
    if nq == 0:  # no rows: an empty output in the graph, zero gradients for q, k and v
        return q * 0 + (k.sum() + v.sum()).to(q.dtype) * 0
    return train_ops.call(
        q, k, v, r, scale=sm_scale, is_causal=variant.causal, causal_offset=nk - nq,
        nhd=layout == "NHD", variant=variant,
    )
