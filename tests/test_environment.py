"""The placement variables (``LOWBIT_ATTN_LAUNCH`` and the others of
:class:`~lowbit_attn.core.options.KernelOptions`) are read by every attention call, so a mistyped
value raises wherever it is set, as docs/environment.md says: the KV cache and video sparse
attention accepted any value (a ``LOWBIT_ATTN_LAUNCH=plans`` left decoding without plans, with no
word)."""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from lowbit_attn.core.options import KernelOptions


def _cache_and_kv():
    cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=64)
    k = torch.randn(1, 2, 8, 32, dtype=torch.float16)
    return cache, k


def _append():
    cache, k = _cache_and_kv()
    cache.append(0, k, k)


def _read():
    cache, k = _cache_and_kv()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("LOWBIT_ATTN_LAUNCH")
        cache.append(0, k, k)
    lowbit_attn.attention_with_kv_cache(k, cache, 0)


def _video():
    x = torch.randn(1, 1, 64, 32)
    lowbit_attn.video_sparse_attention(x, x, x, video_shape=(4, 4, 4), topk=1)


CALLS = {
    "attention": lambda: lowbit_attn.attention(*(torch.randn(1, 1, 8, 32),) * 3),
    "trainable_attention": lambda: lowbit_attn.trainable_attention(
        *(torch.randn(1, 1, 8, 32, requires_grad=True),) * 3),
    "append": _append,
    "attention_with_kv_cache": _read,
    "video_sparse_attention": _video,
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_bad_placement_value_raises_on_every_call(monkeypatch, call):
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "plans")
    with pytest.raises(ValueError, match=r"LOWBIT_ATTN_LAUNCH must be one of \('plan', 'triton'\), "
                                         r"got 'plans'"):
        CALLS[call]()


def test_the_options_are_parsed_once_per_set_of_values(monkeypatch):
    monkeypatch.setenv("LOWBIT_ATTN_TRAIN_DQ", "atomic")
    first = KernelOptions.from_env()
    assert first.train_dq == "atomic" and KernelOptions.from_env() is first
    monkeypatch.setenv("LOWBIT_ATTN_TRAIN_DQ", "recompute")
    assert KernelOptions.from_env().train_dq == "recompute"
    monkeypatch.setenv("LOWBIT_ATTN_TRAIN_DQ", "fused")
    for _ in range(2):  # never kept: it raises each time
        with pytest.raises(ValueError, match="LOWBIT_ATTN_TRAIN_DQ"):
            KernelOptions.from_env()
