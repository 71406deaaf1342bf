"""A view whose negation is a flag, not memory (``x.conj().imag``: ``x.is_neg()``): the kernels
read memory, and the eager paths launch them directly (PyTorch resolves the flag only for custom
ops), so ``attention`` on the kernels gave the output of ``+v`` for such a ``-v``, and the KV
cache stored ``+k``. Each call now reads the values the view holds."""

from __future__ import annotations

import pytest
import torch

import lowbit_attn

pytestmark = pytest.mark.interpreter


def _negated(x):
    view = torch.complex(torch.zeros_like(x), -x).conj().imag  # holds x; its memory holds -x
    assert view.is_neg() and torch.equal(view, x)
    return view


def _qkv(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, n, 32, generator=g) for _ in range(3))


@pytest.mark.parametrize("operand", [0, 1, 2], ids=["q", "k", "v"])
def test_attention_reads_a_negated_view_as_its_values(triton_backend, operand):
    qkv = list(_qkv())
    want = lowbit_attn.attention(*qkv)
    qkv[operand] = _negated(qkv[operand])
    assert torch.equal(lowbit_attn.attention(*qkv), want)


def test_the_kv_cache_and_decode_step_read_negated_views_as_their_values(triton_backend):
    q, k, v = (x.half() for x in _qkv(8, seed=1))
    caches = [lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=64, dtype=torch.float16)
              for _ in range(2)]
    caches[0].append(0, k, v, q=q)
    caches[1].append(0, _negated(k), _negated(v), q=_negated(q))
    reads = [lowbit_attn.attention_with_kv_cache(x, cache, 0)
             for x, cache in ((q, caches[0]), (_negated(q), caches[1]))]
    assert torch.equal(*reads)
    q1, k1, v1 = (x[:, :, :1] for x in _qkv(1, seed=2))
    q1, k1, v1 = (x.half().contiguous() for x in (q1, k1, v1))
    steps = [lowbit_attn.DecodeStep(cache, 0, heads=2, steps=1) for cache in caches]
    got = steps[1].run(_negated(q1), _negated(k1), _negated(v1)).clone()
    assert torch.equal(steps[0].run(q1, k1, v1), got)
