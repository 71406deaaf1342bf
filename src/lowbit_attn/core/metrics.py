"""Error metrics of an approximation against a reference, computed in float64."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Errors:
    cosine: float
    rel_l1: float
    rmse: float

    def as_dict(self) -> dict[str, float]:
        return {"cosine": self.cosine, "rel_l1": self.rel_l1, "rmse": self.rmse}


def cosine_similarity(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine of the angle between the flattened tensors."""
    a, b = x.detach().double().flatten(), ref.detach().double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def relative_l1(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``sum|x - ref| / sum|ref|``."""
    a, b = x.detach().double(), ref.detach().double()
    return float((a - b).abs().sum() / b.abs().sum())


def rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = x.detach().double(), ref.detach().double()
    return float(((a - b) ** 2).mean().sqrt())


def errors(x: torch.Tensor, ref: torch.Tensor) -> Errors:
    """All three metrics; NaN anywhere in ``x`` makes them NaN (never hidden)."""
    return Errors(cosine_similarity(x, ref), relative_l1(x, ref), rmse(x, ref))
