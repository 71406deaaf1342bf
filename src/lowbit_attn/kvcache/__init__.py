"""An 8-bit paged KV cache for LLM generation (K INT8 per token, V E4M3 or INT8 per page) and
attention against it, read top to bottom: ``interface`` (checks, the public function) →
``cache`` (``QuantizedKVCache``: append, checks) → ``quantize`` (what is stored) and ``pages``
(pools, block tables) → ``kernel_append`` (an append as one Triton launch; its twin: the
cache's ``_write``) and ``kernel_decode`` (the split-KV Triton kernel) | ``naive`` (its twin);
``step`` (``DecodeStep``: append and attention as launches a CUDA graph can replay);
``planned`` (the keys of eager reads' and appends' launch plans)."""

from lowbit_attn.kvcache.cache import QuantizedKVCache
from lowbit_attn.kvcache.interface import attention_with_kv_cache
from lowbit_attn.kvcache.step import DecodeStep

__all__ = ["DecodeStep", "QuantizedKVCache", "attention_with_kv_cache"]
