"""Error metrics of an approximation against a reference, computed in float64."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Errors:
    """The error of an approximation against a reference, as :func:`errors` measures it.

    Attributes:
        cosine: cosine similarity of the flattened tensors (1 is exact).
        rel_l1: ``sum|x - ref| / sum|ref|``.
        rmse: root mean square of ``x - ref``.

    Examples:
        >>> import lowbit_attn
        >>> lowbit_attn.Errors(cosine=0.9993, rel_l1=0.037, rmse=0.01).cosine
        0.9993
    """

    cosine: float
    rel_l1: float
    rmse: float

    def as_dict(self) -> dict[str, float]:
        """The three metrics by name.

        Returns:
            ``{"cosine": …, "rel_l1": …, "rmse": …}``.
        """
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
    """Cosine similarity, relative L1 and RMSE of ``x`` against ``ref``, in float64.

    NaN anywhere in ``x`` makes them NaN (never hidden).

    Args:
        x: the approximation, any shape and floating dtype.
        ref: the reference, the same number of elements (typically exact attention in float64).

    Returns:
        An :class:`Errors` of Python floats.

    Raises:
        RuntimeError: ``x`` and ``ref`` hold different numbers of elements.

    Examples:
        >>> import torch, lowbit_attn
        >>> ref = torch.randn(1000, dtype=torch.float64)
        >>> e = lowbit_attn.errors(ref.half(), ref)
        >>> e.cosine > 0.9999, e.rel_l1 < 1e-3
        (True, True)
    """
    return Errors(cosine_similarity(x, ref), relative_l1(x, ref), rmse(x, ref))
