"""Shared test utilities."""

from __future__ import annotations

import torch


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
