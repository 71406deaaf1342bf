"""The public functions on other projects' test grids (CPU reference path).

FlashAttention's forward and varlen grids (``tests/test_flash_attn.py``: its sequence-length
pairs, random key-padding masks unpadded into ``cu_seqlens``, MHA/GQA/MQA, causal aligned
bottom-right), with its accuracy rule for the exact recipe: the error against a float64 oracle
is at most twice the error of the same computation done by PyTorch at the input precision, plus
twice the input dtype's rounding at the output's magnitude. Quantized recipes get measured budgets.

PyTorch's SDPA semantics for ``lowbit_attn.scaled_dot_product_attention``: causal aligned top-left
when Nq ≠ Nk, ``enable_gqa``, 3-D inputs, masks and dropout falling back to PyTorch (the same
result), zero-length sequences, fully masked rows, zero heads, scales PyTorch accepts.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import lowbit_attn
from helpers import Budget, check_rows
from lowbit_attn.tools import inputs
from lowbit_attn.inference.naive import exact_attention, visible

# FlashAttention's (seqlen_q, seqlen_k) pairs and a spread of its head dims; each pair gets two
# head dims (every dim twice, in fixed shuffled orders) and a head layout and dtype in turn.
SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1023, 1024),
           (1024, 1023), (1, 239), (239, 1), (3, 799)]
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 256]
HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (3, 1)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
GRID = [
    pytest.param(nq, nk, d, kind, dtype, id=f"{nq}x{nk}-d{d}-{kind}-{dtype}")
    for (nq, nk), d, kind, dtype in zip(
        SEQLENS * 2,
        random.Random(14).sample(HEAD_DIMS, 11) + random.Random(15).sample(HEAD_DIMS, 11),
        list(HEADS) * 8, list(DTYPES) * 11,
    )
]
QUANTIZED = ["qk_int8_pv_fp16", "qk_int8_pv_fp8", "qk_fp4_pv_fp4", "qk_mxfp4_pv_mxfp4"]
# Worst case over both grids, causal or not (`channel_bias_k` inputs, 2026-11-24), then the bar:
#                      max|out-ref|/max|V|     1 - cosine          max|lse - ref|
#   qk_int8_pv_fp16    0.0080 → 0.02           9.1e-5 → 3e-4       0.033 → 0.08
#   qk_int8_pv_fp8     0.028  → 0.06           8.0e-4 → 2e-3       0.020 → 0.05
#   qk_fp4_pv_fp4      0.125  → 0.25           0.021  → 0.05       0.24  → 0.5
#   qk_mxfp4_pv_mxfp4  0.22   → 0.45           0.031  → 0.07       0.44  → 0.9
# The worst outputs are varlen sequences with one key or query (1×236, 225×1), the worst LSE the
# longest sequences.
BUDGETS = {
    "qk_int8_pv_fp16": Budget(cos=1 - 3e-4, abs_v=0.02, lse=0.08),
    "qk_int8_pv_fp8": Budget(cos=1 - 2e-3, abs_v=0.06, lse=0.05),
    "qk_fp4_pv_fp4": Budget(cos=1 - 0.05, abs_v=0.25, lse=0.5),
    "qk_mxfp4_pv_mxfp4": Budget(cos=1 - 0.07, abs_v=0.45, lse=0.9),
}


def torch_attention(q, k, v, scale: float, causal_offset):
    """Attention as PyTorch computes it at the inputs' precision (FlashAttention's ``out_pt``):
    scores, softmax and P·V all in q's dtype; rows that see no key give 0. ``[B, H, N, D]``, K/V
    heads already expanded."""
    s = (q * scale) @ k.transpose(-1, -2)
    mask = visible(q.shape[-2], k.shape[-2], causal_offset, q.device)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    p = torch.where(mask.any(-1, keepdim=True), p, torch.zeros((), dtype=p.dtype))
    return p @ v, torch.logsumexp(s.float().masked_fill(~mask, float("-inf")), dim=-1)


def expand(x, hq):
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def fa_rule(out, lse, q, k, v, causal_offset, what: str) -> None:
    """FlashAttention's check of an exact kernel: ``max|out - ref| <= 2·max|out_pt - ref| +
    2·(rounding of the dtype at the output's magnitude)``; the LSE the same way."""
    scale = q.shape[-1] ** -0.5
    ref, ref_lse = exact_attention(q.double(), k.double(), v.double(), scale=scale,
                                   causal_offset=causal_offset)
    pt, pt_lse = torch_attention(q, expand(k, q.shape[1]), expand(v, q.shape[1]), scale,
                                 causal_offset)
    rounding = float((ref.to(q.dtype) + 0.3 - 0.3 - ref.to(q.dtype)).abs().max())
    err, pt_err = (float((x.double() - ref).abs().max()) for x in (out, pt))
    assert err <= 2 * pt_err + 2 * rounding, (
        f"{what}: max error {err:.3g} > 2 × PyTorch's {pt_err:.3g} + 2 × {rounding:.3g}")
    seen = torch.isfinite(ref_lse)
    assert torch.all(torch.isneginf(lse[~seen])) and torch.all(out[~seen] == 0)
    if seen.any():
        lerr = float((lse[seen].double() - ref_lse[seen]).abs().max())
        pt_lerr = float((pt_lse[seen].double() - ref_lse[seen]).abs().max())
        assert lerr <= 2 * pt_lerr + 1e-5, f"{what}: LSE error {lerr:.3g} > 2 × {pt_lerr:.3g}"


def check_quantized(name, out, lse, q, k, v, causal_offset, what: str) -> None:
    ref, ref_lse = exact_attention(q.double(), k.double(), v.double(), scale=q.shape[-1] ** -0.5,
                                   causal_offset=causal_offset)
    check_rows(out, ref, lse, ref_lse, float(v.abs().max()), BUDGETS[name])


def run_recipes(q, k, v, causal_offset, call, what: str) -> None:
    """``call(recipe)`` → (out, lse) in ``[B, H, N, D]``: exact by FlashAttention's rule, the
    quantized recipes within their budgets; FP4 refuses head dims that are not multiples of 32."""
    out, lse = call("exact")
    fa_rule(out, lse, q, k, v, causal_offset, f"{what} exact")
    for name in QUANTIZED:
        if lowbit_attn.get_recipe(name).is_fp4 and q.shape[-1] % 32:
            with pytest.raises(ValueError, match="head dim that is a multiple of 32"):
                call(name)
            continue
        out, lse = call(name)
        check_quantized(name, out, lse, q, k, v, causal_offset, f"{what} {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,d,heads,dtype", GRID)
def test_flash_attn_forward_grid(nq, nk, d, heads, dtype, causal):
    hq, hkv = HEADS[heads]
    q, k, v = inputs.make("channel_bias_k", seed=nq + nk + d, batch=1, heads_q=hq, heads_kv=hkv,
                          n_q=nq, n_k=nk, head_dim=d, dtype=DTYPES[dtype])
    offset = nk - nq if causal else None
    run_recipes(q, k, v, offset, lambda r: lowbit_attn.attention(
        q, k, v, is_causal=causal, recipe=r, return_lse=True), "dense")


def padding_lengths(n: int, batch: int, g: torch.Generator, *, zero: bool) -> torch.Tensor:
    """Lengths from FlashAttention's random key-padding masks (``generate_random_padding_mask``,
    mode "random": each row keeps ``max(1, n - 20) … n`` tokens); ``zero`` empties one row."""
    lens = torch.randint(max(1, n - 20), n + 1, (batch,), generator=g)
    if zero:
        lens[batch // 2] = 0
    return lens


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,d,heads,dtype", GRID)
def test_flash_attn_varlen_grid(nq, nk, d, heads, dtype, causal):
    """Padded ``[B, N, H, D]`` tensors and random key-padding masks, unpadded to packed tensors
    and ``cu_seqlens`` (FlashAttention's ``unpad_input``); each sequence checked on its own."""
    hq, hkv = HEADS[heads]
    batch = 3 if nq * nk <= 512 * 256 else 2
    g = torch.Generator().manual_seed(nq * nk + d)
    q, k, v = inputs.make("channel_bias_k", seed=nq + d, batch=batch, heads_q=hq, heads_kv=hkv,
                          n_q=nq, n_k=nk, head_dim=d, dtype=DTYPES[dtype])
    lens_q = padding_lengths(nq, batch, g, zero=False)
    lens_k = padding_lengths(nk, batch, g, zero=nq > 100 and causal)  # queries without keys
    mask_q = torch.arange(nq)[None] < lens_q[:, None]
    mask_k = torch.arange(nk)[None] < lens_k[:, None]
    q_packed = q.transpose(1, 2)[mask_q]  # [total_q, Hq, D]
    k_packed, v_packed = (x.transpose(1, 2)[mask_k] for x in (k, v))
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.int32), n.cumsum(0).to(torch.int32)])
                  for n in (lens_q, lens_k))

    def call(recipe):
        out, lse = lowbit_attn.attention_varlen(
            q_packed, k_packed, v_packed, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
            is_causal=causal, recipe=recipe, return_lse=True)
        return out, lse

    results = {}
    for b in range(batch):
        (q0, q1), (k0, k1) = cu_q[b : b + 2].tolist(), cu_k[b : b + 2].tolist()
        if q1 == q0:
            continue
        qs = q[b : b + 1, :, : q1 - q0]
        ks, vs = k[b : b + 1, :, : k1 - k0], v[b : b + 1, :, : k1 - k0]
        offset = (k1 - k0) - (q1 - q0) if causal else None

        def one(recipe, q0=q0, q1=q1):
            if recipe not in results:
                results[recipe] = call(recipe)
            out, lse = results[recipe]
            return out[q0:q1].transpose(0, 1)[None], lse[None, :, q0:q1]

        if k1 == k0:  # no key: rows are 0, LSE -inf
            out, lse = one("exact")
            assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
            continue
        run_recipes(qs, ks, vs, offset, one, f"varlen seq {b} ({q1 - q0}×{k1 - k0})")


# --- PyTorch's SDPA semantics for the drop-in ---------------------------------------------------


def sdpa_both(q, k, v, **kwargs):
    """(ours, PyTorch's) for one call from the same RNG state; fallback warnings silenced."""
    torch.manual_seed(0)
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        got = lowbit_attn.scaled_dot_product_attention(q, k, v, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    return got, want


def agrees(got, want, v) -> None:
    """Within the CPU ``auto`` recipe's budget of PyTorch's result (NaN at the same places)."""
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ from PyTorch's"
    every_row = torch.zeros(want.shape[:-1], dtype=torch.float64)
    check_rows(got.nan_to_num(), want.nan_to_num().double(), None, every_row,
               float(v.abs().max()), BUDGETS["qk_int8_pv_fp16"])


def same_as_torch(got, want) -> None:
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def sdpa_inputs(b=1, hq=2, hkv=2, nq=64, nk=64, d=64, dtype=torch.float32, seed=0):
    return inputs.make("channel_bias_k", seed=seed, batch=b, heads_q=hq, heads_kv=hkv, n_q=nq,
                       n_k=nk, head_dim=d, dtype=dtype)


@pytest.mark.parametrize("nq,nk", [(113, 203), (512, 256), (1, 239), (239, 1), (3, 799)],
                         ids=lambda n: str(n))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sdpa_causal_is_top_left(nq, nk, dtype):
    """PyTorch aligns the causal mask top-left (query i sees keys j <= i), not bottom-right."""
    q, k, v = sdpa_inputs(nq=nq, nk=nk, dtype=dtype, seed=nq + nk)
    got, want = sdpa_both(q, k, v, is_causal=True)
    ref, ref_lse = exact_attention(q.double(), k.double(), v.double(), scale=64**-0.5,
                                   causal_offset=0)
    check_rows(got, ref, None, ref_lse, float(v.abs().max()), BUDGETS["qk_int8_pv_fp16"])
    agrees(got, want.float().to(dtype), v)
    bottom_right, _ = exact_attention(q.double(), k.double(), v.double(), scale=64**-0.5,
                                      causal_offset=nk - nq)
    if nq > 1 and nk > 1:  # the two conventions differ by far more than the budget here
        assert float((bottom_right - ref).abs().max()) > 10 * BUDGETS["qk_int8_pv_fp16"].abs_v


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1), (6, 3)], ids=["gqa", "mqa", "gqa-6:3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_enable_gqa(hq, hkv, causal):
    q, k, v = sdpa_inputs(hq=hq, hkv=hkv, nq=70, nk=90, d=40, seed=hq)
    agrees(*sdpa_both(q, k, v, is_causal=causal, enable_gqa=True), v)
    # without enable_gqa PyTorch broadcasts one K/V head and refuses others; so does the drop-in
    if hkv == 1:
        agrees(*sdpa_both(q, k, v, is_causal=causal), v)
        return
    with pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(type(theirs.value)):
            lowbit_attn.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_three_dim_inputs(causal):
    q, k, v = (x[:, 0] for x in sdpa_inputs(b=3, nq=50, nk=80, d=96, seed=3))  # [B, N, D]
    agrees(*sdpa_both(q, k, v, is_causal=causal, scale=0.05), v)


def _masks(nq, nk, b=2, h=2):
    g = torch.Generator().manual_seed(nq * nk)
    keep = torch.rand(nq, nk, generator=g) > 0.3
    return {
        "bool-2d": keep,
        "float-2d": torch.where(keep, 0.0, -2.0) + 0.1 * torch.randn(nq, nk, generator=g),
        "bool-batch-broadcast": (torch.rand(b, 1, nq, nk, generator=g) > 0.5),
        "key-padding": torch.arange(nk) < torch.tensor([nk // 2, nk]).view(b, 1, 1, 1),
        "float-per-head": torch.randn(b, h, nq, nk, generator=g),
    }


@pytest.mark.parametrize("mask", list(_masks(1, 1)))
@pytest.mark.parametrize("dropout_p", [0.0, 0.25], ids=["no-dropout", "dropout"])
def test_sdpa_masks_and_dropout_fall_back_to_pytorch(mask, dropout_p):
    q, k, v = sdpa_inputs(b=2, nq=33, nk=47, d=32)
    got, want = sdpa_both(q, k, v, attn_mask=_masks(33, 47)[mask], dropout_p=dropout_p)
    same_as_torch(got, want)


def test_sdpa_dropout_alone_falls_back_to_pytorch():
    q, k, v = sdpa_inputs(nq=40, nk=40, d=32)
    same_as_torch(*sdpa_both(q, k, v, dropout_p=0.5, is_causal=True))


@pytest.mark.parametrize("nq,nk", [(0, 17), (17, 0), (0, 0)], ids=lambda n: str(n))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_zero_length_sequences(nq, nk, causal):
    q, k, v = sdpa_inputs(nq=nq, nk=nk, d=32)
    same_as_torch(*sdpa_both(q, k, v, is_causal=causal))


@pytest.mark.parametrize("kind", ["bool", "float-inf"])
def test_sdpa_fully_masked_rows(kind):
    """Rows whose mask hides every key: the drop-in returns what PyTorch returns for them."""
    q, k, v = sdpa_inputs(nq=24, nk=30, d=32)
    keep = torch.rand(24, 30, generator=torch.Generator().manual_seed(1)) > 0.2
    keep[::3] = False
    mask = keep if kind == "bool" else torch.where(keep, 0.0, float("-inf"))
    same_as_torch(*sdpa_both(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("change", [
    pytest.param(dict(scale=0.0), id="scale-0"),
    pytest.param(dict(scale=-0.125), id="scale-negative"),
    pytest.param(dict(scale=-0.125, is_causal=True), id="scale-negative-causal"),
    pytest.param(dict(heads=(0, 0)), id="zero-heads"),
    pytest.param(dict(heads=(0, 2), enable_gqa=True), id="zero-query-heads-gqa"),
])
def test_sdpa_returns_where_pytorch_returns(change):
    """A drop-in never raises where PyTorch's function returns."""
    change = dict(change)
    hq, hkv = change.pop("heads", (2, 2))
    q, k, v = sdpa_inputs(hq=max(hq, 2), hkv=max(hkv, 1), nq=20, nk=30, d=32)
    q, k, v = q[:, :hq], k[:, :hkv], v[:, :hkv]
    got, want = sdpa_both(q, k, v, **change)
    if want.numel():
        agrees(got, want, v)
