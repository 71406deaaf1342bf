"""Video sparse attention's kernels as ``torch.library`` custom ops, so ``torch.compile`` traces
around them (fake implementations give the shapes):

- ``lowbit_attn::vsa_tile`` / ``::vsa_untile``: row-major tokens to padded tiles with the tile
  means, and back; each is the other's backward;
- ``lowbit_attn::vsa_fine_fwd`` / ``::vsa_fine_bwd``: the 16-bit fine stage on padded tiles, joined
  by ``register_autograd``;
- ``lowbit_attn::vsa_fine_int8``: the 8-bit fine stage for inference, row-major tokens in and out
  (quantization per token, tiles, kernel or reference, back to tokens).
"""

from __future__ import annotations

import torch

from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.counters import count_call
from lowbit_attn.core.options import KernelOptions
from lowbit_attn.core.operands import QuantizedQKV
from lowbit_attn.core.recipes import Recipe, recipe_from_key, recipe_key
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.vsa import naive as ref
from lowbit_attn.vsa.tiles import TileLayout, tile_layout

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the stages run on the Triton kernels (fp16/bf16 on the Triton backend) or on their
    PyTorch twins: the family's one choice."""
    return x.dtype in KERNEL_DTYPES and backend_for(x.device) == "triton"


def tile_slots(layout: TileLayout, *, int8: bool) -> int:
    """Rows of a padded tile: the next power of two of the tile's tokens, at least 16 (32 for the
    8-bit stage: the depth of an FP8 MMA over P̃'s keys)."""
    return max(32 if int8 else 16, 1 << (layout.tile_tokens - 1).bit_length())


@torch.library.custom_op("lowbit_attn::vsa_fine_fwd", mutates_args=())
def fine_fwd(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, idx: torch.Tensor,
             counts: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded tiles in, ``(out tiles, base-2 LSE [B, Hq, nt, TS] fp32)`` out (see
    :func:`lowbit_attn.vsa.kernel_fine.forward`)."""
    from lowbit_attn.vsa import kernel_fine as vsa_fine

    count_call("video_sparse")
    return vsa_fine.forward(qt, kt, vt, idx, counts, scale=scale)


@fine_fwd.register_fake
def _(qt, kt, vt, idx, counts, scale):
    return torch.empty_like(qt), qt.new_empty(qt.shape[:4], dtype=torch.float32)


@torch.library.custom_op("lowbit_attn::vsa_fine_bwd", mutates_args=())
def fine_bwd(dot: torch.Tensor, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
             ot: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` padded tiles (on the kernels ``LOWBIT_ATTN_BWD_KERNEL`` names where they
    apply: the sm90 ones on a CUDA device of capability 9.0, once they passed their check there:
    :mod:`~lowbit_attn.training.sm90_check`, and compile the call: ``run_backward``)."""
    from lowbit_attn.training import sm90_check
    from lowbit_attn.vsa import kernel_fine as vsa_fine

    return sm90_check.run_backward(
        qt.device, KernelOptions.from_env().bwd_kernel,
        lambda kernel: vsa_fine.backward(qt, kt, vt, ot, lse, dot, idx, counts, scale=scale,
                                         kernel=kernel))


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


@torch.library.custom_op("lowbit_attn::vsa_tile", mutates_args=())
def tile(x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, slots: int,
         pool: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H, N, D]`` → ``(padded tiles [B, H, nt, slots, D]`` (an empty tensor when
    ``slots`` is 0), ``tile means [B, H, nt, D]`` fp32 (empty unless ``pool``)); see
    :func:`lowbit_attn.vsa.kernel_tiles.tile`."""
    from lowbit_attn.vsa import kernel_tiles as vsa_tiles

    tiles, pooled = vsa_tiles.tile(x, index, counts, slots=slots, pool=pool)
    empty = x.new_empty((0,))
    return (empty if tiles is None else tiles), (empty.float() if pooled is None else pooled)


@tile.register_fake
def _(x, index, counts, slots, pool):
    b, h, _, d = x.shape
    nt = index.shape[0]
    tiles = x.new_empty((b, h, nt, slots, d)) if slots else x.new_empty((0,))
    return tiles, x.new_empty((b, h, nt, d) if pool else (0,), dtype=torch.float32)


@torch.library.custom_op("lowbit_attn::vsa_untile", mutates_args=())
def untile(tiles: torch.Tensor | None, pooled: torch.Tensor | None, index: torch.Tensor,
           counts: torch.Tensor, n_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The adjoint of :func:`tile`: each token's tile slot plus its tile's ``pooled / count``."""
    from lowbit_attn.vsa import kernel_tiles as vsa_tiles

    return vsa_tiles.untile(tiles, pooled, index, counts, n_tokens=n_tokens, dtype=dtype)


@untile.register_fake
def _(tiles, pooled, index, counts, n_tokens, dtype):
    like = tiles if tiles is not None else pooled
    return like.new_empty((like.shape[0], like.shape[1], n_tokens, like.shape[-1]), dtype=dtype)


def _present(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 else t


def _tile_setup(ctx, inputs, output):
    x, index, counts, slots, pool = inputs
    ctx.save_for_backward(index, counts)
    ctx.shape = (x.shape[2], x.dtype, slots, pool)


def _tile_backward(ctx, dtiles, dpooled):
    index, counts = ctx.saved_tensors
    n_tokens, dtype, slots, pool = ctx.shape
    dtiles = _present(dtiles) if slots else None
    dpooled = _present(dpooled) if pool else None
    if dtiles is None and dpooled is None:
        return None, None, None, None, None
    return untile(dtiles, dpooled, index, counts, n_tokens, dtype), None, None, None, None


tile.register_autograd(_tile_backward, setup_context=_tile_setup)


def _untile_setup(ctx, inputs, output):
    tiles, pooled, index, counts, n_tokens, dtype = inputs
    ctx.save_for_backward(index, counts)
    ctx.slots = 0 if tiles is None else tiles.shape[3]
    ctx.pool = pooled is not None


def _untile_backward(ctx, dx):
    index, counts = ctx.saved_tensors
    dtiles, dpooled = tile(dx, index, counts, ctx.slots, ctx.pool)
    return (_present(dtiles), _present(dpooled), None, None, None, None)


untile.register_autograd(_untile_backward, setup_context=_untile_setup)


def tiles_and_pool(x: torch.Tensor, layout: TileLayout, *, slots: int, pool: bool):
    """``(padded tiles or None, fp32 tile means or None)`` of ``[B, H, N, D]`` row-major tokens,
    differentiable, one pass over ``x`` on the kernels."""
    tiles, pooled = tile(x, layout.index, layout.counts, slots, pool)
    return _present(tiles), _present(pooled)


def fine_on_tiles(qt, kt, vt, layout: TileLayout, idx: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit fine stage on padded tiles, back to ``[B, H, N, D]`` row-major tokens."""
    ot, _ = fine_fwd(qt, kt, vt, idx.to(torch.int32).contiguous(), layout.counts.to(torch.int32),
                     scale)
    return untile(ot, None, layout.index, layout.counts, layout.n_tokens, dtype)


def _padded_tiles(qz: QuantizedQKV, layout: TileLayout, ts: int) -> QuantizedQKV:
    """Token-space operands → padded tiles for the kernel (E4M3 V token-contiguous, as FP8 MMAs
    read it)."""
    from lowbit_attn.vsa import kernel_tiles as vsa_tiles

    def tiles(x):
        return vsa_tiles.tile(x, layout.index, layout.counts, slots=ts, pool=False)[0]

    def row_tiles(x):
        return tiles(x.unsqueeze(-1)).squeeze(-1)

    v = tiles(qz.v)
    if v.dtype == torch.float8_e4m3fn:
        v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    return QuantizedQKV(q=tiles(qz.q), q_scale=row_tiles(qz.q_scale), k=tiles(qz.k),
                        k_scale=row_tiles(qz.k_scale), v=v, v_scale=qz.v_scale, v_mean=qz.v_mean)


def kernel_int8(q, k, v, idx, layout: TileLayout, scale: float, recipe: Recipe) -> torch.Tensor:
    """The 8-bit fine stage on the kernels: ``[B, H, N, D]`` row-major tokens in, q's dtype out
    (per-token quantization, the kernel on padded tiles, back to tokens)."""
    from lowbit_attn.vsa import kernel_fine, kernel_tiles

    qz = quantize_qkv(q, k, v, recipe, scale, need_lse_shift=False, backend="triton")
    ot = kernel_fine.forward_int8(_padded_tiles(qz, layout, tile_slots(layout, int8=True)),
                                  idx.to(torch.int32).contiguous(), layout.counts.to(torch.int32),
                                  out_dtype=q.dtype)
    return kernel_tiles.untile(ot, None, layout.index, layout.counts, n_tokens=layout.n_tokens,
                               dtype=q.dtype)


def naive_int8(q, k, v, idx, layout: TileLayout, scale: float, recipe: Recipe) -> torch.Tensor:
    """The PyTorch twin of :func:`kernel_int8`, the same arguments and result."""
    qz = quantize_qkv(q, k, v, recipe, scale, need_lse_shift=False, backend="reference")
    return ref.fine_quantized(qz, layout, idx, pv=recipe.pv).to(q.dtype)


@torch.library.custom_op("lowbit_attn::vsa_fine_int8", mutates_args=())
def fine_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
              video_shape: list[int], tile: list[int], scale: float, recipe: str) -> torch.Tensor:
    """:func:`kernel_int8` or :func:`naive_int8` (as :func:`use_kernels` says) as an op
    (``recipe`` as :func:`lowbit_attn.core.recipes.recipe_key` writes it)."""
    count_call("video_sparse")
    layout = tile_layout(tuple(video_shape), tuple(tile), q.device)
    fine = kernel_int8 if use_kernels(q) else naive_int8
    return fine(q, k, v, idx, layout, scale, recipe_from_key(recipe))


@fine_int8.register_fake
def _(q, k, v, idx, video_shape, tile, scale, recipe):
    return q.new_empty(q.shape)  # contiguous, as the op returns it


def fine_quantized(qh, kh, vh, layout: TileLayout, idx: torch.Tensor, scale: float,
                   recipe: Recipe) -> torch.Tensor:
    """The 8-bit fine stage through its op."""
    return fine_int8(qh, kh, vh, idx, list(layout.video_shape), list(layout.tile), scale,
                     recipe_key(recipe))
