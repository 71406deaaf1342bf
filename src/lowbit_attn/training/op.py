"""The trainable attention as two ``torch.library`` custom ops (forward, backward) joined by
``register_autograd``, with fake implementations so ``torch.compile`` traces them. Each op prepares
its operands and runs the Triton kernels (:func:`kernel_forward`, :func:`kernel_backward`) or their
PyTorch twins (:func:`naive_forward`, :func:`naive_backward`, the same arguments), picked once by
:func:`_implementation`."""

from __future__ import annotations

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.counters import count_call
from lowbit_attn.core.operands import GradOperands, TrainOperands
from lowbit_attn.core.options import KernelOptions
from lowbit_attn.core.recipes import TrainRecipe, recipe_from_key, recipe_key
from lowbit_attn.core.variants import PLAIN, Variant
from lowbit_attn.training import naive as ref
from lowbit_attn.training.prepare import prepare, prepare_grad


def _hnd(x: torch.Tensor, nhd: bool) -> torch.Tensor:
    return x.transpose(1, 2) if nhd else x


def kernel_forward(ops: TrainOperands, *, out: torch.Tensor, causal_offset: int | None,
                   variant: Variant = PLAIN) -> torch.Tensor:
    """Writes ``out`` (a ``[B, Hq, Nq, D]`` view) and returns the base-2 LSE ``[B, Hq, Nq]``;
    ``variant``: window, chunk and softcap (:class:`~lowbit_attn.core.variants.Variant`)."""
    from lowbit_attn.training import kernel_fwd

    return kernel_fwd.forward(ops, out=out, causal_offset=causal_offset, variant=variant)


def naive_forward(ops: TrainOperands, *, out: torch.Tensor, causal_offset: int | None,
                  variant: Variant = PLAIN) -> torch.Tensor:
    """The twin of :func:`kernel_forward` (LSE in fp64 for fp64 inputs)."""
    o, lse = ref.forward(ops, causal_offset=causal_offset, variant=variant)
    out.copy_(o)
    return lse.to(_lse_dtype(ops.dtype))


def kernel_backward(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, *, causal_offset: int | None,
                    softmax_scale: float, options: KernelOptions,
                    variant: Variant = PLAIN) -> None:
    """Writes ``dq [B, Hq, Nq, D]``, ``dk, dv [B, Hkv, Nk, D]`` (views); dQ as
    ``options.train_dq`` says, on the kernels ``options.bwd_kernel`` names where they apply (the
    sm90 ones on a CUDA device of capability 9.0, once they passed their check there:
    :mod:`~lowbit_attn.training.sm90_check`, and compile the call: ``run_backward``; plain
    attention only: a window, chunk or softcap runs on the Triton backward)."""
    from lowbit_attn.training import kernel_bwd, sm90_check

    sm90_check.run_backward(
        dq.device, options.bwd_kernel if variant.plain else "triton",
        lambda kernel: kernel_bwd.backward(ops, grad, lse, dq, dk, dv, causal_offset=causal_offset,
                                           softmax_scale=softmax_scale, mode=options.train_dq,
                                           kernel=kernel, variant=variant))


def naive_backward(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor, *, causal_offset: int | None,
                   softmax_scale: float, options: KernelOptions,
                   variant: Variant = PLAIN) -> None:
    """The twin of :func:`kernel_backward` (``options`` place work on the kernels only)."""
    grads = ref.backward(ops, grad, lse, causal_offset=causal_offset, softmax_scale=softmax_scale,
                         variant=variant)
    for g, r in zip((dq, dk, dv), grads):
        g.copy_(r)


def _implementation(device: torch.device):
    """``(backend, forward, backward)`` for tensors on ``device``: the family's one choice."""
    if backend_for(device) == "triton":
        return "triton", kernel_forward, kernel_backward
    return "reference", naive_forward, naive_backward


@torch.library.custom_op("lowbit_attn::train_fwd", mutates_args=())
def train_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: str, scale: float, is_causal: bool,
    causal_offset: int, nhd: bool, left: int = -1, right: int = -1, chunk: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (q's shape and dtype) and base-2 LSE ``[B, Hq, Nq]`` (fp32; fp64 for fp64 inputs)
    with the :class:`TrainRecipe` that :func:`~lowbit_attn.core.recipes.recipe_key` encodes."""
    count_call("trainable")
    recipe = recipe_from_key(recipe, TrainRecipe)
    qh, kh, vh = (_hnd(x, nhd) for x in (q, k, v))
    backend, forward, _ = _implementation(q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    with checks.no_autocast(q):
        ops = prepare(qh, kh, vh, recipe, scale, backend, softcap=softcap > 0)
        lse = forward(ops, out=_hnd(out, nhd), causal_offset=causal_offset if is_causal else None,
                      variant=Variant(left=left, right=right, chunk=chunk, softcap=softcap))
    return out, lse


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the reference's float64 gradients need it)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@train_fwd.register_fake
def _(q, k, v, recipe, scale, is_causal, causal_offset, nhd, left=-1, right=-1, chunk=0,
      softcap=0.0):
    b, hq, nq = (q.shape[0], q.shape[2], q.shape[1]) if nhd else q.shape[:3]
    return q.new_empty(q.shape), q.new_empty((b, hq, nq), dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("lowbit_attn::train_bwd", mutates_args=())
def train_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    recipe: str, scale: float, is_causal: bool, causal_offset: int, nhd: bool, left: int = -1,
    right: int = -1, chunk: int = 0, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the shapes and dtype of ``q, k, v``."""
    recipe = recipe_from_key(recipe, TrainRecipe)
    qh, kh, vh, doh = (_hnd(x, nhd) for x in (q, k, v, do))
    backend, _, backward = _implementation(q.device)
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    with checks.no_autocast(q):
        ops = prepare(qh, kh, vh, recipe, scale, backend, softcap=softcap > 0)
        grad = prepare_grad(doh, recipe, backend)
        backward(ops, grad, lse, *(_hnd(g, nhd) for g in grads),
                 causal_offset=causal_offset if is_causal else None, softmax_scale=scale,
                 options=KernelOptions.from_env(),
                 variant=Variant(left=left, right=right, chunk=chunk, softcap=softcap))
    return grads


@train_bwd.register_fake
def _(do, q, k, v, lse, recipe, scale, is_causal, causal_offset, nhd, left=-1, right=-1, chunk=0,
      softcap=0.0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    _, lse = output  # the backward does not read the output (Δ comes from P and dP)
    ctx.save_for_backward(q, k, v, lse)
    ctx.options = options


def _backward(ctx, grad_out, grad_lse):
    q, k, v, lse = ctx.saved_tensors
    dq, dk, dv = train_bwd(grad_out.contiguous(), q, k, v, lse, *ctx.options)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            *([None] * len(ctx.options)))


train_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "lowbit_attn.trainable_attention does not support double backward (gradients of its "
        "gradients); use exact attention (torch.nn.functional.scaled_dot_product_attention) there"
    )


def _save_nothing(ctx, inputs, output):
    pass


train_bwd.register_autograd(_no_double_backward, setup_context=_save_nothing)


def call(q, k, v, recipe: TrainRecipe, *, scale: float, is_causal: bool, causal_offset: int,
         nhd: bool, variant: Variant = PLAIN) -> torch.Tensor:
    if variant.plain:
        out, _ = train_fwd(q, k, v, recipe_key(recipe), scale, is_causal, causal_offset, nhd)
    else:
        out, _ = train_fwd(q, k, v, recipe_key(recipe), scale, is_causal, causal_offset, nhd,
                           variant.left, variant.right, variant.chunk, variant.softcap)
    return out
