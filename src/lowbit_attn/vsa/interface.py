"""Video sparse attention (VSA): a coarse stage over mean-pooled tiles of the video's token grid
chooses, per query tile, the ``topk`` key tiles with the highest pooled scores; a fine stage attends
exactly inside them; the result is ``gate_coarse ∘ O_coarse + gate_fine ∘ O_fine``. Trainable end to
end (gradients flow through both stages, not through the choice of tiles).

The fine stage runs as Triton kernels (forward and backward, reading the selected tiles by index)
for fp16/bf16 inputs on a GPU (or under ``TRITON_INTERPRET=1`` with ``LOWBIT_ATTN_BACKEND=triton``);
the tile means and padded tiles come from one Triton pass per tensor (``vsa/kernel_tiles.py``); the
coarse stage's attention between ``n_tiles`` means and its top-k are PyTorch operations.
Elsewhere the whole computation is the PyTorch twin in ``vsa/naive.py``. For inference, the fine
stage may run in 8 bits (``recipe="qk_int8_pv_fp8"``: INT8 Q·Kᵀ, E4M3 P̃·V). The kernels sit behind
``torch.library`` custom ops (``vsa/op.py``), so ``torch.compile`` traces every path.
"""

from __future__ import annotations

import math

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.options import check_env
from lowbit_attn.vsa import op as vsa_ops
from lowbit_attn.core.recipes import Recipe, get_recipe
from lowbit_attn.vsa import naive as ref
from lowbit_attn.vsa.tiles import TileLayout, check_video, tile_layout

TOKEN_ORDERS = ("thw", "tiled")
"""The ``token_order`` values: ``"thw"`` (row-major T, H, W) and ``"tiled"`` (tile order)."""
VSA_RECIPES = ("exact", "qk_int8_pv_fp8", "qk_int8_pv_fp16")
"""The recipe names the fine stage takes: ``"exact"`` (trainable) and two 8-bit inference ones."""


def _hnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "NHD" else x


def _check_qkv(q, k, v, layout: str):
    """The ``[B, H, N, D]`` views of q, k, v, checked; one token grid for all three."""
    qh, kh, vh = checks.dense_qkv(q, k, v, layout, dtypes=checks.FLOAT_DTYPES + (torch.float64,))
    if qh.shape[2] != kh.shape[2]:
        raise ValueError(
            f"video sparse attention is self-attention over one token grid: q and k must have the "
            f"same number of tokens, got {qh.shape[2]} and {kh.shape[2]}"
        )
    return qh, kh, vh


def resolve_topk(topk, n_tiles: int) -> int:
    """``topk`` as a count of key tiles.

    Args:
        topk: an int in ``[1, n_tiles]``, or a float fraction in ``(0, 1]`` of the tiles (rounded
            up, at least one tile).
        n_tiles: the number of key tiles.

    Returns:
        The count, an int in ``[1, n_tiles]``.

    Raises:
        TypeError: ``topk`` is neither an int nor a float (a bool is neither).
        ValueError: a fraction outside ``(0, 1]`` or a count outside ``[1, n_tiles]``.

    Examples:
        >>> from lowbit_attn import vsa
        >>> vsa.resolve_topk(0.25, 16), vsa.resolve_topk(3, 16)
        (4, 3)
    """
    if isinstance(topk, bool) or not isinstance(topk, (int, float)):
        raise TypeError(f"topk must be an int (tiles) or a float (fraction of tiles), got {topk!r}")
    if isinstance(topk, float):
        if not 0.0 < topk <= 1.0:
            raise ValueError(f"topk as a fraction must be in (0, 1], got {topk}")
        return max(1, math.ceil(topk * n_tiles - 1e-9))
    if not 1 <= topk <= n_tiles:
        raise ValueError(f"topk must be between 1 and the number of tiles ({n_tiles}), got {topk}")
    return topk


class _Grid:
    """A call's tile layout and its token order conversions (row-major inside the computation)."""

    def __init__(self, video_shape, tile, n_tokens: int, device, token_order: str):
        if token_order not in TOKEN_ORDERS:
            raise ValueError(f"token_order must be 'thw' (row-major) or 'tiled', got {token_order!r}")
        video_shape, tile = check_video(video_shape, tile, n_tokens)
        self.layout: TileLayout = tile_layout(video_shape, tile, device)
        self.tiled = token_order == "tiled"

    def inward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, self.layout.inverse] if self.tiled else x

    def outward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, self.layout.perm] if self.tiled else x


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if vsa_ops.use_kernels(x):
        return x.dtype
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Operands:
    """q, k, v (``[B, H, N, D]`` row-major tokens) and what the stages read: fp32 tile means for
    the coarse stage (``pool``) and, on the kernels, padded tiles for the 16-bit fine stage
    (``tiles``), both from one pass over each tensor."""

    def __init__(self, qh, kh, vh, layout: TileLayout, *, pool: bool, tiles: bool):
        self.qkv, self.layout = (qh, kh, vh), layout
        self.tiles = self.pooled = None
        if vsa_ops.use_kernels(qh):
            if pool or tiles:
                slots = vsa_ops.tile_slots(layout, int8=False) if tiles else 0
                pairs = [vsa_ops.tiles_and_pool(x, layout, slots=slots, pool=pool) for x in self.qkv]
                self.tiles = [t for t, _ in pairs] if tiles else None
                self.pooled = [p for _, p in pairs] if pool else None
        elif pool:
            wide = torch.promote_types(qh.dtype, torch.float32)
            self.pooled = [ref.pool_tiles(x.to(wide), layout) for x in self.qkv]

    def coarse(self, scale: float, topk: int):
        """The coarse stage in fp32 at least (pooled tiles are few; the choice of tiles should not
        depend on the input dtype); its output per token, in the compute dtype."""
        out, indices, scores = ref.coarse_pooled(*self.pooled, scale=scale, topk=topk)
        return out[:, :, self.layout.tile_of].to(self.qkv[0].dtype), indices, scores

    def fine(self, idx: torch.Tensor, scale: float, recipe: Recipe) -> torch.Tensor:
        """The fine stage: 8-bit (inference), 16-bit on the kernels, or the reference."""
        if not recipe.is_exact:
            return vsa_ops.fine_quantized(*self.qkv, self.layout, idx, scale, recipe)
        if self.tiles is not None:
            return vsa_ops.fine_on_tiles(*self.tiles, self.layout, idx, scale, self.qkv[0].dtype)
        return ref.fine(*self.qkv, self.layout, idx, scale=scale)


def _prepare(q, k, v, *, video_shape, tile, layout, scale, token_order):
    qh, kh, vh = _check_qkv(q, k, v, layout)
    check_env()
    grid = _Grid(video_shape, tile, qh.shape[2], q.device, token_order)
    cdt = _compute_dtype(q)
    qh, kh, vh = (grid.inward(x).to(cdt) for x in (qh, kh, vh))
    return qh, kh, vh, grid, checks.softmax_scale(scale, q.shape[-1])


def coarse(q, k, v, *, video_shape, tile=(4, 4, 4), topk, scale=None, layout="HND",
           token_order="thw"):
    """The coarse stage alone: dense attention between mean-pooled tiles.

    Args:
        q: as for :func:`video_sparse_attention`.
        k: likewise.
        v: likewise.
        video_shape: likewise.
        tile: likewise.
        topk: key tiles per query tile: a count, or a fraction of the tiles in ``(0, 1]``.
        scale: as for :func:`video_sparse_attention`.
        layout: likewise.
        token_order: likewise.

    Returns:
        ``(out, tile_indices, scores)``: ``out`` in q's shape, layout and dtype (each token gets its
            query tile's coarse output); ``tile_indices [B, Hq, n_tiles, topk]`` int64, the chosen key
            tiles of each query tile in increasing order (tiles numbered row-major over the tile
            grid); ``scores [B, Hq, n_tiles, n_tiles]`` fp32 (float64 for float64 inputs), the pooled
            ``q·kᵀ·scale``.

    Raises:
        TypeError: as :func:`video_sparse_attention` for these arguments.
        ValueError: as :func:`video_sparse_attention` for these arguments.

    Examples:
        >>> import torch
        >>> from lowbit_attn import vsa
        >>> # video_shape (4, 8, 8)
        >>> q, k, v = (torch.randn(1, 2, 256, 32) for _ in range(3))
        >>> out, tile_indices, scores = vsa.coarse(q, k, v, video_shape=(4, 8, 8),
        ...                                         topk=2)
        >>> out.shape, tile_indices.shape, scores.shape
        (torch.Size([1, 2, 256, 32]), torch.Size([1, 2, 4, 2]), torch.Size([1, 2, 4, 4]))
    """
    qh, kh, vh, grid, sm = _prepare(q, k, v, video_shape=video_shape, tile=tile, layout=layout,
                                    scale=scale, token_order=token_order)
    kk = resolve_topk(topk, grid.layout.n_tiles)
    ops = _Operands(qh, kh, vh, grid.layout, pool=True, tiles=False)
    out, indices, scores = ops.coarse(sm, kk)
    return _hnd(grid.outward(out), layout).to(q.dtype), indices, scores


def fine(q, k, v, *, video_shape, tile=(4, 4, 4), tile_indices, scale=None, layout="HND",
         token_order="thw", recipe="exact", check_indices=True):
    """The fine stage alone: each query tile attends exactly to the tokens of its key tiles.

    Args:
        q: as for :func:`video_sparse_attention`.
        k: likewise.
        v: likewise.
        video_shape: likewise.
        tile: likewise.
        tile_indices: ``[B, Hq, n_tiles, k]`` int32 or int64 tensor, distinct key tiles per query
            tile (as :func:`coarse` returns them, or built by the caller, like a FlexAttention
            block mask).
        scale: as for :func:`video_sparse_attention`.
        layout: likewise.
        token_order: likewise.
        recipe: as for :func:`video_sparse_attention`.
        check_indices: verify that the indices are in range and distinct (reads them on the
            host: a GPU synchronisation). ``False`` inside CUDA graphs, for indices known good
            (out-of-range indices then read out of bounds).

    Returns:
        The output, q's shape, layout and dtype.

    Raises:
        TypeError: as :func:`video_sparse_attention` for these arguments; ``tile_indices`` not
            an int32/int64 tensor; ``check_indices`` not a bool.
        ValueError: as :func:`video_sparse_attention` for these arguments; ``tile_indices`` of
            the wrong shape or device, or (with ``check_indices``) out of range or repeating a
            tile.
        RuntimeError: a double backward through the kernels (the PyTorch reference path, on a
            CPU, is plain autograd and takes one).

    Examples:
        >>> import torch
        >>> from lowbit_attn import vsa
        >>> # video_shape (4, 8, 8)
        >>> q, k, v = (torch.randn(1, 2, 256, 32) for _ in range(3))
        >>> _, tile_indices, _ = vsa.coarse(q, k, v, video_shape=(4, 8, 8), topk=2)
        >>> vsa.fine(q, k, v, video_shape=(4, 8, 8), tile_indices=tile_indices).shape
        torch.Size([1, 2, 256, 32])
    """
    qh, kh, vh, grid, sm = _prepare(q, k, v, video_shape=video_shape, tile=tile, layout=layout,
                                    scale=scale, token_order=token_order)
    rec = resolve_recipe(recipe, q, k, v)
    checks.flag("check_indices", check_indices)
    _check_indices(tile_indices, qh.shape[0], qh.shape[1], grid.layout.n_tiles, q.device,
                   values=check_indices)
    ops = _Operands(qh, kh, vh, grid.layout, pool=False, tiles=rec.is_exact)
    out = ops.fine(tile_indices.long(), sm, rec)
    return _hnd(grid.outward(out), layout).to(q.dtype)


def resolve_recipe(recipe, *inputs: torch.Tensor) -> Recipe:
    """The fine stage's recipe.

    Args:
        recipe: ``"exact"`` (16-bit, trainable), or, for inference, an INT8-Q·Kᵀ recipe by name
            (``"qk_int8_pv_fp8"``, ``"qk_int8_pv_fp16"``; per-token scales) or as a
            :class:`~lowbit_attn.Recipe` with per-token scales and no Q smoothing (tiles are not
            runs of consecutive tokens, so scale groups and Q-smoothing blocks follow tokens).
        *inputs: the call's tensors; a quantized recipe refuses any that requires grad.

    Returns:
        The :class:`~lowbit_attn.Recipe` the fine stage runs.

    Raises:
        TypeError: ``recipe`` is neither a str nor a :class:`~lowbit_attn.Recipe`.
        ValueError: a name outside :data:`VSA_RECIPES`; a recipe whose Q·Kᵀ is not INT8, whose
            granularity is not ``"per_token"`` or that smooths Q; a quantized recipe with an input
            that requires grad while autograd is on.
    """
    if isinstance(recipe, str):
        if recipe not in VSA_RECIPES:
            raise ValueError(f"recipe must be one of {VSA_RECIPES} (or a Recipe) for video sparse "
                             f"attention, got {recipe!r}")
        recipe = get_recipe(recipe)
        if not recipe.is_exact:
            recipe = recipe.replace(granularity="per_token")
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a recipe name or a Recipe, got {type(recipe).__name__}")
    if not recipe.is_exact:
        if recipe.qk != "int8":
            raise ValueError(f"video sparse attention's quantized fine stage is INT8 Q·Kᵀ; "
                             f"recipe {recipe.name!r} has qk={recipe.qk!r}")
        if recipe.granularity != "per_token" or recipe.smooth_q:
            raise ValueError("video sparse attention's 8-bit fine stage quantizes per token without "
                             "Q smoothing: use granularity='per_token', smooth_q=False")
        if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
            raise ValueError(f"recipe {recipe.name!r} is for inference (no backward): call it under "
                             "torch.no_grad() or torch.inference_mode(), or train with "
                             "recipe='exact'")
    return recipe


def _check_indices(idx, b: int, hq: int, n_tiles: int, device, *, values: bool) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
        got = idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise TypeError(f"tile_indices must be an int32/int64 tensor, got {got}")
    if idx.dim() != 4 or tuple(idx.shape[:3]) != (b, hq, n_tiles) or idx.shape[3] < 1:
        raise ValueError(
            f"tile_indices must have shape [B, Hq, n_tiles, k] = [{b}, {hq}, {n_tiles}, k >= 1], "
            f"got {tuple(idx.shape)}"
        )
    checks.on_device("tile_indices", idx, device)
    if not values:
        return
    if bool(((idx < 0) | (idx >= n_tiles)).any()):
        raise ValueError(f"tile_indices must be in [0, {n_tiles}) (the key tiles)")
    s = idx.sort(dim=-1).values
    if bool((s[..., 1:] == s[..., :-1]).any()):
        raise ValueError("tile_indices must not repeat a key tile within a query tile's list")


def check_gate(name: str, gate, out_shape, device) -> None:
    if gate is None:
        return
    if not isinstance(gate, torch.Tensor):
        raise TypeError(f"{name} must be a tensor broadcastable to the output or None, got "
                        f"{type(gate).__name__}")
    try:
        shape = torch.broadcast_shapes(gate.shape, out_shape)
    except RuntimeError:
        shape = None
    if shape != tuple(out_shape):
        raise ValueError(f"{name} of shape {tuple(gate.shape)} does not broadcast to the output "
                         f"shape {tuple(out_shape)}")
    checks.on_device(name, gate, device)


def video_sparse_attention(q, k, v, *, video_shape, tile=(4, 4, 4), topk, gate_coarse=None,
                           gate_fine=None, scale=None, layout="HND", recipe="exact",
                           token_order="thw"):
    """Video sparse attention ``gate_coarse ∘ O_coarse + gate_fine ∘ O_fine``.

    A coarse stage over mean-pooled tiles picks the ``topk`` key tiles of each query tile; a fine
    stage attends exactly inside them. Gradients flow through both stages (not through the choice
    of tiles). With ``gate_coarse=None`` the coarse output is left out (FastVideo's
    ``video_sparse_attn`` adds it unweighted: :mod:`lowbit_attn.compat.fastvideo`).

    Args:
        q: ``[B, Hq, N, D]`` (``"HND"``) or ``[B, N, Hq, D]`` (``"NHD"``); float16, bfloat16,
            float32 or float64; ``N = T·H·W``.
        k: ``[B, Hkv, N, D]`` or ``[B, N, Hkv, D]``, q's dtype and device; ``Hq`` a multiple of
            ``Hkv``.
        v: the same shape, dtype and device as k.
        video_shape: ``(T, H, W)``: the token grid, tokens in row-major T, H, W order (or in tile
            order with ``token_order="tiled"``, see :func:`lowbit_attn.tiles.to_tile_order`).
        tile: ``(tt, th, tw)`` tokens per tile along T, H, W (at most 256 tokens); edge tiles may
            be partial and are handled exactly.
        topk: key tiles per query tile: a count, or a fraction of the tiles in ``(0, 1]``.
        gate_coarse: ``None`` leaves the coarse output out; else a tensor broadcastable to the
            output that multiplies it.
        gate_fine: ``None`` takes the fine output as it is; else its multiplier.
        scale: softmax scale, ``D ** -0.5`` by default (both stages).
        layout: ``"HND"`` or ``"NHD"``; the output keeps it.
        token_order: ``"thw"`` (row-major tokens) or ``"tiled"`` (tokens already in tile order,
            as :func:`lowbit_attn.tiles.to_tile_order` gives them; the output is in tile order
            too).
        recipe: the fine stage's numerics: ``"exact"`` (16-bit, trainable) or, for inference
            only, ``"qk_int8_pv_fp8"`` (INT8 Q·Kᵀ with per-token scales, K smoothed, Q/K
            channels balanced; P̃ and V in E4M3) or ``"qk_int8_pv_fp16"``, or such a
            :class:`~lowbit_attn.Recipe` (see :func:`resolve_recipe`). The coarse stage is
            always computed in fp32 at least (float64 for float64 inputs).

    Returns:
        The output, q's shape, layout and dtype. With both gates ``None`` and ``topk`` = all tiles
            it is exact attention.

    Raises:
        TypeError: q, k or v not a tensor of a listed dtype, or of different dtypes;
            ``video_shape`` or ``tile`` not three ints; ``scale`` not a real number; ``topk``
            neither an int nor a float; a gate that is not a tensor; ``recipe`` neither a name
            nor a :class:`~lowbit_attn.Recipe`.
        ValueError: the shape and device checks of :func:`lowbit_attn.attention`; q and k with
            different token counts; ``video_shape`` or ``tile`` not positive, a tile of more than
            256 tokens or a grid that does not hold N tokens; an unknown ``layout`` or
            ``token_order``; ``scale`` not positive and finite; ``topk`` out of range; a gate
            that does not broadcast to the output or is on another device; a recipe other than
            those :func:`resolve_recipe` takes, or an 8-bit recipe with inputs that require grad.
        RuntimeError: a double backward through the kernels (the PyTorch reference path, on a
            CPU, is plain autograd and takes one).

    Examples:
        >>> import torch, lowbit_attn
        >>> # T, H, W: 256 tokens, 4 tiles of 4×4×4
        >>> video_shape = (4, 8, 8)
        >>> q, k, v = (torch.randn(1, 2, 256, 32) for _ in range(3))
        >>> out = lowbit_attn.video_sparse_attention(q, k, v, video_shape=video_shape,
        ...                                          topk=2)
        >>> out.shape
        torch.Size([1, 2, 256, 32])
    """
    qh, kh, vh, grid, sm = _prepare(q, k, v, video_shape=video_shape, tile=tile, layout=layout,
                                    scale=scale, token_order=token_order)
    rec = resolve_recipe(recipe, q, k, v)
    check_gate("gate_coarse", gate_coarse, q.shape, q.device)
    check_gate("gate_fine", gate_fine, q.shape, q.device)
    kk = resolve_topk(topk, grid.layout.n_tiles)
    ops = _Operands(qh, kh, vh, grid.layout, pool=True, tiles=rec.is_exact)
    out_c, indices, _ = ops.coarse(sm, kk)
    out_f = ops.fine(indices, sm, rec)
    out_f = _hnd(grid.outward(out_f), layout)
    out = out_f if gate_fine is None else gate_fine * out_f
    if gate_coarse is not None:
        out = out + gate_coarse * _hnd(grid.outward(out_c), layout)
    return out.to(q.dtype)


def topk_schedule(step: int, *, n_tiles: int, target, dense_steps: int = 0,
                  anneal_steps: int = 0) -> int:
    """Key tiles per query tile at training ``step`` when retrofitting a dense model.

    All tiles for ``dense_steps``, then a linear decrease to ``target`` over ``anneal_steps``,
    then ``target``. (Start the coarse gate at zero, too: the pretrained model then computes
    what it did before.)

    Args:
        step: the training step, from 0.
        n_tiles: the number of key tiles.
        target: the final ``topk``: a count or a fraction of the tiles in ``(0, 1]``.
        dense_steps: steps at all tiles first.
        anneal_steps: steps of the linear decrease after them (0: straight to ``target``).

    Returns:
        The ``topk`` count for ``step``, an int in ``[1, n_tiles]``.

    Raises:
        TypeError: ``target`` is neither an int nor a float.
        ValueError: ``step``, ``dense_steps`` or ``anneal_steps`` not a non-negative int,
            ``n_tiles`` not a positive int, or ``target`` out of range (:func:`resolve_topk`).

    Examples:
        >>> from lowbit_attn import vsa
        >>> [vsa.topk_schedule(s, n_tiles=16, target=4, dense_steps=2, anneal_steps=4)
        ...  for s in range(0, 8, 2)]
        [16, 16, 10, 4]
    """
    for name, value in (("step", step), ("n_tiles", n_tiles), ("dense_steps", dense_steps),
                        ("anneal_steps", anneal_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "n_tiles" else 0):
            raise ValueError(f"{name} must be a non-negative int (n_tiles positive), got {value!r}")
    final = resolve_topk(target, n_tiles)
    if step < dense_steps:
        return n_tiles
    if anneal_steps == 0 or step >= dense_steps + anneal_steps:
        return final
    t = (step - dense_steps) / anneal_steps
    return max(final, round(n_tiles + t * (final - n_tiles)))
