"""Quantizers: the Triton kernels against their PyTorch twins, bit for bit, and the numerics' edges.
The test that takes ``device`` runs on each target (tests/conftest.py), the others under the
interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowbit_attn
from helpers import assert_close, assert_same
from lowbit_attn.quant import int8_naive as ref
from lowbit_attn.quant.tile import divided


def kq():
    from lowbit_attn.quant import int8 as quantize

    return quantize


SHAPES = [
    pytest.param((1, 1, 63, 60), id="B1-H1-N63-D60"),
    pytest.param((2, 3, 111, 100), id="B2-H3-N111-D100"),
    pytest.param((1, 2, 128, 64), id="B1-H2-N128-D64"),
    pytest.param((1, 1, 1, 128), id="B1-H1-N1-D128"),
]


@pytest.mark.parametrize("shape", SHAPES + [
    pytest.param((2, 8, 1000, 128), id="gpu-B2-H8-N1000-D128", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("granularity", ["per_block", "per_token", "per_thread"])
@pytest.mark.parametrize("center", ["none", "mean", "block_mean"])
@pytest.mark.parametrize("role", ["q", "k"])
def test_int8_kernel_matches_twin_bit_for_bit(shape, granularity, center, role, device):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3 + torch.randn(shape[-1], generator=g)).half()
    b, h, n, d = shape
    block = 128 if (granularity, role) == ("per_thread", "k") else 64  # K's per-thread tile
    # GQA statistics: x is Q with h heads sharing one KV head, or K whose heads each serve 2 Q heads
    hq, hkv = (h, 1) if role == "q" else (2 * h, h)
    amax_q = torch.rand(b, hq, d, generator=g) * 3
    amax_q[..., 0] = 0.0  # a channel that is all zero on one side keeps α = 1
    amax_k = torch.rand(b, hkv, d, generator=g) * 20
    c = None
    if center == "mean":
        c = torch.randn(b, h, d, generator=g)
    elif center == "block_mean":
        c = torch.randn(b, h, -(-n // block), d, generator=g)
    x, amax_q, amax_k, c = (t if t is None else t.to(device.name) for t in (x, amax_q, amax_k, c))
    kw = dict(granularity=granularity, block=block, center=c, center_per_block=center == "block_mean",
              balance=(amax_q, amax_k), role=role, scale_multiplier=0.18)
    v_ref, s_ref = ref.quantize_int8(x, **kw)
    v_k, s_k = kq().quantize_int8(x, **kw)
    assert_same(v_k, v_ref, device, "int8 codes", name="values")
    assert_same(s_k, s_ref, device, "int8 codes", name="scales")


@pytest.mark.interpreter
def test_sqrt_rn_is_correctly_rounded():
    # The balancing factor's square root decides Q's and K's scales; the kernels take it with
    # IEEE sqrt, which numpy's float32 sqrt also is, so the twin must match it on every input
    # (torch.sqrt on a CPU does not: one ulp off on some machines).
    import numpy as np

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x[torch.isfinite(x)], torch.tensor([0.0, -0.0, 1e-45, 2.0, 4.0, 3.4e38,
                                                        float("inf"), float("nan"), -1.0])])
    with np.errstate(invalid="ignore"):
        want = np.sqrt(x.numpy())
    got = ref.sqrt_rn(x).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))  # NaN payloads are the platform's
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite].view(np.int32), want[finite].view(np.int32))


@pytest.mark.interpreter
def test_int8_rounds_half_to_even():
    # amax 127 gives scale exactly 1, so these are exact ties.
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.0, 4.5,
                        -3.5, 5.5, 6.5, 7.5])
    x = row.view(1, 1, 1, 16)
    expected = torch.tensor([127, 0, 2, 2, 0, -2, -2, 4, 126, -126, 0, 4, -4, 6, 6, 8],
                            dtype=torch.int8).view(1, 1, 1, 16)
    for impl in (ref, kq()):
        values, scale = impl.quantize_int8(x, granularity="per_token", block=16)
        assert torch.equal(values, expected)
        assert scale.item() == 1.0


@pytest.mark.interpreter
@pytest.mark.parametrize("impl_name", ["reference", "triton"])
def test_int8_zero_group_and_non_finite(impl_name):
    impl = ref if impl_name == "reference" else kq()
    x = torch.zeros(1, 1, 32, 16)
    x[0, 0, 16:] = torch.randn(16, 16)
    x[0, 0, 20, 3] = float("nan")
    values, scale = impl.quantize_int8(x, granularity="per_block", block=16)
    assert scale[0, 0, 0].item() == 1.0 and torch.all(values[0, 0, :16] == 0)
    assert torch.isnan(scale[0, 0, 1])  # a NaN makes its block's scale NaN: never hidden
    x[0, 0, 20, 3] = float("inf")
    _, scale = impl.quantize_int8(x, granularity="per_token", block=16)
    assert torch.isnan(scale[0, 0, 20]) and torch.isfinite(scale[0, 0, 21])


@pytest.mark.interpreter
@pytest.mark.parametrize("impl_name", ["reference", "triton"])
@pytest.mark.parametrize("n", [1, 150, 300])
def test_per_thread_groups_are_the_wgmma_fragments(impl_name, n):
    """Q: rows r and r + 8 of each 16-row slice share a scale; K: in each 128-key block, keys
    2c and 2c + 1 (mod 8) do. Each row gets a distinct magnitude, so a scale is its group's
    largest row's magnitude / 127 and nothing else."""
    impl = ref if impl_name == "reference" else kq()
    rows = torch.arange(1, n + 1, dtype=torch.float32)
    x = torch.ones(1, 1, n, 16) * rows[:, None]
    x[..., 1] = -x[..., 1]
    q_values, q_scale = impl.quantize_int8(x, granularity="per_thread", block=64, role="q")
    k_values, k_scale = impl.quantize_int8(x, granularity="per_thread", block=128, role="k")
    i = torch.arange(n)
    q_groups = {}
    k_groups = {}
    for r in range(n):
        q_groups.setdefault((r // 16, r % 8), []).append(r + 1)
        k_groups.setdefault((r // 128, (r % 8) // 2), []).append(r + 1)
    want_q = torch.ones(-(-n // 16) * 8)  # a group past the last row: scale 1
    for (s, r), members in q_groups.items():
        want_q[s * 8 + r] = max(members) / 127.0
    want_k = torch.ones(-(-n // 128) * 4)
    for (blk, c), members in k_groups.items():
        want_k[blk * 4 + c] = max(members) / 127.0
    # amax·(1/127): an ulp from amax/127
    assert torch.allclose(q_scale[0, 0], want_q, rtol=1e-6, atol=0)
    assert torch.allclose(k_scale[0, 0], want_k, rtol=1e-6, atol=0)
    assert torch.equal(ref.thread_groups(n, "q"), (i // 16) * 8 + i % 8)
    # the largest row of each group is ±127
    for values, groups in ((q_values, q_groups), (k_values, k_groups)):
        for members in groups.values():
            top = max(members) - 1
            assert values[0, 0, top, 0] == 127 and values[0, 0, top, 1] == -127


@pytest.mark.interpreter
@pytest.mark.parametrize("impl_name", ["reference", "triton"])
@pytest.mark.parametrize("role", ["q", "k"])
def test_per_thread_nan_poisons_its_group_only(impl_name, role):
    impl = ref if impl_name == "reference" else kq()
    x = torch.randn(1, 1, 140, 32, generator=torch.Generator().manual_seed(3))
    x[0, 0, 19, 5] = float("inf")  # Q: slice 1, group 1·8 + 3; K: block 0, group (19 % 8) // 2 = 1
    _, scale = impl.quantize_int8(x, granularity="per_thread", block=64 if role == "q" else 128,
                                  role=role)
    bad = 11 if role == "q" else 1
    assert torch.isnan(scale[0, 0, bad])
    others = torch.cat([scale[0, 0, :bad], scale[0, 0, bad + 1:]])
    assert torch.isfinite(others).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(8))
def test_int8_dequantization_error_is_within_half_a_step(seed):
    """|q·s − x| ≤ s/2, up to fp32 rounding of x/s and of q·s (an ulp of |x| each: a bound of
    s/2·(1 + 1e-6) fails on ~1 % of random tensors, where x sits near a half step and |x| ≈ 127·s)."""
    x = torch.randn(1, 2, 96, 64, generator=torch.Generator().manual_seed(seed))
    values, scale = ref.quantize_int8(x, granularity="per_token", block=64)
    s = scale.unsqueeze(-1)
    err = (values.float() * s - x).abs()
    assert torch.all(err <= 0.5 * s + x.abs() * 2.0**-23)


def _e4m3_probe_values() -> torch.Tensor:
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.sort(grid[torch.isfinite(grid)]).values
    mids = (grid[:-1] + grid[1:]) / 2  # exact ties between neighbours
    extra = torch.tensor([448.0, 449.0, 463.9, 464.0, 470.0, 1e6, -1e6, 1e-9, -1e-9, 2.0**-10,
                          3 * 2.0**-11, float("inf"), float("-inf")])
    return torch.cat([grid, mids, mids * 1.0001, mids * 0.9999, extra])


@pytest.mark.interpreter
def test_e4m3_kernel_conversion_matches_torch():
    vals = _e4m3_probe_values()
    n = vals.numel()
    x = vals.view(1, 1, n, 1).expand(1, 1, n, 16).contiguous()
    amax = torch.full((1, 1, 16), 448.0)  # scale 1
    got, got_scale = kq().convert_v(x, pv="fp8", amax=amax)
    want, want_scale = ref.convert_v(x, pv="fp8", amax=amax)
    assert torch.equal(got_scale, want_scale) and torch.all(want_scale == 1)
    assert torch.equal(got.float().nan_to_num(nan=1234.0), want.float().nan_to_num(nan=1234.0))


@pytest.mark.interpreter
def test_e4m3_saturates_and_keeps_nan():
    x = torch.tensor([500.0, -1e9, float("nan"), 0.0])
    y = ref.to_e4m3(x).float()
    assert y[0] == 448 and y[1] == -448 and torch.isnan(y[2]) and y[3] == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("center", ["none", "mean"])
@pytest.mark.parametrize("pv", ["fp16", "fp8", "fp16-unscaled", "fp8-permuted"])
def test_convert_v_matches_twin(center, pv):
    g = torch.Generator().manual_seed(3)
    # channels from 2^-60 to 2^60: fp16 V is scaled by a power of two where fp16 cannot hold it
    spread = 2.0 ** torch.linspace(-60, 60, 48)
    x = (torch.randn(2, 3, 77, 48, generator=g) * spread).bfloat16()
    c = torch.randn(2, 3, 48, generator=g) * spread if center == "mean" else None
    amax = None
    if pv != "fp16-unscaled":
        amax = torch.rand(2, 3, 48, generator=g) * 5 * spread
        amax[0, 0, 0] = 0.0  # an all-zero channel gets scale 1
    permuted = pv.endswith("permuted")
    pv = pv.split("-")[0]
    got, got_scale = kq().convert_v(x, pv=pv, center=c, amax=amax, permuted=permuted)
    want, want_scale = ref.convert_v(x, pv=pv, center=c, amax=amax, permuted=permuted)
    assert got.shape == want.shape
    assert torch.equal(got.float().nan_to_num(nan=7.0), want.float().nan_to_num(nan=7.0))
    if amax is not None:
        assert torch.equal(got_scale, want_scale) and want_scale[0, 0, 0] == 1
    else:
        assert got_scale is None and want_scale is None


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("center", ["none", "mean"])
def test_packed_fp8_v_starts_each_sequence_aligned_and_matches_twin(center, d):
    """Packed E4M3 V (varlen) stores sequence b from token 16·(cu[b] // 16 + b), zeros up to the
    next multiple of 16 (``QuantizedQKV``), so the attention kernel's V tile is an aligned copy;
    each sequence holds the twin's bits for that sequence alone. Lengths 0, 1, 15, 16, 17 and 40:
    starts that are not multiples of 16 in the packed input."""
    from lowbit_attn.core.operands import Seqs, packed_v_starts, packed_v_tokens

    lens = [17, 0, 1, 15, 16, 40]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total, batch = int(cu[-1]), len(lens)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(total, 2, d, generator=g) * 3).half()
    c = torch.randn(batch, 2, d, generator=g) if center == "mean" else None
    amax = torch.rand(batch, 2, d, generator=g) * 5
    seqs = Seqs(batch=batch, max_len=max(lens), cu_seqlens=cu)
    got, got_scale = kq().convert_v(x, pv="fp8", center=c, amax=amax, seqs=seqs)
    assert got.shape == (packed_v_tokens(total, batch), 2, d) and got.stride(0) == 1
    starts = packed_v_starts(cu).tolist()
    assert all(s % 16 == 0 for s in starts) and starts[-1] == got.shape[0]
    for b, n in enumerate(lens):
        lo = int(cu[b])
        dense = x[lo:lo + n].transpose(0, 1).unsqueeze(0)
        want, want_scale = ref.convert_v(dense, pv="fp8", center=None if c is None else c[b:b + 1],
                                         amax=amax[b:b + 1])
        stored = got[starts[b]:starts[b] + -(-n // 16) * 16].transpose(0, 1).float()
        assert starts[b] + stored.shape[1] <= starts[b + 1]
        assert torch.equal(stored[:, :n], want[0].float()), b
        assert torch.equal(stored[:, n:], torch.zeros_like(stored[:, n:])), b
        if n:  # a sequence without keys writes no scale (none is read)
            assert torch.equal(got_scale[b], want_scale[0])


@pytest.mark.interpreter
@pytest.mark.parametrize("n", [1, 15, 17, 112, 113, 200])
def test_permuted_v_stores_every_key_of_at_least_one_key_block(n, monkeypatch):
    """The Triton quantizer's permuted E4M3 V (``QuantizedQKV.v_permuted``): ``permuted_v_keys(n)``
    keys stored (padded to 16 and to at least 128, the sm90 forward's key block, so that its V
    descriptor's box never spans more than the tensor: a one-key call stored 16 before), every
    one written (its allocation filled with NaN first): the twin's bits."""
    from lowbit_attn.core.operands import permuted_v_keys

    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)
    v = torch.randn(1, 2, n, 64, generator=torch.Generator().manual_seed(n))
    amax = v.abs().amax(dim=2)
    stored, scale = kq().convert_v(v, pv="fp8", amax=amax, permuted=True)
    want, want_scale = ref.convert_v(v, pv="fp8", amax=amax, permuted=True)
    assert stored.shape[2] == permuted_v_keys(n) == max(-(-n // 16) * 16, 128)
    assert not stored.float().isnan().any()
    assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scale, want_scale)


def test_permuted_keys_are_the_fp8_a_fragment_order():
    """Storage position 16g + 4c + 2h + p holds key 16g + 8h + 2c + p (so a thread's score
    columns 2c, 2c+1, 2c+8, 2c+9 sit at positions 4c..4c+3); the padding (to 16 keys, and to at
    least one 128-key block: ``core.operands.permuted_v_keys``) is zeros, and unpermute_keys
    inverts it."""
    v = torch.arange(1, 35, dtype=torch.float32)[:, None].expand(34, 3).reshape(1, 1, 34, 3)
    stored = ref.permute_keys(v)
    assert stored.shape == (1, 1, 128, 3) and not stored[0, 0, 48:].any()
    for g in range(3):
        for h in range(2):
            for c in range(4):
                for p in range(2):
                    key = 16 * g + 8 * h + 2 * c + p
                    want = key + 1 if key < 34 else 0
                    assert stored[0, 0, 16 * g + 4 * c + 2 * h + p, 0] == want
    assert torch.equal(ref.unpermute_keys(stored, 34), v)


@pytest.mark.interpreter
def test_fp16_v_scale_is_a_power_of_two_only_where_fp16_needs_one():
    """1 where amax's exponent is in [-6, 7] (the bits of plain fp16 rounding), for 0 and for
    non-finite amax (Inf and NaN reach fp16 as they are); elsewhere amax/scale in [2^7, 2^8)."""
    tiny = torch.tensor([1e-40])  # an fp32 subnormal
    amax = torch.cat([torch.tensor([0.0, 2.0**-6, 1.0, 255.9, float("inf"), float("nan")]),
                      torch.tensor([2.0**-7, 1e-8, 256.0, 65504.0, 1e5, 3e38]), tiny])
    scale, inverse = ref.fp16_v_scale(amax)
    assert torch.equal(scale[:6], torch.ones(6)) and torch.equal(inverse * scale, torch.ones(13))
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))
    scaled = amax[6:12] * inverse[6:12]
    assert torch.all((scaled >= 2.0**7) & (scaled < 2.0**8)), scaled
    assert scale[12] == 2.0**-126 and 1e-3 < tiny * inverse[12] < 2**8
    x = amax.view(1, 1, 1, 13).expand(1, 1, 3, 13).nan_to_num(nan=0.0, posinf=0.0)
    want, want_scale = ref.convert_v(x, pv="fp16", amax=amax.view(1, 1, 13))
    got, got_scale = kq().convert_v(x, pv="fp16", amax=amax.view(1, 1, 13))
    assert torch.equal(got, want) and torch.equal(got_scale, want_scale)
    assert torch.isfinite(want).all()
    assert torch.allclose(want[0, 0, 0].float() * want_scale[0, 0], x[0, 0, 0], rtol=2**-11, atol=0)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("center", ["none", "mean", "block_mean"])
def test_channel_stats_match_twin_to_rounding(shape, center):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g) * 2 + 3 * torch.randn(shape[-1], generator=g)
    m_ref, a_ref = ref.channel_stats(x, center=center, block=32)
    m_k, a_k = kq().channel_stats(x, center=center, block=32)
    assert_close(a_k, a_ref, atol=1e-5, rtol=1e-5, name="amax")
    if center == "none":
        assert m_ref is None and m_k is None
    else:
        assert_close(m_k, m_ref, atol=1e-5, rtol=1e-5, name="mean")


@pytest.mark.interpreter
def test_channel_stats_propagate_nan():
    x = torch.randn(1, 2, 40, 8)
    x[0, 1, 7, 2] = float("nan")
    for impl in (ref, kq()):
        mean, amax = impl.channel_stats(x, center="mean")
        assert torch.isnan(amax[0, 1]).all() or torch.isnan(amax[0, 1, 2])
        assert torch.isfinite(amax[0, 0]).all()



@pytest.mark.interpreter
@pytest.mark.parametrize("center", ["none", "mean"])
def test_channel_stats_of_no_token_are_zero(center):
    """A packed sequence without tokens (a varlen sequence with queries and no keys) has mean and
    amax 0, not 0/0 = NaN, which smoothing would carry into the LSE; the twin agrees."""
    from lowbit_attn.core.operands import Seqs

    x = torch.randn(9, 2, 8) + 3
    seqs = Seqs(batch=3, max_len=6, cu_seqlens=torch.tensor([0, 3, 3, 9], dtype=torch.int32))
    mean, amax = kq().channel_stats(x, center=center, seqs=seqs)
    assert torch.equal(amax[1], torch.zeros(2, 8)) and torch.all(amax[[0, 2]] > 0)
    m_ref, a_ref = ref.channel_stats(x[3:3].transpose(0, 1).unsqueeze(0), center=center)
    assert torch.equal(a_ref, torch.zeros(1, 2, 8))
    if center == "mean":
        assert torch.equal(mean[1], torch.zeros(2, 8)) and torch.equal(m_ref, torch.zeros(1, 2, 8))

@pytest.mark.interpreter
def test_the_statistics_launch_gives_the_twins_values():
    """The statistics launch (tile sums, 64 channels: what an H200 measured fastest) as a call
    asks it: K smoothed and V not, dense and packed, with a NaN and an Inf in their own channels
    and an empty sequence, and a block mean; the twin's maxima, NaN and Inf, means within
    rounding (the sums' order)."""
    from lowbit_attn.core.operands import Seqs
    from lowbit_attn.quant import int8_naive

    quant = kq()
    g = torch.Generator().manual_seed(9)
    k = torch.randn(2, 3, 203, 72, generator=g) * 2 + 3 * torch.randn(72, generator=g)
    v = torch.randn(2, 3, 203, 72, generator=g)
    k[1, 2, 150, 5], v[0, 1, 7, 60] = float("nan"), float("inf")
    packed = torch.randn(211, 3, 72, generator=g) + 2
    seqs = Seqs(batch=3, max_len=150, cu_seqlens=torch.tensor([0, 61, 61, 211], dtype=torch.int32))
    for requests in ([quant.StatsRequest(k, "mean"), quant.StatsRequest(v, "none")],
                     [quant.StatsRequest(packed, "mean", seqs=seqs)],
                     [quant.StatsRequest(k, "block_mean", 64), quant.StatsRequest(v, "none")]):
        got = quant.channel_stats_many(*requests)
        for req, (m_got, a_got) in zip(requests, got):
            if req.seqs is None:
                m_want, a_want = int8_naive.channel_stats(req.x, center=req.center,
                                                          block=req.block)
            else:  # each sequence alone, as a [1, H, n, D] tensor
                cu = req.seqs.cu_seqlens.tolist()
                found = [int8_naive.channel_stats(req.x[a:b].transpose(0, 1)[None],
                                                  center=req.center, block=req.block)
                         for a, b in zip(cu, cu[1:])]
                m_want, a_want = (torch.cat([f[i] for f in found]) for i in (0, 1))
            assert torch.equal(a_got.isnan(), a_want.isnan())
            assert_close(a_got, a_want, atol=1e-5, rtol=1e-5, name="amax")
            if m_want is not None:
                assert torch.equal(m_got.isnan(), m_want.isnan())
                assert_close(m_got, m_want, atol=1e-5, rtol=1e-5, name="mean")


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Values as their bits (NaN equal to NaN)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.interpreter
def test_the_quantizing_launch_gives_the_twins_bits():
    """The quantizing launch (32 rows per program where the scales leave the tile free, 2 warps,
    each quotient from its scale's reciprocal and one correction: what an H200 measured fastest)
    gives the twins' codes and scales bit for bit: the requests a call of the default recipe
    makes (``prepare.stats_requests``, ``prepare.quant_args``: K smoothed, Q and K balanced,
    per-token scales, V to E4M3) with a NaN and an Inf in their own rows, and with V permuted
    (its zero keys too); per-block and per-thread Q and K, whose tiles their scales fix; and
    tiles with a scale outside ``[2^-90, 2^90]`` (divided) and tiny quotients."""
    from lowbit_attn.core.recipes import Recipe, get_recipe
    from lowbit_attn.inference import prepare
    from lowbit_attn.quant import int8_naive

    quant = kq()
    g = torch.Generator().manual_seed(4)

    def check(recipe, q, k, v, permute_v=False):
        wanted = prepare.stats_requests(q, k, v, recipe)
        found = dict(zip(wanted, quant.channel_stats_many(
            *(quant.StatsRequest(*wanted[n]) for n in wanted))))
        k_args, q_args, v_args = prepare.quant_args(recipe, 0.125, found, permute_v=permute_v)
        got = quant.quantize(quant.Int8Request(k, **k_args), quant.VRequest(v, **v_args),
                             q=quant.Int8Request(q, **q_args))
        want = (int8_naive.quantize_int8(k, **k_args), int8_naive.convert_v(v, **v_args),
                int8_naive.quantize_int8(q, **q_args))
        for part, ((w_values, w_scale), (g_values, g_scale)) in enumerate(zip(want, got)):
            assert g_scale.shape == w_scale.shape and g_values.shape == w_values.shape
            g_values, w_values = g_values.contiguous(), w_values.contiguous()
            nan = w_scale.isnan()
            assert torch.equal(g_scale.isnan(), nan)
            assert torch.equal(_bits(g_scale)[~nan], _bits(w_scale)[~nan])  # NaN of either sign
            if part != 1:  # INT8 codes
                assert torch.equal(g_values, w_values)
                continue
            nan = w_values.float().isnan()
            extra = g_values.float().isnan() & ~nan
            # permuted V's padding keys of a channel whose scale is not finite (Inf in V) are
            # NaN here and 0 in the twin: that channel's outputs are NaN either way
            assert not (extra & w_scale.isfinite()[:, :, None, :]).any()
            assert torch.equal(_bits(g_values)[~(nan | extra)], _bits(w_values)[~(nan | extra)])
            assert g_values.float()[nan].isnan().all()

    default = get_recipe("qk_int8_pv_fp8")
    q, k, v = (torch.randn(2, 3, 203, 72, generator=g).to(torch.bfloat16) for _ in range(3))
    k = k + 3
    q[0, 1, 100, 4], k[1, 2, 150, 5], v[0, 1, 7, 60] = float("inf"), float("nan"), float("inf")
    blocky = Recipe(name="blocky", qk="int8", pv="fp8", granularity="per_block")
    thread = get_recipe("qk_int8_pv_fp8").replace(granularity="per_thread", block_q=64,
                                                  block_k=128)
    tiny = [x.clone() for x in (q, k, v)]
    for x in tiny:  # scales below 2^-90 in some tiles (bf16 keeps them), and tiny quotients
        x[:, :, 64:128] *= 2.0**-100
        x[:, :, 130:140, ::3] *= 2.0**-30
    check(default, q, k, v)
    check(default, *(x[:, :, :20] for x in (q, k, v)), permute_v=True)
    check(blocky, q, k, v)
    check(thread, q, k, v)
    check(default, *tiny)


@pytest.mark.interpreter
def test_balance_factors_equalize_ranges_and_keep_degenerate_channels():
    aq = torch.tensor([[[1.0, 4.0, 0.0, 2.0], [3.0, 1.0, 1.0, 2.0]]])  # B=1, Hq=2
    ak = torch.tensor([[[16.0, 1.0, 5.0, 0.0]]])  # Hkv=1: both q heads share it
    alpha = ref.balance_factors(aq, ak)
    # amax over the group of q heads: [3, 4, 1, 2]
    assert torch.allclose(alpha, torch.tensor([[[(16 / 3) ** 0.5, 0.5, 5**0.5, 1.0]]]))


@pytest.mark.interpreter
@pytest.mark.parametrize("role", ["q", "k"])
def test_balance_factors_stay_finite_where_the_ratio_overflows(role):
    """Finite maxima whose ratio leaves fp32 (a bf16 Q channel of 1e-38 against K's 1e3; K's of
    1e-40 against Q's 1e6): α within 2**±32, where it was inf or 0 and the quantized Q or K NaN;
    the kernel's codes are the twin's; NaN statistics still give NaN."""
    aq = torch.tensor([[[1e-38, 1e6, 1.0, float("nan")]]])
    ak = torch.tensor([[[1e3, 1e-40, 1.0, 1.0]]])
    alpha = ref.balance_factors(aq, ak)
    assert alpha[0, 0, :3].tolist() == [ref.ALPHA_MAX, ref.ALPHA_MIN, 1.0]
    assert alpha[0, 0, 3].isnan()
    x = torch.randn(1, 1, 8, 4, generator=torch.Generator().manual_seed(0))
    kw = dict(granularity="per_token", block=1, balance=(aq[..., :3], ak[..., :3]), role=role)
    x = x[..., :3]
    v_ref, s_ref = ref.quantize_int8(x, **kw)
    v_k, s_k = kq().quantize_int8(x, **kw)
    assert torch.isfinite(s_ref).all() and torch.equal(v_k, v_ref) and torch.equal(s_k, s_ref)


def test_a_bf16_channel_whose_ratio_overflows_is_not_nan():
    """Q nearly dead in one channel (1e-38, bf16) against K of 1e3 there: every 8-bit recipe
    gave NaN everywhere (α = inf); now as close to float64 as on ordinary inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 128, generator=g) for _ in range(3))
    q[..., 0] *= 1e-38
    k[..., 0] *= 1e3
    q, k, v = (x.bfloat16() for x in (q, k, v))
    want = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 128**0.5, -1) @ v.double()
    for recipe in ("qk_int8_pv_fp16", "qk_int8_pv_fp8"):
        assert lowbit_attn.errors(lowbit_attn.attention(q, k, v, recipe=recipe), want).cosine > 0.999


@pytest.mark.interpreter
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 70),
    d=st.sampled_from([16, 24, 40, 64]),
    granularity=st.sampled_from(["per_block", "per_token", "per_thread"]),
    role=st.sampled_from(["q", "k"]),
    scale_exp=st.integers(-8, 8),
    seed=st.integers(0, 2**16),
)
def test_int8_twins_agree_on_random_shapes_and_ranges(n, d, granularity, role, scale_exp, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, n, d, generator=g) * (2.0**scale_exp)
    block = 128 if (granularity, role) == ("per_thread", "k") else 32
    kw = dict(granularity=granularity, block=block, role=role)
    v_ref, s_ref = ref.quantize_int8(x, **kw)
    v_k, s_k = kq().quantize_int8(x, **kw)
    assert torch.equal(v_k, v_ref) and torch.equal(s_k, s_ref)
    assert int(v_ref.abs().max()) <= 127


@triton.jit
def _divided_kernel(X, S, O, RESIDUAL: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    rows, cols = tl.arange(0, N)[:, None], tl.arange(0, D)[None, :]
    x = tl.load(X + rows * D + cols)
    tl.store(O + rows * D + cols, divided(x, tl.load(S + tl.arange(0, N))[:, None], RESIDUAL))


@pytest.mark.interpreter
@pytest.mark.parametrize("outside", [None, 2.0**-100, 2.0**100], ids=["in-range", "tiny", "huge"])
def test_a_quotient_from_the_reciprocal_and_its_residual_is_the_division_s(outside):
    """``quant.tile.divided(RESIDUAL=True)`` gives ``x / s`` correctly rounded, bit for bit with
    PyTorch's division from 2^-11 on (every INT8 and E4M3 code's boundary; below, the same
    sign and code): quotients a few ulps from a half (an INT8 code's tie) and exactly on it,
    scales whose significand is all ones or a power of two over 2^±80, ±0, tiny quotients, a NaN
    scale; and a tile holding a scale outside ``[2^-90, 2^90]`` (``outside``), which divides."""
    g = torch.Generator().manual_seed(1)
    n, d = 32, 64
    scale = ((1 + torch.randint(0, 2**23, (n,), generator=g) / 2**23)
             * torch.exp2(torch.randint(-80, 81, (n,), generator=g).float())).float()
    scale[:4] = (2 - 2.0**-23) * torch.exp2(torch.randint(-80, 81, (4,), generator=g).float())
    scale[4:8] = torch.exp2(torch.randint(-80, 81, (4,), generator=g).float())
    half = torch.floor(torch.rand(n, d, generator=g, dtype=torch.float64) * 896 - 448) + 0.5
    ulps = torch.randint(-3, 4, (n, d), generator=g) * 2.0**-23 * half.abs().clamp(min=1)
    quotient = torch.where(torch.rand(n, d, generator=g) < 0.25, half, half + ulps)
    quotient[:, :8] *= torch.exp2(-torch.randint(10, 40, (n, 8), generator=g).double())
    x = (quotient * scale.double()[:, None]).float()
    x[:, 8], x[:, 9] = 0.0, -0.0
    scale[30] = float("nan")
    if outside is not None:
        scale[31] = outside
    out = torch.empty_like(x)
    _divided_kernel[(1,)](x, scale, out, True, n, d)
    want = x / scale[:, None]
    exact = (want.abs() >= 2.0**-11) | want.isnan() | (outside is not None)
    assert torch.equal(_bits(out[exact]), _bits(want[exact]))
    # below 2^-11 the residual may underflow: the same sign, below E4M3's first tie (code ±0)
    assert torch.equal(out[~exact].signbit(), want[~exact].signbit())
    assert bool((out[~exact].abs() < 2.0**-10).all())
    assert outside is not None or int((~exact).sum()) > n  # the case is there
