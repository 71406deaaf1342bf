"""Shared test utilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import lowbit_attn


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0,
                 name: str = "tensor") -> None:
    """Closeness with NaN/Inf checked on their own (same positions) and the worst element reported."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), (
        f"{name}: NaN positions differ ({int(nan_a.sum())} actual vs {int(nan_e.sum())} expected)"
    )
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), f"{name}: Inf positions differ"
    finite = torch.isfinite(e)
    diff = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    bound = atol + rtol * e.abs()
    excess = torch.where(finite, diff - bound, torch.full_like(a, -1.0))
    worst = int(excess.flatten().argmax())
    if excess.flatten()[worst] > 0:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        raise AssertionError(
            f"{name}: |actual - expected| = {float(diff.flatten()[worst]):.3e} > "
            f"{float(bound.flatten()[worst]):.3e} at index {idx} "
            f"(actual {float(a[idx]):.6g}, expected {float(e[idx]):.6g}); "
            f"{int((excess > 0).sum())} of {a.numel()} elements out of tolerance"
        )


def channel_biased(shape_q, shape_kv, *, seed: int = 0, dtype=torch.float32, bias: float = 4.0):
    """q, k, v ~ N(0, 1) with ``k += bias·N(0, 1)`` per (batch, head, channel) (HND)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g)
    k = torch.randn(shape_kv, generator=g)
    k = k + bias * torch.randn(shape_kv[0], shape_kv[1], 1, shape_kv[3], generator=g)
    v = torch.randn(shape_kv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@dataclass(frozen=True)
class Budget:
    """Worst error allowed on rows that see a key: ``max|out - ref| <= abs_v · max|V|`` (an output
    row is a convex combination of V's rows, so this holds however small N, D or the output are);
    cosine over those rows ``>= cos`` where their RMS is at least 2 % of ``max|V|`` (below that the
    output is mostly cancellation and its direction is noise); ``|lse - ref| <= lse``."""

    cos: float
    abs_v: float
    lse: float


def row_errors(out, ref, lse, ref_lse, vmax: float):
    """Errors of the rows that see a key, against the float64 oracle: ``(max|out - ref| / max|V|,
    cosine or None where the rows' RMS is under 2 % of max|V|, max|lse - ref| or None)``; None
    when no row sees a key. Rows that see no key must be exactly 0 with LSE ``-inf``."""
    seen = torch.isfinite(ref_lse)
    assert torch.all(out[~seen] == 0), "a row that sees no key is not 0"
    if lse is not None:
        assert lse.dtype == torch.float32
        assert torch.all(torch.isneginf(lse[~seen])), "a row that sees no key has LSE != -inf"
    if not seen.any():
        return None
    o, r = out[seen].double(), ref[seen].double()
    assert torch.isfinite(o).all(), "non-finite output from finite inputs"
    err = float((o - r).abs().max()) / vmax
    cos = lowbit_attn.errors(o, r).cosine if float(r.pow(2).mean().sqrt()) >= 0.02 * vmax else None
    lerr = None if lse is None else float((lse[seen].double() - ref_lse[seen]).abs().max())
    return err, cos, lerr


def check_rows(out, ref, lse, ref_lse, vmax: float, b: Budget) -> None:
    """``out [..., N, D]`` and ``lse [..., N]`` (or None) within the budget ``b``."""
    errs = row_errors(out, ref, lse, ref_lse, vmax)
    if errs is None:
        return
    err, cos, lerr = errs
    assert err <= b.abs_v, f"max |out - ref| = {err:.3g} · max|V| > {b.abs_v} · max|V|"
    assert cos is None or cos >= b.cos, f"cosine {cos:.6f} < {b.cos}"
    assert lerr is None or lerr <= b.lse, f"max |lse - ref| = {lerr:.3g} > {b.lse}"
