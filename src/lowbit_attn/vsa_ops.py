"""The fine stage of video sparse attention as ``torch.library`` custom ops, so ``torch.compile``
traces around the Triton kernels (fake implementations give the shapes):

- ``lowbit_attn::vsa_fine_fwd`` / ``::vsa_fine_bwd`` on padded tiles, joined by
  ``register_autograd`` (the gathers into tiles stay in PyTorch, differentiable);
- ``lowbit_attn::vsa_fine_int8``: the 8-bit fine stage for inference, row-major tokens in and out
  (quantization per token, gather into tiles, kernel or reference, scatter back).
"""

from __future__ import annotations

import torch

from .arch import backend_for
from .prepare import quantize_qkv
from .quantized import QuantizedQKV
from .recipes import Recipe
from .reference import vsa as ref
from .tiles import TileLayout, tile_layout

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the fine stage runs on the Triton kernels: fp16/bf16 on the Triton backend."""
    return x.dtype in KERNEL_DTYPES and backend_for(x.device) == "triton"


def tile_slots(layout: TileLayout, *, int8: bool) -> int:
    """Rows of a padded tile: the next power of two of the tile's tokens, at least 16 (32 for the
    8-bit stage: the depth of an FP8 MMA over P̃'s keys)."""
    return max(32 if int8 else 16, 1 << (layout.tile_tokens - 1).bit_length())


@torch.library.custom_op("lowbit_attn::vsa_fine_fwd", mutates_args=())
def fine_fwd(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, idx: torch.Tensor,
             counts: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded tiles in, ``(out tiles, base-2 LSE [B, Hq, nt, TS] fp32)`` out (see
    :func:`lowbit_attn.kernels.vsa_fine.forward`)."""
    from .kernels import vsa_fine

    return vsa_fine.forward(qt, kt, vt, idx, counts, scale=scale)


@fine_fwd.register_fake
def _(qt, kt, vt, idx, counts, scale):
    return torch.empty_like(qt), qt.new_empty(qt.shape[:4], dtype=torch.float32)


@torch.library.custom_op("lowbit_attn::vsa_fine_bwd", mutates_args=())
def fine_bwd(dot: torch.Tensor, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
             ot: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` padded tiles."""
    from .kernels import vsa_fine

    return vsa_fine.backward(qt, kt, vt, ot, lse, dot, idx, counts, scale=scale)


@fine_bwd.register_fake
def _(dot, qt, kt, vt, ot, lse, idx, counts, scale):
    return torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)


def _setup_context(ctx, inputs, output):
    qt, kt, vt, idx, counts, scale = inputs
    ot, lse = output
    ctx.save_for_backward(qt, kt, vt, ot, lse, idx, counts)
    ctx.scale = scale


def _backward(ctx, dot, dlse):
    qt, kt, vt, ot, lse, idx, counts = ctx.saved_tensors
    dq, dk, dv = fine_bwd(dot.contiguous(), qt, kt, vt, ot, lse, idx, counts, ctx.scale)
    return dq, dk, dv, None, None, None


fine_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("video_sparse_attention's fine stage does not support double backward")


def _save_nothing(ctx, inputs, output):
    pass


fine_bwd.register_autograd(_no_double_backward, setup_context=_save_nothing)


def fine_tiles(qh, kh, vh, layout: TileLayout, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """The 16-bit fine stage on the kernels, ``[B, H, N, D]`` row-major tokens in and out:
    differentiable gathers into padded tiles around the custom ops."""
    ts = tile_slots(layout, int8=False)
    tiles = [ref.gather_tiles(x, layout, ts).contiguous() for x in (qh, kh, vh)]
    ot, _ = fine_fwd(*tiles, idx.to(torch.int32).contiguous(), layout.counts.to(torch.int32), scale)
    return ref.scatter_tiles(ot, layout)


def int8_recipe(pv_fp8: bool, smooth_k: bool, smooth_v: bool, balance_qk: bool) -> Recipe:
    return Recipe(name="vsa_int8", qk="int8", pv="fp8" if pv_fp8 else "fp16",
                  granularity="per_token", smooth_k=smooth_k, smooth_v=smooth_v,
                  balance_qk=balance_qk)


def _padded_tiles(qz: QuantizedQKV, layout: TileLayout, ts: int) -> QuantizedQKV:
    """Token-space operands → padded tiles for the kernel (E4M3 V token-contiguous, as FP8 MMAs
    read it)."""
    def tiles(x):
        return ref.gather_tiles(x, layout, ts).contiguous()

    def row_tiles(x):
        return ref.gather_tiles(x.unsqueeze(-1), layout, ts).squeeze(-1).contiguous()

    v = ref.gather_tiles(qz.v, layout, ts)
    v = v.transpose(-1, -2).contiguous().transpose(-1, -2) if qz.v_scale is not None else v.contiguous()
    return QuantizedQKV(q=tiles(qz.q), q_scale=row_tiles(qz.q_scale), k=tiles(qz.k),
                        k_scale=row_tiles(qz.k_scale), v=v, v_scale=qz.v_scale, v_mean=qz.v_mean)


def run_int8(q, k, v, idx, layout: TileLayout, scale: float, recipe: Recipe, *,
             kernels: bool) -> torch.Tensor:
    """The 8-bit fine stage, ``[B, H, N, D]`` row-major tokens in, q's dtype out: per-token
    quantization, then the kernel on padded tiles or the reference."""
    qz = quantize_qkv(q, k, v, recipe, scale, need_lse_shift=False,
                      backend="triton" if kernels else "reference")
    if not kernels:
        return ref.fine_quantized(qz, layout, idx, pv=recipe.pv).to(q.dtype)
    from .kernels import vsa_fine

    ot = vsa_fine.forward_int8(_padded_tiles(qz, layout, tile_slots(layout, int8=True)),
                               idx.to(torch.int32).contiguous(), layout.counts.to(torch.int32),
                               out_dtype=q.dtype)
    return ref.scatter_tiles(ot, layout)


@torch.library.custom_op("lowbit_attn::vsa_fine_int8", mutates_args=())
def fine_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
              video_shape: list[int], tile: list[int], scale: float, pv_fp8: bool,
              smooth_k: bool, smooth_v: bool, balance_qk: bool) -> torch.Tensor:
    """:func:`run_int8` as an op (the recipe's options spelled out)."""
    layout = tile_layout(tuple(video_shape), tuple(tile), q.device)
    recipe = int8_recipe(pv_fp8, smooth_k, smooth_v, balance_qk)
    return run_int8(q, k, v, idx, layout, scale, recipe, kernels=use_kernels(q))


@fine_int8.register_fake
def _(q, k, v, idx, video_shape, tile, scale, pv_fp8, smooth_k, smooth_v, balance_qk):
    return torch.empty_like(q)


def fine_quantized(qh, kh, vh, layout: TileLayout, idx: torch.Tensor, scale: float,
                   recipe: Recipe) -> torch.Tensor:
    return fine_int8(qh, kh, vh, idx, list(layout.video_shape), list(layout.tile), scale,
                     recipe.pv == "fp8", recipe.smooth_k, recipe.smooth_v, recipe.balance_qk)
