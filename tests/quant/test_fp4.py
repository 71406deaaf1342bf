"""FP4 quantizers (NVFP4, MXFP4): the Triton kernels against their PyTorch twins, bit for bit, and
the numerics' edges (E2M1 grid, ties, saturation, packing, scale edge cases, zero / tiny / NaN groups).

Tests parametrised over ``impl`` run the reference everywhere and the kernel under the interpreter.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowbit_attn.quant import fp4_naive as ref

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
IMPLS = [
    pytest.param("reference", id="reference"),
    pytest.param("triton", id="triton", marks=pytest.mark.interpreter),
]
FORMATS = ["nvfp4", "mxfp4"]
GROUP = {"nvfp4": 16, "mxfp4": 32}


def impl_module(name: str):
    if name == "reference":
        return ref
    from lowbit_attn.quant import fp4

    return fp4


def quantize(impl: str, fmt: str, x: torch.Tensor, **kw):
    mod = impl_module(impl)
    return mod.quantize_nvfp4(x, **kw) if fmt == "nvfp4" else mod.quantize_mxfp4(x)


def dequantize(fmt: str, q) -> torch.Tensor:
    return ref.dequantize_nvfp4(*q) if fmt == "nvfp4" else ref.dequantize_mxfp4(*q)


def scale_bits(fmt: str, q) -> torch.Tensor:
    return q[1].view(torch.uint8) if fmt == "nvfp4" else q[1]


def group_scale(fmt: str, q) -> torch.Tensor:
    """The fp32 factor ``s·g`` or ``2^e`` of each group."""
    if fmt == "nvfp4":
        return q[1].float() * q[2]
    return ref.e8m0_value(q[1])


def unit_scale_row(fmt: str, values) -> torch.Tensor:
    """One group holding ``values`` then a 6 (so that the group's scale is exactly 1), zeros after."""
    n = GROUP[fmt]
    row = torch.zeros(n)
    row[: len(values)] = torch.tensor(values, dtype=torch.float32)
    row[-1] = 6.0
    return row.view(1, n)


def unit_kw(fmt: str) -> dict:
    # g = 1 and amax 6 make the NVFP4 group scale (6/6)/1 = 1 exactly; MXFP4: floor(log2 6) - 2 = 0
    return {"global_scale": torch.tensor(1.0)} if fmt == "nvfp4" else {}


@pytest.fixture
def unchecked_global_scale(monkeypatch):
    """Both twins' ``quantize_nvfp4`` take any valid ``global_scale`` whatever x holds: the group
    scale's saturation, which a caller's scale checked against x can no longer reach."""
    from lowbit_attn.quant import fp4

    def scale(x, g):
        return ref.nvfp4_global_scale(x) if g is None else ref.nvfp4_tensor_scale(g, x.device)

    for mod in (ref, fp4):
        monkeypatch.setattr(mod, "nvfp4_quant_scale", scale)


def assert_same_bits(a, b, fmt: str) -> None:
    assert torch.equal(a[0], b[0]), "packed values differ"
    assert torch.equal(scale_bits(fmt, a), scale_bits(fmt, b)), "scales differ"
    if fmt == "nvfp4":
        assert torch.equal(a[2], b[2]), "global scales differ"


# --- E2M1 codes ---------------------------------------------------------------------------------


def test_e2m1_grid_round_trips_and_codes():
    vals = torch.tensor(GRID + [-v for v in GRID[1:]])
    codes = ref.e2m1_code(vals)
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert torch.equal(ref.e2m1_round(vals), vals)
    assert torch.equal(ref.e2m1_value(torch.arange(16)), ref.E2M1_VALUES)


def test_e2m1_ties_saturation_and_specials():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert ref.e2m1_round(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert ref.e2m1_round(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    near = torch.tensor([0.2500001, 0.7499999, 4.9999995, 5.0000005, 5.9999, 2.4999998])
    assert ref.e2m1_round(near).tolist() == [0.5, 0.5, 4.0, 6.0, 6.0, 2.0]
    big = torch.tensor([6.0, 7.0, 1e30, float("inf"), -7.0, float("-inf")])
    assert ref.e2m1_code(big).tolist() == [7, 7, 7, 7, 15, 15]
    # NaN → code 0 (the group's scale carries it); negative inputs keep their sign bit
    assert ref.e2m1_code(torch.tensor([float("nan"), -0.1, -0.0])).tolist() == [0, 8, 0]


def nearest_even_e2m1(x: float) -> int:
    """The E2M1 code of ``x`` by the definition of ``cvt.rn.satfinite.e2m1x2.f32`` (PTX): the
    nearest grid value in exact arithmetic, a tie to the even code (even mantissa), saturated to
    ±6 (Inf included); written apart from the twin's arithmetic."""
    from fractions import Fraction

    a = Fraction(min(abs(x), 6.0)) if x == x and abs(x) != float("inf") else Fraction(6)
    dist = [(abs(a - Fraction(v)), code % 2, code) for code, v in enumerate(GRID)]
    code = min(dist)[2]
    return code | 8 if x < 0 else code


def test_e2m1_twin_is_the_hardware_conversion_on_every_boundary():
    """Every midpoint between neighbouring grid values, one ulp either side, and the saturation,
    both signs: the twin's ``e2m1_code`` (the codes the emulation and the quantizers compute) is
    the round-to-nearest-even, saturating conversion the native kernels get from the hardware
    (``quant.fp4.e2m1_pack``)."""
    points = []
    for lo, hi in zip(GRID, GRID[1:]):
        mid = torch.tensor((lo + hi) / 2, dtype=torch.float32)
        points += [mid, torch.nextafter(mid, torch.tensor(-1.0)), torch.nextafter(mid, torch.tensor(7.0))]
    six = torch.tensor(6.0)
    points += [six, torch.nextafter(six, torch.tensor(7.0)), torch.tensor(1e38), torch.tensor(float("inf")),
               torch.tensor(1e-45), torch.tensor(0.0)]
    x = torch.stack(points).float()
    x = torch.cat([x, -x[x > 0]])
    want = [nearest_even_e2m1(float(v)) for v in x]
    assert ref.e2m1_code(x).tolist() == want


def test_pack_unpack_low_nibble_first():
    codes = torch.tensor([[2, 15, 0, 7, 9, 1]], dtype=torch.uint8)
    packed = ref.pack_fp4(codes)
    assert packed.tolist() == [[0xF2, 0x70, 0x19]]
    assert torch.equal(ref.unpack_fp4(packed), codes)


# --- both formats, both implementations --------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_grid_values_round_trip_exactly(impl, fmt):
    vals = GRID + [-v for v in GRID[1:]]
    x = unit_scale_row(fmt, vals)
    q = quantize(impl, fmt, x, **unit_kw(fmt))
    assert scale_bits(fmt, q).tolist() == [[0x38 if fmt == "nvfp4" else 127]]  # 1.0 in E4M3 / E8M0
    assert torch.equal(dequantize(fmt, q), x)
    if fmt == "mxfp4":  # powers of two scale the grid exactly
        q = quantize(impl, fmt, x * 2.0**-20)
        assert q[1].item() == 127 - 20 and torch.equal(dequantize(fmt, q), x * 2.0**-20)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even_and_saturate(impl, fmt, unchecked_global_scale):
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0]
    x = unit_scale_row(fmt, vals)
    got = dequantize(fmt, quantize(impl, fmt, x, **unit_kw(fmt)))
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert got[0, : len(vals)].tolist() == expected
    # saturation: MXFP4 maps amax 7.5 to 2^(2-2) = 1, so 7.5 → 6; NVFP4 with g = 1 and amax 5376
    # wants a scale of 896 > 448, saturates it to 448, and 5376/448 = 12 → 6
    big = 7.5 if fmt == "mxfp4" else 5376.0
    x = torch.zeros(1, GROUP[fmt])
    x[0, 0], x[0, 1] = big, -big
    q = quantize(impl, fmt, x, **unit_kw(fmt))
    assert scale_bits(fmt, q).item() == (0x7E if fmt == "nvfp4" else 127)
    assert ref.unpack_fp4(q[0])[0, :2].tolist() == [7, 15]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_order(impl, fmt):
    x = unit_scale_row(fmt, [1.0, -6.0, 0.5, 3.0])
    packed = quantize(impl, fmt, x, **unit_kw(fmt))[0]
    assert packed.shape == (1, GROUP[fmt] // 2)
    assert packed[0, :2].tolist() == [0xF2, 0x51]  # (1 | -6 << 4), (0.5 | 3 << 4)
    assert packed[0, -1].item() == 0x70  # 0 then the 6


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "amax, code",
    [
        pytest.param(6.0, 0x38, id="one"),
        pytest.param(6.0 * 1.0625, 0x38, id="tie-down-to-even-1.0"),
        pytest.param(6.0 * 1.1875, 0x3A, id="tie-up-to-even-1.25"),
        pytest.param(6.0 * 2.0**-9, 0x01, id="smallest-subnormal"),
        pytest.param(6.0 * 3 * 2.0**-9, 0x03, id="subnormal-3"),
        pytest.param(6.0 * 2.0**-6, 0x08, id="smallest-normal"),
        pytest.param(6.0 * 448, 0x7E, id="max"),
        pytest.param(6.0 * 470, 0x7E, id="above-max-saturates"),
        pytest.param(6.0 * 2.0**-11, 0x01, id="tiny-raised-to-2^-9"),
        pytest.param(1e-30, 0x01, id="very-tiny-raised-to-2^-9"),
    ],
)
def test_nvfp4_e4m3_scale_edges(impl, amax, code, unchecked_global_scale):
    x = torch.zeros(2, 16)
    x[0, 3] = amax
    x[1, 5] = -amax
    q = quantize(impl, "nvfp4", x, global_scale=torch.tensor(1.0))
    assert q[1].view(torch.uint8).tolist() == [[code], [code]]
    x_hat = dequantize("nvfp4", q)
    s = q[1].float()
    # the amax element is recovered to within the E2M1 step at its scaled value (saturation aside)
    assert torch.all((x_hat - x).abs() <= torch.maximum(s, x.abs() - 6 * s))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_groups(impl, fmt):
    n = GROUP[fmt]
    x = torch.zeros(2, 3 * n)
    x[1, n: 2 * n] = torch.linspace(-2, 3, n)
    q = quantize(impl, fmt, x)
    bits = scale_bits(fmt, q)
    assert bits[0].tolist() == [0, 0, 0]  # NVFP4: s = 0; MXFP4: code 0 = 2^-127
    assert bits[1, 0].item() == 0 and bits[1, 2].item() == 0 and bits[1, 1].item() != 0
    codes = ref.unpack_fp4(q[0])
    assert torch.all(codes[0] == 0) and torch.all(codes[1, :n] == 0) and torch.all(codes[1, 2 * n:] == 0)
    assert torch.equal(dequantize(fmt, q)[0], x[0])
    if fmt == "nvfp4":
        q = quantize(impl, fmt, torch.zeros(4, 32))
        assert q[2].item() == 1.0 and torch.all(q[1].view(torch.uint8) == 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_denormal_range_values(impl, fmt):
    g = torch.Generator().manual_seed(3)
    n = GROUP[fmt]
    # fp32 subnormals: a whole tensor of them, and a group of them beside normal values
    tiny = torch.randn(2, 2 * n, generator=g) * 1e-39
    mixed = torch.randn(2, 2 * n, generator=g)
    mixed[0, :n] = tiny[0, :n]
    for x in (tiny, mixed):
        q = quantize(impl, fmt, x)
        assert_same_bits(q, quantize("reference", fmt, x), fmt)
        x_hat = dequantize(fmt, q)
        assert torch.isfinite(x_hat).all()
        assert_error_bound(x, q, fmt)
    q = quantize(impl, fmt, tiny)
    if fmt == "mxfp4":
        assert torch.all(q[1] == 0)  # floor(log2) - 2 below -127 clamps to 2^-127
    else:
        assert q[2].item() == 2.0**-126  # the tensor scale stays a normal number
        assert torch.all(q[1].view(torch.uint8) != 0)  # no non-zero group gets scale 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_marks_its_group_only(impl, fmt, bad):
    g = torch.Generator().manual_seed(4)
    n = GROUP[fmt]
    x = torch.randn(2, 3 * n, generator=g)
    x[1, n + 5] = bad
    q = quantize(impl, fmt, x)
    assert scale_bits(fmt, q)[1, 1].item() == (0x7F if fmt == "nvfp4" else 255)
    x_hat = dequantize(fmt, q)
    assert torch.isnan(x_hat[1, n: 2 * n]).all()  # the whole group: never hidden
    x_hat[1, n: 2 * n] = 0.0
    assert torch.isfinite(x_hat).all()
    # every other group is quantized as if the bad element were 0 (the tensor scale ignores it)
    clean = x.clone()
    clean[1, n + 5] = 0.0
    qc = quantize(impl, fmt, clean)
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 1] = False
    assert torch.equal(scale_bits(fmt, q)[keep], scale_bits(fmt, qc)[keep])
    codes, codes_clean = ref.unpack_fp4(q[0]).view(2, 3, n), ref.unpack_fp4(qc[0]).view(2, 3, n)
    assert torch.equal(codes[keep], codes_clean[keep])


# --- kernel against twin ------------------------------------------------------------------------


def awkward(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """N(0, 1)·3 with a per-channel offset, plus hand-placed zeros, ties, tiny and huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + torch.randn(shape[-1], generator=g)
    flat = x.view(-1)
    flat[:16] = 0.0  # a zero NVFP4 group
    flat[16:20] = torch.tensor([0.25, 2.5, -5.0, 1e-39])
    flat[-1] = 1e4
    return x.to(dtype)


BIT_CASES = [
    pytest.param("nvfp4", (3, 5, 48), torch.float32, id="nvfp4-3x5x48"),
    pytest.param("nvfp4", (1, 7, 128), torch.float16, id="nvfp4-1x7x128-fp16"),
    pytest.param("nvfp4", (2, 64), torch.bfloat16, id="nvfp4-2x64-bf16"),
    pytest.param("nvfp4", (2, 3, 11, 80), torch.float32, id="nvfp4-2x3x11x80"),
    pytest.param("mxfp4", (3, 5, 96), torch.float32, id="mxfp4-3x5x96"),
    pytest.param("mxfp4", (1, 7, 128), torch.float16, id="mxfp4-1x7x128-fp16"),
    pytest.param("mxfp4", (2, 64), torch.bfloat16, id="mxfp4-2x64-bf16"),
    pytest.param("mxfp4", (2, 3, 11, 160), torch.float32, id="mxfp4-2x3x11x160"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt, shape, dtype", BIT_CASES)
def test_kernel_matches_twin_bit_for_bit(fmt, shape, dtype):
    x = awkward(shape, seed=len(shape) + shape[-1], dtype=dtype)
    q_ref = quantize("reference", fmt, x)
    q_k = quantize("triton", fmt, x)
    k = shape[-1]
    assert q_k[0].shape == (*shape[:-1], k // 2) and q_k[0].dtype == torch.uint8
    assert q_k[1].shape == (*shape[:-1], k // GROUP[fmt])
    assert q_k[1].dtype == (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)
    assert_same_bits(q_k, q_ref, fmt)
    # a non-contiguous input (a transposed view) gives the same bits as its contiguous copy
    xt = x.transpose(0, -2) if x.dim() > 2 else x
    assert_same_bits(quantize("triton", fmt, xt), quantize("reference", fmt, xt.contiguous()), fmt)


# --- accuracy -----------------------------------------------------------------------------------


def half_step(a: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid step around ``|y|`` (0.25 below 2, 0.5 below 4, 1 above)."""
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


def assert_error_bound(x: torch.Tensor, q, fmt: str) -> None:
    """``|x - x̂| ≤ (half E2M1 step + saturation excess)·scale`` per element; for NVFP4 the
    saturation excess comes only from rounding the E4M3 scale down (at most 2^-4 relative for a
    normal scale); for MXFP4 from the power-of-two scale (amax/2^e in [4, 8))."""
    n = GROUP[fmt]
    xg = x.float().reshape(*x.shape[:-1], -1, n)
    sg = group_scale(fmt, q).unsqueeze(-1)
    x_hat = dequantize(fmt, q).reshape(xg.shape)
    a = xg.abs() / sg
    a = torch.where(sg == 0, torch.zeros_like(a), a)
    bound = (half_step(a) + torch.clamp(a - 6, min=0)) * sg * (1 + 2**-20)
    assert torch.all((x_hat - xg).abs() <= bound)
    amax_scaled = a.amax(dim=-1)
    if fmt == "nvfp4":
        normal = q[1].float() >= 2.0**-6
        assert torch.all(amax_scaled[normal] <= 6 * (1 + 2**-4) * (1 + 2**-20))
    else:
        live = (q[1] > 0) & (xg.abs().amax(dim=-1) > 0)
        assert torch.all((amax_scaled[live] >= 4) & (amax_scaled[live] < 8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_error_bound(fmt):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(-1)
    assert_error_bound(x, quantize("reference", fmt, x), fmt)


def relative_error(x: torch.Tensor, fmt: str) -> float:
    x_hat = dequantize(fmt, quantize("reference", fmt, x))
    return float((x - x_hat).norm() / x.norm())


def test_nvfp4_more_accurate_than_mxfp4_on_gaussian_data():
    # Measured (seed 0, 64×4096 N(0, 1)): NVFP4 relative L2 error 0.0953, MXFP4 0.1147.
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    nv, mx = relative_error(x, "nvfp4"), relative_error(x, "mxfp4")
    assert 0.090 < nv < 0.100 and 0.110 < mx < 0.120
    assert nv < 0.85 * mx


@pytest.mark.interpreter
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fmt=st.sampled_from(FORMATS),
    rows=st.integers(1, 5),
    groups=st.integers(1, 4),
    log_scale=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.sampled_from([0.0, -0.0, 0.25, 5.0, 1e-40, 1e30]), max_size=4),
)
def test_property_kernel_equals_twin_within_bound(fmt, rows, groups, log_scale, seed, specials):
    x = torch.randn(rows, groups * GROUP[fmt], generator=torch.Generator().manual_seed(seed))
    x = x * 2.0**log_scale
    x.view(-1)[: len(specials)] = torch.tensor(specials, dtype=torch.float32)
    q_ref = quantize("reference", fmt, x)
    assert_same_bits(quantize("triton", fmt, x), q_ref, fmt)
    assert_error_bound(x, q_ref, fmt)


def test_public_quantizers_round_trip():
    import lowbit_attn

    x = torch.randn(4, 64)
    packed, scales, g = lowbit_attn.fp4.quantize_nvfp4(x)
    assert_same_bits((packed, scales, g), ref.quantize_nvfp4(x), "nvfp4")
    err = lowbit_attn.errors(lowbit_attn.fp4.dequantize_nvfp4(packed, scales, g), x)
    assert err.cosine > 0.99
    mx = lowbit_attn.fp4.quantize_mxfp4(x)
    assert lowbit_attn.errors(lowbit_attn.fp4.dequantize_mxfp4(*mx), x).cosine > 0.98


# --- bad and edge inputs of the public functions ------------------------------------------------


@pytest.fixture
def public(request, monkeypatch):
    """``lowbit_attn.fp4`` routed to the back end ``impl`` names (the kernel interpreted on CPU)."""
    import lowbit_attn.fp4

    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", request.getfixturevalue("impl"))
    return lowbit_attn.fp4


def public_quantize(fp4, fmt: str, x, **kw):
    return fp4.quantize_nvfp4(x, **kw) if fmt == "nvfp4" else fp4.quantize_mxfp4(x)


BAD_GLOBAL = {
    "zero": 0.0, "minus-zero": -0.0, "negative": -1.0, "subnormal": 1e-40, "half-min": 2.0**-127,
    "nan": float("nan"), "inf": float("inf"), "over-max": 2e35, "int-past-fp64": 10**400,
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("g", BAD_GLOBAL.values(), ids=BAD_GLOBAL.keys())
def test_nvfp4_global_scale_out_of_range_is_refused(impl, public, g):
    # before: 0 or a subnormal scale dequantized everything to zeros, NaN poisoned every group
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(6))
    gs = [g] if isinstance(g, int) else [g, torch.tensor(g), torch.tensor(g, dtype=torch.float64)]
    for value in gs:
        with pytest.raises(ValueError, match=r"global_scale must be a positive normal fp32 number"):
            public.quantize_nvfp4(x, global_scale=value)
        packed, scales, _ = public.quantize_nvfp4(x)
        with pytest.raises(ValueError, match=r"global_scale must be .* at most FLT_MAX/2688"):
            public.dequantize_nvfp4(packed, scales, value)


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_global_scale_range_ends_are_accepted(impl, public):
    # the default scale of a tensor holding FLT_MAX is the top of the range, and round-trips
    x = torch.zeros(1, 16)
    x[0, 0] = torch.finfo(torch.float32).max
    q = public.quantize_nvfp4(x)
    assert q[2].item() == ref.NVFP4_GLOBAL_MAX
    assert torch.equal(public.dequantize_nvfp4(*q), x)  # 6·448·g is exactly FLT_MAX: no Inf
    tiny = torch.full((1, 16), 1e-39)
    q = public.quantize_nvfp4(tiny, global_scale=2.0**-126)
    assert_same_bits(q, public.quantize_nvfp4(tiny), "nvfp4")


def fp32_below(value: float) -> float:
    """The largest fp32 number at most ``value``."""
    t = torch.tensor(value, dtype=torch.float64).float()
    return (torch.nextafter(t, t.new_tensor(0.0)) if t.item() > value else t).item()


def fp32_next(value: float, toward: float) -> float:
    t = torch.tensor(value, dtype=torch.float32)
    return torch.nextafter(t, t.new_tensor(toward)).item()


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_global_scale_must_fit_x(impl, public):
    # before: a scale far below amax/2688 saturated every group (1e-37 dequantized randn to ~1e-34),
    # one far above it rounded every value to zero (1e30): relative error 1.0, silently
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10))
    amax = x.abs().max().item()
    lo = public.quantize_nvfp4(x)[2].item()  # the default amax/2688
    hi = fp32_below(lo * 448 / 2.0**-9)
    for g in (1e-37, lo / 2, fp32_next(lo, 0.0), fp32_next(hi, float("inf")), 2 * hi, 1e30):
        want = r"global_scale must be from .* for this x.* got " + re.escape(
            f"{torch.tensor(g).float().item():.9g} in fp32")
        with pytest.raises(ValueError, match=want):
            public.quantize_nvfp4(x, global_scale=g)
    # the ends: the default itself, and the scale that puts the largest group at E4M3's 2^-9
    assert_same_bits(public.quantize_nvfp4(x, global_scale=lo), public.quantize_nvfp4(x), "nvfp4")
    q = public.quantize_nvfp4(x, global_scale=hi)
    assert q[1].view(torch.uint8).max().item() == 1  # 2^-9, the smallest step
    assert public.dequantize_nvfp4(*q).abs().max().item() == pytest.approx(amax, rel=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_global_scale_check_keeps_nan_and_ignores_non_finite(impl, public):
    # the range comes from the finite elements; a NaN or Inf still marks its group as NaN
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(11))
    g = public.quantize_nvfp4(x)[2].item() * 4
    for bad in (float("nan"), float("inf"), 1e38):
        y = x.clone()
        y[1, 20] = bad if bad != 1e38 else float("-inf")
        x_hat = public.dequantize_nvfp4(*public.quantize_nvfp4(y, global_scale=g))
        assert torch.isnan(x_hat[1, 16:]).all() and torch.isfinite(x_hat[:, :16]).all()
        assert torch.isfinite(x_hat[0]).all()
    # no finite non-zero element: any scale of the valid range, and NaN stays NaN
    for y in (torch.zeros(2, 16), torch.full((2, 16), float("nan"))):
        for g in (2.0**-126, 1.0, 1e30):
            x_hat = public.dequantize_nvfp4(*public.quantize_nvfp4(y, global_scale=g))
            assert torch.equal(x_hat, y) if not y.isnan().any() else x_hat.isnan().all()


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_global_scale_as_a_number(impl, public):
    # before: a Python float raised AttributeError ('float' object has no attribute 'float')
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(7))
    want = public.quantize_nvfp4(x, global_scale=torch.tensor(0.25))
    for g in (0.25, np.float32(0.25), np.float64(0.25), torch.tensor([0.25], dtype=torch.float64)):
        got = public.quantize_nvfp4(x, global_scale=g)
        assert_same_bits(got, want, "nvfp4")
        assert got[2].shape == () and got[2].dtype == torch.float32
        assert torch.equal(public.dequantize_nvfp4(got[0], got[1], g), dequantize("nvfp4", want))
    assert_same_bits(public.quantize_nvfp4(x, global_scale=1),
                     public.quantize_nvfp4(x, global_scale=torch.tensor(1.0)), "nvfp4")
    for bad in (True, "0.25", [0.25], torch.tensor(True)):
        with pytest.raises(TypeError, match="global_scale must be"):
            public.quantize_nvfp4(x, global_scale=bad)
    with pytest.raises(ValueError, match=r"global_scale must be one number .* got shape \(2,\)"):
        public.quantize_nvfp4(x, global_scale=torch.ones(2))


EMPTY_SHAPES = [(0, 64), (3, 0), (0,), (2, 0, 64)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_empty_input_gives_empty_outputs(impl, public, fmt, shape):
    # before: NVFP4 raised RuntimeError (amax of no elements); the kernel's MXFP4 too for K = 0
    x = torch.randn(shape)
    q = public_quantize(public, fmt, x)
    k = shape[-1]
    assert q[0].shape == (*shape[:-1], k // 2) and q[0].dtype == torch.uint8
    assert q[1].shape == (*shape[:-1], k // GROUP[fmt])
    assert q[1].dtype == (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)
    if fmt == "nvfp4":
        assert q[2].shape == () and q[2].item() == 1.0  # as for an all-zero tensor
    x_hat = public.dequantize_nvfp4(*q) if fmt == "nvfp4" else public.dequantize_mxfp4(*q)
    assert x_hat.shape == shape


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_x_is_refused_naming_it(impl, public, fmt):
    n = GROUP[fmt]
    cases = [
        (torch.tensor(1.0), ValueError, r"x must have at least one dimension .* 0-dim"),
        (torch.zeros(2, n + 8), ValueError, "x's last dimension must be a multiple"),
        (torch.zeros(2, n, dtype=torch.int32), TypeError, "x must be a floating-point"),
        (torch.zeros(2, n, dtype=torch.bool), TypeError, "x must be a floating-point"),
        (torch.zeros(2, n, dtype=torch.complex64), TypeError, "x must be a floating-point"),
        ([0.0] * n, TypeError, "x must be a floating-point tensor, got list"),
    ]
    for x, err, msg in cases:
        with pytest.raises(err, match=msg):
            public_quantize(public, fmt, x)
    # a non-contiguous view is quantized as its contiguous copy is
    xt = torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(8)).t()
    want = public_quantize(public, fmt, xt.contiguous())
    assert_same_bits(public_quantize(public, fmt, xt), want, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_refuses_mismatched_operands(fmt):
    # before: scales of a wrong but broadcastable shape were broadcast silently
    import lowbit_attn.fp4 as fp4

    n = GROUP[fmt]
    x = torch.randn(2, 3, 4 * n, generator=torch.Generator().manual_seed(9))
    q = public_quantize(fp4, fmt, x)
    packed, scales = q[0], q[1]

    def deq(p, s, *g):
        if fmt == "nvfp4":
            return fp4.dequantize_nvfp4(p, s, *(g or q[2:]))
        return fp4.dequantize_mxfp4(p, s)

    want = r"scales must have shape \(2, 3, 4\), one per group of %d values" % n
    for bad in (scales[..., :1], scales[:1], scales[0], scales[..., None]):
        with pytest.raises(ValueError, match=want):
            deq(packed, bad)
    with pytest.raises(ValueError, match=f"packed's last dimension must be a multiple of {n // 2}"):
        deq(packed[..., :-1], scales)
    with pytest.raises(ValueError, match="packed's last dimension"):
        deq(torch.tensor(0, dtype=torch.uint8), scales)
    with pytest.raises(TypeError, match=r"packed must be a torch.uint8 tensor, got torch.int8"):
        deq(packed.view(torch.int8), scales)
    other = torch.uint8 if fmt == "nvfp4" else torch.float8_e4m3fn
    with pytest.raises(TypeError, match=r"scales must be a torch\.\w+ tensor, got %s" % other):
        deq(packed, scales.view(other))
    if fmt == "nvfp4":
        with pytest.raises(ValueError, match=r"global_scale must be one number .* \(2, 3, 1\)"):
            deq(packed, scales, torch.ones(2, 3, 1))
    assert torch.equal(deq(packed, scales), dequantize(fmt, q))  # the right operands still work
