"""``DecodeStep``: one layer's decode step — store the step's new K and V, then attend — in a form
that a CUDA graph can capture and replay.

An eager step (``QuantizedKVCache.append`` then ``attention_with_kv_cache``) decides on the host
which pages a token takes, how many splits to launch and how long each sequence is, so it cannot
be replayed (and is refused under capture). A ``DecodeStep`` moves each of those decisions to
where a replay still sees it:

- the pages: taken when the step is built, for ``steps`` steps ahead (``QuantizedKVCache.reserve``);
- the splits: enough for the longest sequence after ``steps`` steps (the splits past a sequence's
  pages are empty and cost one early exit);
- the lengths: read on the device by the append and the split kernel, and advanced there by the
  merge kernel, after every split has read them;
- the buffers: the output and LSE allocated once, with the step; the splits' workspace shared
  by the steps of every layer of the cache (``QuantizedKVCache.shared_workspace``: at 128k
  reserved tokens, batch 16, 8 KV heads, GQA 4, 68 MB, once rather than per layer).

``run`` is then three Triton launches and nothing else: the append, the split kernel, the merge.
A replay whose token finds no page (past the pages reserved for ``steps`` steps: the last of
them may have room for a few more) writes nothing, gives NaN rows for the sequences concerned
and marks them (``PagedLayer.overflow``); the cache's next eager use raises. After a capture the
cache reads its lengths back from the device before its next eager use.

On a backend without Triton, ``run`` is the eager step into the same buffers (there is no graph
to capture there). The numerics are the eager step's to the bit: the same kernels, with more
(empty) splits, whose merge adds exact zeros in a fixed tree.
"""

from __future__ import annotations

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.arch import backend_for, graph_capturing
from lowbit_attn.core.options import check_env
from lowbit_attn.kvcache.cache import QuantizedKVCache
from lowbit_attn.kvcache.interface import check_sinks, check_softcap
from lowbit_attn.kvcache.naive import attention_with_kv_cache_naive


class DecodeStep:
    """A decode step of layer ``layer`` of ``cache``, for ``steps`` steps of ``tokens`` tokens
    per sequence, that a CUDA graph can capture (``torch.cuda.graph``) and replay.

    :meth:`run` stores the step's K and V and returns the attention of its queries against every
    stored token (causal, bottom-right), in a buffer reused by every run (``lse`` beside it);
    capture it after one eager run (Triton compiles then), with ``q``, ``k``, ``v`` the graph's
    static inputs. Building the step reserves the pages of all its steps
    (:meth:`QuantizedKVCache.reserve`) from the layer's length then: one step per layer at a
    time, since any other append to the layer (another step's run too) uses those positions.

    Args:
        cache: the cache; every sequence must hold at least one token (its prompt: the frozen
            statistics come from a sequence's first append, which is eager).
        layer: which of its layers.
        heads: query heads (a multiple of the cache's ``kv_heads``).
        steps: how many times the step will run (eagerly or by replays) before a new one is
            built; their pages are taken now.
        tokens: tokens per sequence per step (1 for decoding; more for speculative verification).
        scale: softmax scale, ``D ** -0.5`` by default.
        softcap: as :func:`~lowbit_attn.attention_with_kv_cache`.
        sinks: likewise (``[heads]``; copied when the step is built).

    In a local layer (the cache's ``window`` or ``chunk``) the pages before the window go back
    to the pool when the step is built and at each eager append, not during replays: the step's
    reserved pages stay held until then.

    Raises:
        TypeError: ``cache`` is not a :class:`QuantizedKVCache`; ``layer``, ``heads``, ``steps``
            or ``tokens`` is not an int; ``scale`` is not a real number.
        ValueError: ``layer`` out of range; a count below 1; ``heads`` not a multiple of
            ``kv_heads``; a sequence that holds no token yet; ``scale`` not positive and finite;
            more tokens than ``max_tokens`` or the pool allow.
        RuntimeError: built under CUDA graph capture.

    Examples:
        >>> import torch, lowbit_attn
        >>> cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=128,
        ...                                    dtype=torch.float32)
        >>> cache.append(0, torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32))
        >>> step = lowbit_attn.DecodeStep(cache, 0, heads=4, steps=8)
        >>> q = torch.randn(1, 4, 1, 32)
        >>> k, v = torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32)
        >>> # appends k, v, then attends; capture it in a CUDA graph on a GPU
        >>> step.run(q, k, v).shape
        torch.Size([1, 4, 1, 32])
    """

    def __init__(self, cache: QuantizedKVCache, layer: int, *, heads: int, steps: int,
                 tokens: int = 1, scale: float | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None):
        if not isinstance(cache, QuantizedKVCache):
            raise TypeError(f"cache must be a QuantizedKVCache, got {type(cache).__name__}")
        cache.refuse_graph_capture("building a DecodeStep")
        heads, steps, tokens = (checks.positive_int(name, value) for name, value in
                                (("heads", heads), ("steps", steps), ("tokens", tokens)))
        if heads % cache.kv_heads:
            raise ValueError(f"heads ({heads}) must be a multiple of the cache's kv_heads "
                             f"({cache.kv_heads})")
        store = cache.store(layer)
        empty = [b for b, n in enumerate(store.host_lengths) if n == 0]
        if empty:
            raise ValueError(f"every sequence must hold tokens before a DecodeStep (its first "
                             f"append freezes its statistics, eagerly): sequence {empty[0]} is empty")
        self.cache, self.layer, self.heads, self.tokens = cache, int(layer), heads, tokens
        self.scale = checks.softmax_scale(scale, cache.head_dim)
        probe = torch.empty((1, heads, 1, 1), device=cache.device)
        self.softcap, self.sinks = check_softcap(softcap), check_sinks(sinks, probe)
        cache.reserve(layer, steps * tokens)
        self.resets = cache.resets
        self.capacity = [n + steps * tokens for n in store.host_lengths]  # tokens, per sequence
        self.triton = backend_for(cache.device) == "triton"
        shape = (cache.batch, self.heads, self.tokens, cache.head_dim)
        if self.triton:
            from lowbit_attn.kvcache import kernel_decode  # Triton only where it runs

            self.pages_per_split, self.parts = kernel_decode.split_for(cache.page_size)
            splits = kernel_decode.splits_of(store, self.pages_per_split, tokens,
                                             longest=max(self.capacity), parts=self.parts)
            work = cache.shared_workspace(kernel_decode.workspace_size(shape, cache.kv_heads,
                                                                       splits))
            self.buffers = kernel_decode.buffers(shape, cache.dtype, cache.device,
                                                 cache.kv_heads, splits, work)
            self.out, self.lse = self.buffers.out, self.buffers.lse
        else:
            self.out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self.lse = torch.empty(shape[:3], dtype=torch.float32, device=cache.device)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One step: ``k``, ``v`` stored, then ``q``'s attention.

        Args:
            q: ``[B, heads, tokens, D]`` in the cache's dtype and on its device.
            k: ``[B, kv_heads, tokens, D]``, likewise.
            v: the same shape as k.

        Returns:
            ``self.out`` ``[B, heads, tokens, D]``, the same tensor every run (the LSE
                ``[B, heads, tokens]`` fp32 in ``self.lse``).

        Raises:
            TypeError: q, k or v is not a 4-D float tensor.
            ValueError: an input of another shape, dtype or device than the step's, or that
                requires grad; (eagerly) a run past the steps it reserved, or after the cache's
                ``reset``. Nothing is stored then.
            RuntimeError: eagerly, after a replay ran past the reserved pages.
        """
        cache = self.cache
        q, k, v = checks.resolved(q, k, v)  # the kernels read memory, not a negation flag
        for name, x, heads in (("q", q, self.heads), ("k", k, cache.kv_heads),
                               ("v", v, cache.kv_heads)):
            checks.tensor(name, x, 4)
            want = (cache.batch, heads, self.tokens, cache.head_dim)
            if tuple(x.shape) != want or x.dtype != cache.dtype or x.device != cache.device:
                raise ValueError(f"{name} must be {cache.dtype} of shape {list(want)} on "
                                 f"{cache.device}, got {x.dtype} {list(x.shape)} on {x.device}")
        checks.forward_only(q, k, v)
        check_env()
        capturing = graph_capturing(cache.device)
        store = cache.layers[self.layer] if capturing else cache.store(self.layer)
        if not capturing:
            if cache.resets != self.resets:
                raise ValueError("the cache was reset since this DecodeStep was built (its pages "
                                 "went back to the pool); build a new one")
            past = [b for b, n in enumerate(store.host_lengths)
                    if n + self.tokens > self.capacity[b]]
            if past:
                raise ValueError(f"sequence {past[0]} has used the steps this DecodeStep "
                                 "reserved (its own runs and any other append to the layer, "
                                 "another DecodeStep's included, count); build a new one")
        if not self.triton:  # the eager step (no graph to capture here)
            cache.append(self.layer, k, v)
            out, lse = attention_with_kv_cache_naive(q, store, cache.recipe, scale=self.scale,
                                                     softcap=self.softcap, sinks=self.sinks)
            self.out.copy_(out)
            self.lse.copy_(lse)
            return self.out
        from lowbit_attn.kvcache import kernel_append, kernel_decode

        kernel_append.append(store, cache.recipe, k, v, None, replayable=True)
        kernel_decode.launch(q, store, cache.recipe, scale=self.scale,
                             pages_per_split=self.pages_per_split, parts=self.parts,
                             into=self.buffers,
                             added=self.tokens, replayable=True, softcap=self.softcap,
                             sinks=self.sinks)
        if capturing:  # replays will advance the lengths where the host does not see them
            store.host_stale = True
        else:
            store.host_lengths = [n + self.tokens for n in store.host_lengths]
        return self.out
