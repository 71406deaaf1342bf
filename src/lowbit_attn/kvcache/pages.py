"""Paged storage of one layer: a pool of fixed-size pages, a free list, one block table per
sequence, and the reading of one sequence's stored tokens back in order.

Token ``t`` of sequence ``b`` lives on page ``block_table[b, t // page_size]`` at slot
``t % page_size``. Pages are taken from the free list when a sequence writes the first token of a
page, so an engine that owns the allocator later only needs to hand out page ids.

A local layer (a sliding window or chunked attention: ``window``, ``chunk``) gives back the pages
that no later query can see: query position ``p`` sees keys from :meth:`PagedLayer.first_key`
``(p)`` to ``p``, so once a sequence holds ``L`` tokens (its next queries at ``p >= L``) every page
wholly before ``first_key(L)`` returns to the free list and its block-table entry reads -1. The
block table keeps its logical page numbers (``host_first[b]``: the first page still held), so a
sequence's memory stays about its window, not its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch


class FreePages:
    """The free list of a pool of ``num_pages`` pages: the lowest ids are handed out first."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.reset()

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out the lowest id

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("the page pool is exhausted")
        return self._free.pop()

    def give(self, ids: list[int]) -> None:
        """Pages back to the pool (a local layer's pages no query can see any more)."""
        self._free = sorted(self._free + ids, reverse=True)

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self._free)


@dataclass
class PagedLayer:
    """One layer's stored K and V.

    Attributes:
        k: int8 ``[num_pages, Hkv, page_size, D]``, K − μ quantized per token.
        k_scale: fp32 ``[num_pages, Hkv, page_size]``, one scale per stored token.
        v: ``[num_pages, Hkv, page_size, D]`` E4M3 or int8: V of full pages.
        v_scale: fp32 ``[num_pages, Hkv, D]``: one scale per channel of a full page.
        v_open: ``[B, Hkv, page_size, D]`` in the cache's dtype: V of each sequence's open (last,
            not yet full) page, exact.
        k_mean: fp32 ``[B, Hkv, D]``: μ, set by a sequence's first stored tokens.
        q_amax, k_amax: fp32 ``[B, Hkv, D]``: the balancing statistics, set with μ: ``max|Q|``
            over the first append's queries of the KV head's group (0 when none were given: no
            balancing) and ``max|K - μ|`` over its keys (``quantize.py``).
        block_table: int32 ``[B, max_pages_per_seq]``: page ids in order, -1 where unused.
        lengths: int64 ``[B]``: tokens stored per sequence.
        overflow: int32 ``[B]``: set by a captured decode step (``kvcache/step.py``) whose token
            found no page, 0 otherwise.
        tickets: int32 ``[B]``, zeros between appends: the append kernel's count of the programs
            of a sequence that are done with its length (``kernel_append``).
        free: the pool's free list.
        host_lengths: ``lengths`` mirrored on the host (kept in sync by the cache's appends and
            :meth:`reset`), so that an append need not read the device's back.
        host_pages: the pages each sequence holds in the block table (its first ones; more
            than its tokens need where pages were reserved for a captured decode step).
        host_stale: True once a decode step was captured in a CUDA graph: its replays advance
            ``lengths`` on the device alone, so the host mirror must be read back before use
            (``QuantizedKVCache.store``).
        window: a sliding window's left extent (query position ``p`` sees keys ``p - window``
            to ``p``; FlashAttention's ``window_size[0]``), or None.
        chunk: chunked attention's chunk (``p`` sees keys of its own chunk ``p // chunk`` up
            to ``p``; Llama 4's ``attention_chunk_size``), or None.
        host_first: per sequence, the first page it still holds (0 but in a local layer, which
            gives back the pages before its window).
    """

    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    v_open: torch.Tensor
    k_mean: torch.Tensor
    q_amax: torch.Tensor
    k_amax: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor
    overflow: torch.Tensor
    tickets: torch.Tensor
    free: FreePages
    host_lengths: list[int]
    host_pages: list[int]
    host_stale: bool = False
    window: int | None = None
    chunk: int | None = None
    host_first: list[int] = field(default_factory=list)

    @classmethod
    def allocate(cls, batch: int, kv_heads: int, head_dim: int, *, max_pages_per_seq: int,
                 page_size: int, v_dtype: torch.dtype, dtype: torch.dtype, device,
                 window: int | None = None, chunk: int | None = None,
                 pool_pages_per_seq: int | None = None) -> PagedLayer:
        """``pool_pages_per_seq``: pages per sequence in the pool (``max_pages_per_seq`` by
        default; a local layer needs only its window's and one append's)."""
        num_pages = batch * (pool_pages_per_seq or max_pages_per_seq)
        pool = (num_pages, kv_heads, page_size, head_dim)
        on = {"device": device}
        layer = cls(
            k=torch.empty(pool, dtype=torch.int8, **on),
            k_scale=torch.empty(pool[:3], dtype=torch.float32, **on),
            v=torch.empty(pool, dtype=v_dtype, **on),
            v_scale=torch.empty((num_pages, kv_heads, head_dim), dtype=torch.float32, **on),
            v_open=torch.empty((batch, kv_heads, page_size, head_dim), dtype=dtype, **on),
            k_mean=torch.empty((batch, kv_heads, head_dim), dtype=torch.float32, **on),
            q_amax=torch.empty((batch, kv_heads, head_dim), dtype=torch.float32, **on),
            k_amax=torch.empty((batch, kv_heads, head_dim), dtype=torch.float32, **on),
            block_table=torch.empty((batch, max_pages_per_seq), dtype=torch.int32, **on),
            lengths=torch.empty((batch,), dtype=torch.int64, **on),
            overflow=torch.empty((batch,), dtype=torch.int32, **on),
            tickets=torch.zeros((batch,), dtype=torch.int32, **on),
            free=FreePages(num_pages),
            host_lengths=[0] * batch,
            host_pages=[0] * batch,
            window=window,
            chunk=chunk,
            host_first=[0] * batch,
        )
        layer.reset()
        return layer

    @cached_property
    def launch_inputs(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the layer, in :meth:`tensors`' order: what a launch plan of a read or
        an append addresses besides the call's own tensors (``kvcache/planned.py``)."""
        return tuple(self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in
                ("k", "k_scale", "v", "v_scale", "v_open", "k_mean", "q_amax", "k_amax",
                 "block_table", "lengths", "overflow", "tickets")}

    def reset(self) -> None:
        """Every sequence empty, every page free (page contents are left as they are: unread;
        the balancing statistics read 0, no balancing, until a sequence's next first append)."""
        self.block_table.fill_(-1)
        self.q_amax.zero_()
        self.k_amax.zero_()
        self.lengths.zero_()
        self.overflow.zero_()
        self.host_lengths = [0] * len(self.host_lengths)
        self.host_pages = [0] * len(self.host_pages)
        self.host_first = [0] * len(self.host_first)
        self.host_stale = False
        self.free.reset()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def local(self) -> bool:
        """Whether the layer's queries see a window or a chunk only (and pages are given back)."""
        return self.window is not None or self.chunk is not None

    def first_key(self, position: int) -> int:
        """The first key a query at ``position`` sees (0 in a full layer)."""
        first = 0
        if self.window is not None:
            first = max(first, position - self.window)
        if self.chunk is not None:
            first = max(first, position - position % self.chunk)
        return first

    def reach(self) -> int | None:
        """The most keys before its own that one query sees (None: unbounded)."""
        return reach(self.window, self.chunk)


def reach(window: int | None, chunk: int | None) -> int | None:
    """The most keys before its own that one query of a layer with ``window`` and ``chunk``
    sees (None: unbounded)."""
    bounds = [r for r in (window, None if chunk is None else chunk - 1) if r is not None]
    return min(bounds) if bounds else None


class StoredSequence(NamedTuple):
    """One sequence's stored tokens in order (``L`` tokens, ``F = L // page_size`` full pages).

    Attributes:
        k: int8 ``[Hkv, L, D]``; k_scale: fp32 ``[Hkv, L]``.
        v: ``[Hkv, F·page_size, D]`` E4M3 or int8 (full pages); v_scale: fp32 ``[Hkv, F, D]``.
        v_open: ``[Hkv, L - F·page_size, D]`` in the cache's dtype (the open page's tokens).
        k_mean: fp32 ``[Hkv, D]`` (μ; unset, and not to be used, when ``L = 0``).
        pages: int64 ``[ceil(L / page_size)]``: the page ids, in order.
    """

    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    v_open: torch.Tensor
    k_mean: torch.Tensor
    pages: torch.Tensor


def stored_sequence(layer: PagedLayer, b: int) -> StoredSequence:
    """Sequence ``b``'s tokens read through its block table (nothing beyond its length is read);
    in a local layer, from its first held page on (token ``layer.host_first[b]·page_size``):
    ``L`` then counts the tokens from there, ``F`` the full pages from there."""
    size = layer.page_size
    first = layer.host_first[b]
    length = int(layer.lengths[b]) - first * size
    full = length // size
    pages = layer.block_table[b, first : first - (-length // size)].long()
    hkv, d = layer.k.shape[1], layer.k.shape[3]

    def tokens(pool: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
        # [pages, H, size, ...] → [H, pages·size, ...] → the first n tokens
        x = pool[ids].transpose(0, 1)
        return x.reshape(hkv, ids.numel() * size, *x.shape[3:])[:, :n]

    return StoredSequence(
        k=tokens(layer.k, pages, length),
        k_scale=tokens(layer.k_scale, pages, length),
        v=tokens(layer.v, pages[:full], full * size),
        v_scale=layer.v_scale[pages[:full]].transpose(0, 1).reshape(hkv, full, d),
        v_open=layer.v_open[b, :, : length - full * size],
        k_mean=layer.k_mean[b],
        pages=pages,
    )
