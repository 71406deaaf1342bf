"""A Hugging Face ``Cache`` backed by :class:`lowbit_attn.kvcache.QuantizedKVCache`, read by the
``"lowbit"`` attention implementation (``integrations.transformers``) through
:func:`lowbit_attn.kvcache.attention_with_kv_cache`, never dequantized::

    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="lowbit")
    cache = lowbit_hf.QuantizedCache(model.config, batch=2, max_tokens=4096, dtype=model.dtype,
                                     device=model.device)
    tokenizer.padding_side = "left"
    out = model.generate(**tokenizer(prompts, padding=True, return_tensors="pt"), cache=cache,
                         max_new_tokens=256)       # (past_key_values=cache before transformers 5)

How a step flows: the model calls ``cache.update(k, v, layer)``, which stores nothing yet and
returns a pair of :class:`PendingKV` markers; the attention function recognises them, reads which
of the new tokens are padding from the 4D mask, appends the rest to the 8-bit pages (with the
step's queries: a sequence's first step, its prompt, freezes its Q/K channel balancing), and attends
against the stored tokens (causal, bottom-right). Nothing else can read a marker as a tensor: any
other attention implementation that touches one raises. Reading the mask and the stored lengths
happens on the host: a synchronisation per layer and step (the mask is checked, not trusted).

Two lengths are kept apart: ``get_seq_length()`` counts every position the model has seen
(padding included, as transformers counts them for positions and masks), while
``store.length(layer)`` counts the tokens stored per sequence (padding dropped).

Served: causal self-attention layers, full, sliding-window (Gemma 2/3, gpt-oss, Mistral: the
config's ``layer_types`` and ``sliding_window``) or chunked (Llama 4's ``chunked_attention`` layers
and ``attention_chunk_size``), each layer's kind read from the config; ``softcap`` (Gemma 2) and
attention sinks (gpt-oss's ``s_aux``) from the call; left-padded or unpadded batches, greedy and
sampled decoding, prefill in one or several chunks. A local layer keeps only its window's pages,
and appends a long prefill in slices of ``max_append`` tokens (each slice stored, then its rows
read), so its pages stay about its window. Refused with an error: a mask other than the layer's
own pattern with left padding (right padding, packed or custom masks), attention weights asked
for, dropout, gradients, beam search and cropping.
"""

from __future__ import annotations

import numbers

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lowbit_attn.kvcache import QuantizedKVCache, attention_with_kv_cache

# Arguments some models pass that the cache path has no use for.
_UNSERVED = ("position_bias",)


class PendingKV:
    """What :meth:`QuantizedCache.update` returns for a layer's keys (``role="key"``) and values:
    a handle on the step's new K and V, which only the ``"lowbit"`` attention function consumes.
    Read as a tensor (an attribute, a torch function), it raises ``RuntimeError``."""

    __slots__ = ("layer", "role")

    def __init__(self, layer: QuantizedCacheLayer, role: str):
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "role", role)

    def __repr__(self) -> str:
        return f"PendingKV(layer={self.layer.layer_idx}, role={self.role!r})"

    def _refuse(self, what: str):
        raise RuntimeError(
            f"lowbit_attn QuantizedCache: the {self.role}s of layer {self.layer.layer_idx} were "
            f"used as a tensor ({what}) by an attention implementation other than lowbit_attn's; the "
            "cache holds 8-bit pages only lowbit_attn reads: register it "
            "(lowbit_attn.integrations.transformers.register()) and load the model with "
            "attn_implementation='lowbit', or generate with transformers' DynamicCache")

    def __getattr__(self, name):
        self._refuse(f".{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        marker = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, PendingKV))
        marker._refuse(getattr(func, "__name__", repr(func)))

    def __array__(self, *args, **kwargs):
        self._refuse("__array__")


class QuantizedCacheLayer(CacheLayerMixin):
    """One layer of :class:`QuantizedCache`: stashes each step's K and V until the attention
    function appends them to layer ``layer_idx`` of the shared :class:`QuantizedKVCache`."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, store: QuantizedKVCache, layer_idx: int):
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        self.is_sliding = store.layers[layer_idx].local  # how transformers finds a local layer
        self.seen = 0              # positions seen, padding included
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        # what transformers asked and was refused after this layer had stored a call's prompt
        # (beam search reorders after the prefill): the next update raises until reset()
        self.refused: str | None = None
        self.siblings: list[QuantizedCacheLayer] = [self]  # the cache's layers (QuantizedCache)
        self.device = store.device
        self.batch_size = store.batch  # Cache.batch_size reads it from its layers
        self.is_initialized = True  # the pages are allocated up front

    def __repr__(self) -> str:
        return f"QuantizedCacheLayer(layer_idx={self.layer_idx}, seen={self.seen})"

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stash the step's ``[B, Hkv, n, D]`` keys and values; returns ``(PendingKV, PendingKV)``
        for the attention function, which stores them."""
        if self.refused is not None:
            raise RuntimeError(
                f"lowbit_attn QuantizedCache: this cache holds the prompt of a generate call that "
                f"was refused ({self.refused}); call cache.reset() before using it again")
        if self.pending is not None:
            raise RuntimeError(
                f"lowbit_attn QuantizedCache: layer {self.layer_idx}'s previous keys and values "
                "were never stored: the model's attention implementation is not lowbit_attn's "
                "(attn_implementation='lowbit'), or a call failed; call cache.reset() to start "
                "over")
        store = self.store
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{name} must be a 4D tensor [B, Hkv, n, D], got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            if x.dtype != store.dtype or x.device != store.device:
                raise TypeError(
                    f"{name} is {x.dtype} on {x.device}, the cache holds {store.dtype} on "
                    f"{store.device}: build QuantizedCache with dtype=model.dtype, "
                    "device=model.device")
            if x.shape[0] != store.batch:
                raise ValueError(f"{name} has batch {x.shape[0]}, the cache was built for batch="
                                 f"{store.batch} (num_return_sequences and beams count too)")
        self.pending = (key_states, value_states)
        self.seen += key_states.shape[2]
        return PendingKV(self, "key"), PendingKV(self, "value")

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1  # positions are not bounded by the store (padding is not stored)

    def reset(self) -> None:
        self.seen = 0
        self.pending = None
        self.refused = None

    def _refuse_change(self, what: str, message: str):
        if self.seen:  # the refused call's prompt is stored already
            self.refused = what
            message += "; this cache now holds that call's prompt: call cache.reset() before reusing it"
        raise NotImplementedError(f"lowbit_attn QuantizedCache {message}")

    def offload(self):
        raise NotImplementedError("lowbit_attn QuantizedCache does not offload")

    def prefetch(self):
        raise NotImplementedError("lowbit_attn QuantizedCache does not offload")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            self._refuse_change("cropping", "cannot be cropped (assisted decoding, rollbacks): "
                                "its pages are append-only")

    def reorder_cache(self, beam_idx) -> None:
        self._refuse_change("beam search", "cannot reorder sequences: beam search is not served; "
                            "use greedy or sampled decoding")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse_change("a change of batch", "cannot change its batch: build it with the "
                            "batch generate runs (num_return_sequences included)")

    def batch_select_indices(self, indices) -> None:
        self.batch_repeat_interleave(1)


def local_layers(config, num_layers: int) -> tuple[list[int | None], list[int | None]]:
    """Each layer's ``(window, chunk)`` from a transformers config, as
    :class:`QuantizedKVCache` takes them: ``window = sliding_window - 1`` (transformers' key
    ``j`` is seen from ``i`` iff ``i - sliding_window < j <= i``: ``sliding_window`` keys, the
    query's own included) for a ``"sliding_attention"`` layer, or for every layer of a config
    with ``sliding_window`` and no ``layer_types`` (Mistral); ``chunk = attention_chunk_size``
    for a ``"chunked_attention"`` layer (Llama 4). Raises ``ValueError`` for a layer type the
    cache does not serve."""
    types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    windows: list[int | None] = [None] * num_layers
    chunks: list[int | None] = [None] * num_layers
    if types is None:
        if sliding is not None and getattr(config, "use_sliding_window", True) is not False:
            windows = [int(sliding) - 1] * num_layers
        return windows, chunks
    for i, kind in enumerate(types[:num_layers]):
        if kind == "sliding_attention" and sliding is not None:
            windows[i] = int(sliding) - 1
        elif kind == "chunked_attention" and chunk is not None:
            chunks[i] = int(chunk)
        elif kind != "full_attention":
            raise ValueError(f"config layer {i} is {kind!r}: lowbit_attn QuantizedCache serves "
                             "full, sliding-window and chunked attention layers; use "
                             "transformers' DynamicCache for this model")
    return windows, chunks


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class QuantizedCache(Cache):
    """A transformers ``Cache`` whose K and V live in a :class:`QuantizedKVCache` (8-bit pages),
    for ``model.generate(..., cache=cache)`` (``past_key_values=`` before transformers 5) with
    ``attn_implementation="lowbit"``.
    (Not transformers' own ``QuantizedCache``, which dequantizes for the attention.)

    Each layer's ``update`` returns markers, not tensors, and the ``lowbit`` attention function
    appends the step's real tokens with their queries (padding read from the mask) and attends
    against the 8-bit pages, never dequantized. ``store`` is the :class:`QuantizedKVCache`;
    ``store.length(layer)`` its stored tokens. Refused with an error during generation: right
    padding, attention weights, dropout, beam search and cropping; another attention
    implementation that receives a marker raises.

    Args:
        config: the model's config (``num_hidden_layers``, ``num_key_value_heads``,
            ``head_dim``), or ``None`` with ``num_layers``, ``kv_heads`` and ``head_dim`` given.
        batch: the batch ``generate`` runs (times ``num_return_sequences``).
        max_tokens: the most tokens one sequence stores (prompt without padding + new tokens).
        num_layers: layers, when no config gives them (or to override it).
        kv_heads: key/value heads per layer, likewise.
        head_dim: the head dim, likewise.
        page_size: tokens per page, as for :class:`QuantizedKVCache`.
        recipe: ``"kv_int8_fp8"`` or ``"kv_int8_int8"``, as for :class:`QuantizedKVCache`.
        dtype: the model's dtype (that of the K and V it produces).
        device: the model's device.
        window: each layer's sliding window (keys back from the query, transformers'
            ``sliding_window - 1``), as :class:`QuantizedKVCache` takes it; by default (with
            ``chunk`` None too) read from the config (:func:`local_layers`).
        chunk: each layer's chunk, likewise (Llama 4's chunked layers).
        max_append: the most tokens a local layer stores at once: a longer prefill is stored
            and read in slices of that many tokens, and a local layer's pool holds its window
            and one slice (256 by default).

    Raises:
        ImportError: transformers is not installed.
        TypeError: as :class:`QuantizedKVCache` for ``batch``, ``max_tokens``, ``page_size``,
            ``recipe``, ``dtype``, ``window``, ``chunk`` and ``max_append``.
        ValueError: a config with a layer type other than full, sliding or chunked attention;
            neither a config nor all three dimensions; a size that is not a positive int; an
            unknown recipe.

    Examples:
        >>> import torch
        >>> from lowbit_attn.integrations.transformers import QuantizedCache
        >>> cache = QuantizedCache(batch=1, max_tokens=128, num_layers=2, kv_heads=2,
        ...                        head_dim=32, dtype=torch.float32)
        >>> cache.get_seq_length()
        0

        Pass it to ``model.generate(..., cache=cache)`` (``past_key_values=`` before transformers 5).
    """

    def __init__(self, config=None, *, batch: int, max_tokens: int, num_layers: int | None = None,
                 kv_heads: int | None = None, head_dim: int | None = None, page_size: int = 64,
                 recipe: str = "kv_int8_fp8", dtype: torch.dtype = torch.float16, device="cpu",
                 window=None, chunk=None, max_append: int = 256):
        if config is not None:
            if hasattr(config, "get_text_config"):
                config = config.get_text_config(decoder=True)
            heads = config.num_attention_heads
            num_layers = num_layers or config.num_hidden_layers
            kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or heads
            head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // heads
            if window is None and chunk is None:
                window, chunk = local_layers(config, _count("num_layers", num_layers))
        elif None in (num_layers, kv_heads, head_dim):
            raise ValueError("give QuantizedCache a model config, or num_layers, kv_heads and "
                             f"head_dim (got {num_layers}, {kv_heads}, {head_dim})")
        self.store = QuantizedKVCache(_count("num_layers", num_layers), batch,
                                      _count("kv_heads", kv_heads), _count("head_dim", head_dim),
                                      max_tokens=max_tokens, page_size=page_size, recipe=recipe,
                                      dtype=dtype, device=device, window=window, chunk=chunk,
                                      max_append=max_append)
        super().__init__(layers=[QuantizedCacheLayer(self.store, i) for i in range(num_layers)])
        for layer in self.layers:
            layer.siblings = self.layers

    def __repr__(self) -> str:
        return f"QuantizedCache(seen={self.get_seq_length()}, store={self.store!r})"

    def reset(self) -> None:
        """Empty every layer: the store's pages freed, no position seen."""
        self.store.reset()
        super().reset()


def _refuse(reason: str):
    raise ValueError(f"lowbit_attn QuantizedCache: {reason}")


def call_options(module, kwargs) -> tuple[int | None, int | None, float | None, object]:
    """What a transformers attention call asks beyond causal attention, as ``(window, chunk,
    softcap, sinks)``: the sliding window from the call's ``sliding_window`` (Gemma 2/3,
    gpt-oss, Mistral; else the module's), as keys back (``sliding_window - 1``); the chunk of a
    layer whose config type is ``"chunked_attention"`` (Llama 4 passes nothing:
    ``config.attention_chunk_size``); ``softcap`` (Gemma 2); the sinks, ``s_aux`` (gpt-oss) or
    ``sinks``."""
    sliding = (kwargs["sliding_window"] if "sliding_window" in kwargs
               else getattr(module, "sliding_window", None))
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    chunk = None
    if types is not None and idx is not None and idx < len(types) \
            and types[idx] == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    return (None if sliding is None else int(sliding) - 1, None if chunk is None else int(chunk),
            kwargs.get("softcap"), sinks)


def local_visible(pos: torch.Tensor, qpos: torch.Tensor, window: int | None,
                  chunk: int | None) -> torch.Tensor:
    """Bool ``[..., n, K]``: key position ``pos [..., K]`` seen from query position
    ``qpos [..., n]`` in one sequence's own positions (padding left out): causal, within
    ``window`` keys back, in the query's chunk."""
    p, q = pos[..., None, :], qpos[..., :, None]
    seen = p <= q
    if window is not None:
        seen = seen & (p >= q - window)
    if chunk is not None:
        seen = seen & (torch.div(p, chunk, rounding_mode="floor")
                       == torch.div(q, chunk, rounding_mode="floor"))
    return seen


def _new_token_validity(mask, layer: QuantizedCacheLayer, n: int) -> torch.Tensor | None:
    """``valid [B, n]`` for the step's new tokens (None: all), read from the 4D bool mask ``mask``
    ``[B or 1, 1, n, seen]``: a new token is real where its query sees itself. Refuses a mask that
    is not the layer's pattern (causal, and its window or chunk) with left padding over the
    stored tokens and the real new ones."""
    store, seen = layer.store, layer.seen
    lengths = store.length(layer.layer_idx)
    if mask is None:  # transformers leaves out a purely causal mask: no padding anywhere
        if not bool((lengths + n == seen).all()):
            _refuse(f"layer {layer.layer_idx} got no attention mask, but its sequences store "
                    f"{lengths.tolist()} tokens of {seen - n} positions (padding was dropped "
                    "earlier): pass the attention_mask on every call")
        return None
    b = store.batch
    if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
            or mask.shape[0] not in (1, b) or mask.shape[1] != 1 or mask.shape[2] != n
            or mask.shape[3] != seen):
        _refuse(f"layer {layer.layer_idx} needs a bool mask [B, 1, {n}, {seen}] (as the 'lowbit' "
                f"implementation builds), got {getattr(mask, 'dtype', type(mask).__name__)} "
                f"{tuple(getattr(mask, 'shape', ()))}")
    mask = mask[:, 0].expand(b, -1, -1)
    valid = torch.diagonal(mask[:, :, seen - n:], dim1=1, dim2=2)  # [B, n]: sees itself
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        _refuse("the new tokens have padding after a real token: right padding, or padding in "
                "the middle (a multi-turn batch whose rows add different numbers of tokens); the "
                "cache aligns queries bottom-right: pad on the left (tokenizer.padding_side = "
                "'left'), and for such a multi-turn batch reset the cache and prefill the whole "
                "conversations left-padded")
    total = lengths.to(mask.device) + valid.sum(dim=1)  # real tokens after the step
    pos = torch.arange(seen, device=mask.device)[None, :] - (seen - total)[:, None]  # own positions
    stored = store.layers[layer.layer_idx]
    want = (pos >= 0)[:, None, :] & local_visible(pos, pos[:, seen - n:], stored.window,
                                                  stored.chunk)
    if bool(((mask != want) & valid[:, :, None]).any()):
        _refuse(f"layer {layer.layer_idx}'s mask is not its pattern (causal, window="
                f"{stored.window}, chunk={stored.chunk}) over the {lengths.tolist()} stored "
                "tokens and the new ones with left padding (packed sequences or a custom mask, or "
                "the mask does not match what was stored): the cache cannot serve it")
    return None if bool(valid.all()) else valid.to(store.device)


def attend(module, query: torch.Tensor, key: PendingKV, value: PendingKV, attention_mask,
           dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The attention function's path for a :class:`QuantizedCache` step: store the step's K and
    V (padding dropped), then :func:`attention_with_kv_cache`, with the call's softcap and
    sinks; in a local layer a prefill longer than ``max_append`` in slices (each stored, then
    its rows read). Returns ``(out [B, n, H, D], None)``; raises ``ValueError`` for a call it
    cannot serve, with nothing stored by it (the layer is put back as before the step where no
    other layer stored the step either: a retry may follow; else the next step says to reset)."""
    layer = key.layer
    if not isinstance(value, PendingKV) or value.layer is not layer or layer.pending is None:
        _refuse("keys and values must be the pair cache.update() returned for this step")
    unserved = [k for k in _UNSERVED if kwargs.get(k) is not None]
    if kwargs.get("output_attentions"):
        unserved.append("output_attentions (no attention weights are formed)")
    if dropout:
        unserved.append(f"dropout={dropout} (call model.eval())")
    window, chunk, softcap, sinks = call_options(module, kwargs)
    stored = layer.store.layers[layer.layer_idx]
    if (window, chunk) != (stored.window, stored.chunk):
        unserved.append(f"window={window}, chunk={chunk} (the cache's layer was built with "
                        f"window={stored.window}, chunk={stored.chunk}: build QuantizedCache "
                        "from the model's config)")
    k, v = layer.pending
    n = k.shape[2]
    outs, stored_any = [], False
    try:
        if unserved:
            _refuse(f"layer {layer.layer_idx} cannot serve {', '.join(unserved)}")
        if query.shape[0] != k.shape[0] or query.shape[2] != n:
            _refuse(f"query {tuple(query.shape)} does not match the step's keys {tuple(k.shape)}")
        valid = _new_token_validity(attention_mask, layer, n)
        store, idx = layer.store, layer.layer_idx
        step = store.max_append if stored.local else n
        for s0 in range(0, n, step):  # q: the first append's queries freeze the balancing
            part = slice(s0, min(n, s0 + step))
            store.append(idx, k[:, :, part], v[:, :, part],
                         valid=None if valid is None else valid[:, part], q=query[:, :, part])
            stored_any = True
            outs.append(attention_with_kv_cache(query[:, :, part], store, idx, scale=scaling,
                                                softcap=softcap, sinks=sinks))
    except Exception:
        # nothing stored, by this layer or (in this step) another: all as before the step's
        # updates. Else the layer keeps its pending keys: the next update says to reset.
        if not stored_any and all(other.seen == layer.seen - n for other in layer.siblings
                                  if other is not layer):
            layer.pending = None
            layer.seen -= n
        raise
    layer.pending = None
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["PendingKV", "QuantizedCache", "QuantizedCacheLayer", "attend", "call_options",
           "local_layers", "local_visible"]
