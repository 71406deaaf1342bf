"""``QuantizedKVCache``: a paged KV cache stored in 8 bits (K INT8, V E4M3 or INT8), for LLM
generation. Every argument of an append is checked before anything is written: a refused append
leaves the cache as it was.

Numerics of what is stored: ``quantize.py``. Layout of the pages: ``pages.py``. An append's
writes are one Triton launch (``kernel_append``) where ``core.arch.backend_for`` picks Triton, and
the ``_write`` loop (its twin, the same bytes) elsewhere; the checks, the frozen statistics of a
first append, the page allocation and the block table stay here, on the host.
"""

from __future__ import annotations

import numbers

import torch

from lowbit_attn.core import checks, plans
from lowbit_attn.core.arch import backend_for, graph_capturing
from lowbit_attn.core.options import check_env
from lowbit_attn.kvcache import planned
from lowbit_attn.kvcache.pages import PagedLayer, StoredSequence, reach, stored_sequence
from lowbit_attn.kvcache.quantize import frozen_stats, quantize_keys, quantize_v_page
from lowbit_attn.kvcache.recipes import get_kv_recipe


class QuantizedKVCache:
    """A paged, 8-bit KV cache for ``num_layers`` layers of ``batch`` sequences.

    Storage per layer (``pages.PagedLayer``): K int8 ``[num_pages, Hkv, page_size, D]`` and its
    per-token scales; V ``[num_pages, Hkv, page_size, D]`` and its per-page channel scales; each
    sequence's open page of V in ``dtype``; μ and the balancing statistics per (sequence, head);
    the block table int32 ``[B, max_pages_per_seq]`` (-1 unused); the lengths.

    ``copy.deepcopy`` copies it and ``torch.save``/``torch.load`` keep it; ``pickle`` (and so
    ``multiprocessing``) does not with ``kv_int8_fp8``: PyTorch's pickling of float8 tensors (V's
    pages) raises ``AttributeError``.

    Args:
        num_layers: layers of the model, a positive int.
        batch: sequences, a positive int.
        kv_heads: key/value heads per layer, a positive int.
        head_dim: the head dim D, 1 to 256.
        max_tokens: the most tokens one sequence may hold; each layer's pool has
            ``batch·ceil(max_tokens/page_size)`` pages.
        page_size: tokens per page (64 by default).
        recipe: ``"kv_int8_fp8"`` (K INT8, V E4M3; the default) or ``"kv_int8_int8"`` (V INT8).
        dtype: the dtype of the K and V given to :meth:`append` (float16, bfloat16 or float32),
            which the open page keeps V in.
        device: where every tensor of the cache lives (a ``torch.device`` or its name).
        window: sliding-window layers: an int ``w >= 0`` for every layer, or one entry per
            layer (``None`` for a full layer). Query position ``p`` of such a layer sees keys
            ``p - w`` to ``p`` (FlashAttention's ``window_size = (w, 0)``; transformers'
            ``sliding_window = w + 1``), and the pages before a sequence's window go back to
            the pool (``pages.py``).
        chunk: chunked-attention layers (Llama 4's ``attention_chunk_size``), likewise: ``p``
            sees keys ``j <= p`` with ``j // chunk == p // chunk``. A layer may have both.
        max_append: the most tokens one append stores per sequence in a local (window or chunk)
            layer, which sizes its pool: ``ceil((reach + max_append)/page_size) + 1`` pages per
            sequence (``reach``: ``w``, or ``chunk - 1``), at most those of ``max_tokens``
            (the default, ``max_tokens``: no smaller pool, pages reused all the same). A larger
            append is stored when the pool has the pages for it, refused (naming ``max_append``)
            when not.

    Raises:
        TypeError: a size that is not an int; ``recipe`` not a str; ``dtype`` not float16,
            bfloat16 or float32; a window or chunk that is not an int or None.
        ValueError: a size below 1 or a head dim above 256; an unknown recipe name; a window
            below 0, a chunk below 1, or a list of them whose length is not ``num_layers``.

    Examples:
        >>> import torch, lowbit_attn
        >>> cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=128,
        ...                                    dtype=torch.float32)
        >>> # [B, Hkv, tokens, D]
        >>> k, v = torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32)
        >>> cache.append(0, k, v)
        >>> # one query token, GQA 2:1
        >>> q = torch.randn(1, 4, 1, 32)
        >>> lowbit_attn.attention_with_kv_cache(q, cache, 0).shape
        torch.Size([1, 4, 1, 32])
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, *,
                 max_tokens: int, page_size: int = 64, recipe: str = "kv_int8_fp8",
                 dtype: torch.dtype = torch.float16, device="cpu", window=None, chunk=None,
                 max_append: int | None = None):
        self.num_layers = checks.positive_int("num_layers", num_layers)
        self.batch = checks.positive_int("batch", batch)
        self.kv_heads = checks.positive_int("kv_heads", kv_heads)
        self.head_dim = checks.positive_int("head_dim", head_dim, at_most=checks.MAX_HEAD_DIM)
        self.max_tokens = checks.positive_int("max_tokens", max_tokens)
        self.page_size = checks.positive_int("page_size", page_size)
        self.recipe = get_kv_recipe(recipe)
        if dtype not in checks.FLOAT_DTYPES:
            raise TypeError(
                f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
        self.dtype = dtype
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            kind = ValueError if isinstance(exc, RuntimeError) else TypeError
            raise kind(f"device must be a torch.device or a device string such as 'cuda:0', "
                       f"got {device!r}") from exc
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" is cuda:<current>,
            self.device = torch.device("cuda", torch.cuda.current_device())  # as tensors say
        self.max_pages_per_seq = -(-self.max_tokens // self.page_size)
        self.resets = 0  # how many times reset() ran: what a DecodeStep was built against
        self._workspaces: dict[int, torch.Tensor] = {}  # shared_workspace's, by size
        self.plans = plans.Table()  # the launch plans of eager reads and appends (planned.py)
        windows = _per_layer("window", window, self.num_layers, least=0)
        chunks = _per_layer("chunk", chunk, self.num_layers, least=1)
        self.max_append = (self.max_tokens if max_append is None
                           else checks.positive_int("max_append", max_append))
        self.layers = []
        for w, c in zip(windows, chunks):
            back = reach(w, c)
            pool = None  # a local layer's pool: its window's pages and one append's
            if back is not None:
                pool = min(self.max_pages_per_seq,
                           -(-(back + self.max_append) // self.page_size) + 1)
            self.layers.append(PagedLayer.allocate(
                self.batch, self.kv_heads, self.head_dim, max_pages_per_seq=self.max_pages_per_seq,
                page_size=self.page_size, v_dtype=self.recipe.v_dtype, dtype=dtype,
                device=self.device, window=w, chunk=c, pool_pages_per_seq=pool))

    def __repr__(self) -> str:
        local = ""
        if any(layer.local for layer in self.layers):
            local = (f", window={[layer.window for layer in self.layers]}, "
                     f"chunk={[layer.chunk for layer in self.layers]}")
        return (f"QuantizedKVCache(num_layers={self.num_layers}, batch={self.batch}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, max_tokens={self.max_tokens}, "
                f"page_size={self.page_size}, recipe={self.recipe.name!r}, dtype={self.dtype}, "
                f"device={str(self.device)!r}{local})")

    def refuse_graph_capture(self, what: str) -> None:
        """A CUDA graph would replay a call with the host's state at capture: the pages an append
        takes, the lengths it adds, the splits a read launches. So a capture is refused (the
        cache is left as it was), never replayed into silently wrong tokens."""
        if graph_capturing(self.device):
            raise RuntimeError(
                f"{what} cannot be captured in a CUDA graph: the cache keeps its page allocation "
                "and lengths on the host, which a replay would not update; run the decode step "
                "outside the graph (or capture only the layers around it)")

    # --- reading -----------------------------------------------------------------------------

    def store(self, layer) -> PagedLayer:
        """Layer ``layer``'s storage (``layer`` checked), its host mirror current: after replays
        of a captured decode step (``kvcache/step.py``) the lengths are read back from the
        device once. Raises RuntimeError, there and at every later use until :meth:`reset`, if a
        replay found no page for its token (its rows were NaN)."""
        store = self.layers[self.layer_index(layer)]
        if store.host_stale:
            lost = store.overflow.nonzero().flatten().tolist()
            if lost:
                raise RuntimeError(
                    f"a replayed decode step of layer {layer} found no page for sequences {lost}: "
                    "it ran past the tokens its DecodeStep reserved, and gave NaN from then on; "
                    "reset() the cache (or reserve more steps)")
            store.host_lengths = store.lengths.tolist()
            store.host_stale = False
        return store

    def reserve(self, layer: int, tokens: int) -> None:
        """Take now, on the host, the pages that each sequence of ``layer`` needs for ``tokens``
        more tokens, so that appending them takes none (what a captured decode step needs).

        Args:
            layer: the layer, an int in ``[0, num_layers)``.
            tokens: tokens per sequence to make room for, a positive int.

        Raises:
            TypeError: ``layer`` or ``tokens`` is not an int.
            ValueError: ``layer`` out of range, ``tokens`` below 1, or more tokens than
                ``max_tokens`` or the pool allow (nothing is taken then).
            RuntimeError: after a replayed :class:`DecodeStep` ran past the pages it reserved,
                until :meth:`reset`.
        """
        store = self.store(layer)
        tokens = checks.positive_int("tokens", tokens)
        lengths = store.host_lengths
        over = [b for b in range(self.batch) if lengths[b] + tokens > self.max_tokens]
        if over:
            raise ValueError(f"tokens={tokens} more would pass max_tokens={self.max_tokens} for "
                             f"sequence {over[0]} (it holds {lengths[over[0]]}); nothing was reserved")
        pages = sum(map(len, self._new_pages(store, lengths, [tokens] * self.batch)))
        free = self._free_after_release(store, lengths)
        if pages > free:
            raise ValueError(f"reserving {tokens} tokens needs {pages} pages, the layer's pool has "
                             f"{free} free; nothing was reserved")
        self._release(store, lengths)
        self._take_pages(store, lengths, [tokens] * self.batch)

    def shared_workspace(self, numel: int) -> torch.Tensor:
        """An fp32 scratch tensor of ``numel`` elements on the cache's device, one per size for
        the cache's lifetime: the DecodeSteps of its layers share it, since a model runs its
        layers one after another on one stream (steps run concurrently on several streams must
        not share a cache). Never reallocated: a captured graph keeps its address."""
        if numel not in self._workspaces:
            self._workspaces[numel] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._workspaces[numel]

    def layer_index(self, layer) -> int:
        """``layer`` checked: an int in ``[0, num_layers)``."""
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            raise TypeError(f"layer must be an int, got {checks.shown(layer)}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return int(layer)

    def length(self, layer: int) -> torch.Tensor:
        """Tokens stored per sequence in ``layer``.

        Args:
            layer: the layer, an int in ``[0, num_layers)``.

        Returns:
            An int64 ``[B]`` tensor on the cache's device (a copy).

        Raises:
            TypeError: ``layer`` is not an int.
            ValueError: ``layer`` is out of range.
        """
        return self.layers[self.layer_index(layer)].lengths.clone()

    def held_pages(self, layer: int) -> list[int]:
        """Pages each sequence of ``layer`` holds now (a local layer gave back those before its
        window; reserved pages count)."""
        store = self.store(layer)
        return [p - f for p, f in zip(store.host_pages, store.host_first)]

    def sequence(self, layer: int, b: int) -> StoredSequence:
        """Sequence ``b``'s stored tokens in ``layer``, in order (views into the pool; in a local
        layer from its first held page on, ``held_pages``)."""
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or not 0 <= b < self.batch:
            raise ValueError(f"b must be an int in [0, {self.batch}), got {checks.shown(b)}")
        return stored_sequence(self.layers[self.layer_index(layer)], int(b))

    def nbytes(self) -> int:
        """Bytes of every tensor the cache allocated, all layers.

        Returns:
            The bytes of the page pools of K and V, their scales, the open pages of V, μ, the block
                tables and the lengths (the host-side free lists are not counted).
        """
        return sum(layer.nbytes() for layer in self.layers)

    # --- writing -----------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty every sequence of every layer (its μ is set afresh by its next append); a
        :class:`DecodeStep` built before refuses to run (its pages went back to the pool)."""
        for layer in self.layers:
            layer.reset()
        self.resets += 1

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, *,
               valid: torch.Tensor | None = None, q: torch.Tensor | None = None) -> None:
        """Store ``n`` new tokens per sequence at the end of each sequence of ``layer``.

        Args:
            layer: the layer, an int in ``[0, num_layers)``.
            k: ``[B, Hkv, n, D]`` (``n ≥ 1``: a prompt or one decode step), in the cache's
                dtype and on its device; not modified.
            v: the same shape, dtype and device as k; not modified.
            valid: optional bool ``[B, n]``: tokens marked False are not stored (the padding of a
                left- or right-padded batch); each sequence stores its valid tokens in order.
            q: optional ``[B, Hq, n, D]``, the same tokens' queries (``Hq`` a multiple of
                ``Hkv``): read only by a sequence's first append, whose statistics are frozen
                (``μ``, and with ``q`` the Q/K channel balancing: ``quantize.py``). Give the
                prompt's queries: on inputs with outlier channels they are worth an order of
                magnitude in ``1 - cosine``.

        Raises:
            TypeError: ``layer`` not an int; k, v (or q) not tensors in the cache's dtype;
                ``valid`` neither a tensor nor None.
            ValueError: ``layer`` out of range; a wrong shape or device; a ``valid`` that is not
                a bool ``[B, n]`` tensor on the cache's device; a sequence that would pass
                ``max_tokens`` or a pool without the pages; k, v or q requiring grad while
                autograd is on. Nothing is stored then, and nothing is given back.
            RuntimeError: under CUDA graph capture (use :class:`DecodeStep`); after a replayed
                :class:`DecodeStep` ran past the pages it reserved, until :meth:`reset`.
        """
        # the cache keeps no graph: a k or v that needs gradients would leave one in μ and V's
        # open page, and every later read would carry it
        k, v, q = checks.resolved(k, v, q)  # the kernels read memory, not a negation flag
        checks.forward_only(*(x for x in (k, v, q) if isinstance(x, torch.Tensor)),
                            names="k and v" if q is None else "k, v and q")
        plan_key = planned.append_key(self, layer, k, v, valid, q)
        if plan_key is not None and self._append_planned(plan_key, layer, k, v):
            return
        check_env()  # after a replay: a plan's key holds the values a checked call read
        self.refuse_graph_capture("QuantizedKVCache.append")
        store = self.store(layer)
        counts = self._check_append(store, k, v, valid, q)
        self._release(store, store.host_lengths)  # after the checks: a refused append changes nothing
        lengths = list(store.host_lengths)
        n = k.shape[2]
        for b in range(self.batch):
            if lengths[b] == 0 and counts[b] > 0:  # the sequence's first tokens freeze its stats
                idx = self._tokens(valid, b, n)
                stats = frozen_stats(k[b : b + 1, :, idx],
                                     None if q is None else q[b : b + 1, :, idx])
                for frozen, value in zip((store.k_mean, store.q_amax, store.k_amax), stats):
                    frozen[b] = value[0]
        if backend_for(self.device) == "triton":
            from lowbit_attn.kvcache import kernel_append  # Triton only where it runs

            self._take_pages(store, lengths, counts)

            def launch():  # it advances store.lengths too
                kernel_append.append(store, self.recipe, k, v, valid)

            if plan_key is None:
                launch()
            else:
                self.plans.call(plan_key, launch, (k, v, *store.launch_inputs), "triton")
        else:
            k8, k_scale = quantize_keys(k, store.k_mean, store.q_amax, store.k_amax)
            for b in range(self.batch):
                self._write(store, b, lengths[b], self._tokens(valid, b, n), k8[b], k_scale[b],
                            v[b])
            store.lengths += n if valid is None else valid.sum(dim=1)  # no copy from the host
        store.host_lengths = [length + c for length, c in zip(lengths, counts)]

    def _append_planned(self, plan_key: tuple, layer: int, k: torch.Tensor,
                        v: torch.Tensor) -> bool:
        """An append of every token of ``k``, ``v`` by the plan of ``plan_key``
        (``kvcache/planned.py``), if there is one and the append needs no more than it checks
        here: no sequence's first tokens, none past ``max_tokens``, pages the pool has. Returns
        whether it ran; when it did not, nothing changed. The plan is taken once: plans turned
        off meanwhile (by another thread) do not stop this append halfway."""
        plan = self.plans.ready(plan_key)
        if plan is None:
            return False
        store = self.layers[layer]
        n = k.shape[2]
        lengths = store.host_lengths
        after = [length + n for length in lengths]
        if min(lengths) == 0 or max(after) > self.max_tokens:
            return False
        counts = [n] * self.batch
        opens = any(a > p * self.page_size for a, p in zip(after, store.host_pages))
        if opens and (sum(map(len, self._new_pages(store, lengths, counts)))
                      > self._free_after_release(store, lengths)):
            return False
        self._release(store, lengths)
        if opens:
            self._take_pages(store, lengths, counts)
        plans.replay(plan, (k, v, *store.launch_inputs))
        store.host_lengths = after
        return True

    def _new_pages(self, store: PagedLayer, lengths: list[int], counts: list[int]) -> list[range]:
        """Per sequence, the page numbers that ``counts[b]`` more tokens after ``lengths[b]``
        need beyond the pages it holds (none where reserved pages cover them)."""
        size = self.page_size
        return [range(store.host_pages[b], -(-(lengths[b] + counts[b]) // size))
                for b in range(self.batch)]

    def _releasable(self, store: PagedLayer, lengths: list[int]) -> list[range]:
        """Per sequence, the page numbers of a local layer that no query from ``lengths[b]`` on
        can see and that it still holds (none in a full layer)."""
        if not store.local:
            return [range(0)] * self.batch
        size = self.page_size
        return [range(store.host_first[b], max(store.host_first[b], store.first_key(n) // size))
                for b, n in enumerate(lengths)]

    def _free_after_release(self, store: PagedLayer, lengths: list[int]) -> int:
        """The pool's free pages once :meth:`_release` gave back what it would: what the checks
        count, before anything is changed."""
        return len(store.free) + sum(map(len, self._releasable(store, lengths)))

    def _release(self, store: PagedLayer, lengths: list[int]) -> None:
        """:meth:`_releasable`'s pages back to the pool (their block-table entries -1, in one
        copy)."""
        rows, cols, ids = [], [], []
        for b, pages in enumerate(self._releasable(store, lengths)):
            rows += [b] * len(pages)
            cols += pages
            store.host_first[b] = pages.stop
        if rows:
            where = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
            ids = store.block_table[where[0], where[1]].tolist()
            store.block_table[where[0], where[1]] = -1
            store.free.give(ids)

    def _tokens(self, valid: torch.Tensor | None, b: int, n: int) -> torch.Tensor:
        """The indices of sequence ``b``'s stored tokens among the append's ``n``."""
        if valid is None:
            return torch.arange(n, device=self.device)
        return valid[b].nonzero().flatten()

    def _take_pages(self, store: PagedLayer, lengths: list[int], counts: list[int]) -> None:
        """The pages an append opens (those past the ones a sequence holds), taken from the free
        list in the order of ``_write`` (by sequence, then page) and written to the block table
        in one copy."""
        rows, cols, ids = [], [], []
        for b, new in enumerate(self._new_pages(store, lengths, counts)):
            for page_no in new:
                rows.append(b)
                cols.append(page_no)
                ids.append(store.free.take())
            store.host_pages[b] += len(new)
        if ids:
            where = torch.tensor([rows, cols, ids], dtype=torch.int64).to(self.device,
                                                                         non_blocking=True)
            store.block_table[where[0], where[1]] = where[2].to(torch.int32)

    def _write(self, store: PagedLayer, b: int, start: int, tokens: torch.Tensor,
               k8: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor) -> None:
        """Sequence ``b``'s tokens (indices into the ``n`` of this append) from position ``start``
        on, one page at a time; a page that fills has its V quantized."""
        size = self.page_size
        pos, done = start, 0
        while done < tokens.numel():
            page_no, slot = divmod(pos, size)
            if page_no >= store.host_pages[b]:  # the sequence's next page: taken now
                store.block_table[b, page_no] = store.free.take()
                store.host_pages[b] = page_no + 1
            page = int(store.block_table[b, page_no])
            take = min(size - slot, tokens.numel() - done)
            idx = tokens[done : done + take]
            store.k[page, :, slot : slot + take] = k8[:, idx]
            store.k_scale[page, :, slot : slot + take] = k_scale[:, idx]
            store.v_open[b, :, slot : slot + take] = v[:, idx]
            if slot + take == size:
                values, scales = quantize_v_page(store.v_open[b : b + 1], self.recipe)
                store.v[page] = values[0]
                store.v_scale[page] = scales[0]
            pos += take
            done += take

    def _check_append(self, store: PagedLayer, k, v, valid, q) -> list[int]:
        """Every check of an append; returns the tokens each sequence stores."""
        for name, x in (("k", k), ("v", v), ("q", q)):
            if x is None:
                continue
            checks.tensor(name, x, 4)
            if x.dtype != self.dtype:
                raise TypeError(f"{name} must have the cache's dtype {self.dtype}, got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name} must be on the cache's device {self.device}, got {x.device}")
            if name == "q":
                continue
            want = (self.batch, self.kv_heads, x.shape[2], self.head_dim)
            if tuple(x.shape) != want or x.shape[2] < 1:
                raise ValueError(
                    f"{name} must have shape [batch={self.batch}, kv_heads={self.kv_heads}, n >= 1, "
                    f"head_dim={self.head_dim}], got {tuple(x.shape)}")
        if k.shape != v.shape:
            raise ValueError(
                f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        n = k.shape[2]
        if q is not None:
            b, hq, nq, d = q.shape
            if (b, nq, d) != (self.batch, n, self.head_dim) or hq == 0 or hq % self.kv_heads:
                raise ValueError(
                    f"q must have shape [batch={self.batch}, Hq (a multiple of kv_heads="
                    f"{self.kv_heads}), n={n}, head_dim={self.head_dim}], got {tuple(q.shape)}")
        if valid is None:
            counts = [n] * self.batch
        else:
            if not isinstance(valid, torch.Tensor):
                raise TypeError(f"valid must be a torch.Tensor or None, got {type(valid).__name__}")
            if valid.dtype != torch.bool or tuple(valid.shape) != (self.batch, n):
                raise ValueError(f"valid must be a bool tensor of shape [batch={self.batch}, n={n}], "
                                 f"got {valid.dtype} {tuple(valid.shape)}")
            if valid.device != self.device:
                raise ValueError(f"valid must be on the cache's device {self.device}, got {valid.device}")
            counts = valid.sum(dim=1).tolist()
        lengths = store.host_lengths
        over = [b for b in range(self.batch) if lengths[b] + counts[b] > self.max_tokens]
        if over:
            b = over[0]
            raise ValueError(
                f"k and v would pass max_tokens={self.max_tokens} for sequence {b} (it holds "
                f"{lengths[b]} tokens, the append adds {counts[b]}); nothing was stored")
        pages = sum(map(len, self._new_pages(store, lengths, counts)))
        free = self._free_after_release(store, lengths)
        if pages > free:
            sized = (f" (a local layer's pool is sized for appends of at most max_append="
                     f"{self.max_append} tokens per sequence)" if store.reach() is not None else "")
            raise ValueError(f"the append needs {pages} pages, layer's pool has {free} "
                             f"free{sized}; nothing was stored")
        return counts


def _per_layer(name: str, value, num_layers: int, *, least: int) -> list[int | None]:
    """A window or chunk argument as one entry per layer (int or None), checked."""
    values = [value] * num_layers if value is None or isinstance(value, numbers.Integral) else value
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"{name} must be an int, None or one of those per layer, got "
                        f"{checks.shown(value)}") from None
    if len(values) != num_layers:
        raise ValueError(f"{name} must have one entry per layer ({num_layers}), got {len(values)}")
    for x in values:
        if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Integral)):
            raise TypeError(f"{name} entries must be ints or None, got {checks.shown(x)}")
        if x is not None and x < least:
            raise ValueError(f"{name} entries must be at least {least}, got {x}")
    return [None if x is None else int(x) for x in values]
