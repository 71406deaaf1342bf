"""The attention forwards (dense and packed) as ``torch.library`` custom ops with fake
implementations, so ``torch.compile`` traces calls to the public functions without graph breaks and
the ops stay opaque to it (quantization and kernel launches inside)."""

from __future__ import annotations

import dataclasses

import torch

from lowbit_attn.inference import dispatch as forward
from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.operands import Seqs
from lowbit_attn.core.recipes import Recipe


_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe))
_TYPES = {f.name: f.type for f in dataclasses.fields(Recipe)}
# Field annotations are text (``from __future__ import annotations`` in core/recipes.py).
_PARSE = {"bool": {"True": True, "False": False}.__getitem__, "int": int}


def recipe_key(recipe: Recipe) -> str:
    """A :class:`Recipe` as the ops take it: ``name=value`` of each field in field order, joined
    by ``;`` (a plain string argument, so the ops' schemas stay fixed as recipes gain options;
    built with operations torch.compile traces). Unambiguous because a Recipe's fields are
    validated: its name and formats are identifiers, its options Python bools and ints, whose
    text reads back exactly."""
    return ";".join(f"{name}={getattr(recipe, name)}" for name in _FIELDS)


def recipe_from_key(key: str) -> Recipe:
    """The :class:`Recipe` that :func:`recipe_key` wrote; ``ValueError`` for any other text (a
    missing, unknown or repeated field, a value that is not a bool or int literal where one is
    due, or a Recipe's own validation error)."""
    values = dict(item.partition("=")[::2] for item in key.split(";"))
    if tuple(values) != _FIELDS:
        raise ValueError(f"recipe key {key!r} must give {'=…;'.join(_FIELDS)}=… in this order")
    try:
        parsed = {k: _PARSE.get(_TYPES[k], str)(x) for k, x in values.items()}
    except (KeyError, ValueError):
        raise ValueError(f"recipe key {key!r} has a value of the wrong type") from None
    recipe = Recipe(**parsed)
    if recipe_key(recipe) != key:
        raise ValueError(f"recipe key {key!r} is not in the form recipe_key writes")
    return recipe


@torch.library.custom_op("lowbit_attn::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: str, scale: float, is_causal: bool,
    causal_offset: int, nhd: bool, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of validated ``q, k, v`` in layout HND (``nhd`` False) or NHD with the recipe
    :func:`recipe_key` encodes; returns the output in q's shape (contiguous) and the LSE
    ``[B, Hq, Nq]`` (an empty tensor unless ``return_lse``)."""
    qh, kh, vh = (x.transpose(1, 2) if nhd else x for x in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = forward.run(
        qh, kh, vh, out=out.transpose(1, 2) if nhd else out, recipe=recipe_from_key(recipe), scale=scale,
        is_causal=is_causal, causal_offset=causal_offset, return_lse=return_lse,
        backend=backend_for(q.device),
    )
    return out, _lse_or_empty(lse, q)


def _lse_or_empty(lse: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.float32, device=q.device) if lse is None else lse


@attention_fwd.register_fake
def _(q, k, v, recipe, scale, is_causal, causal_offset, nhd, return_lse):
    b, hq, nq = (q.shape[0], q.shape[2], q.shape[1]) if nhd else q.shape[:3]
    lse = q.new_empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), lse  # the op returns a contiguous output


@torch.library.custom_op("lowbit_attn::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, recipe: str, scale: float,
    is_causal: bool, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of validated packed ``[total, H, D]`` sequences; the output in q's shape and
    the LSE ``[Hq, total_q]`` (an empty tensor unless ``return_lse``)."""
    batch = cu_seqlens_q.numel() - 1
    seqs = tuple(Seqs(batch, max(n, 1), cu.to(torch.int32))
                 for cu, n in ((cu_seqlens_q, max_seqlen_q), (cu_seqlens_k, max_seqlen_k)))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = forward.run(
        q, k, v, out=out, recipe=recipe_from_key(recipe), scale=scale, is_causal=is_causal,
        causal_offset=0, return_lse=return_lse, backend=backend_for(q.device), seqs=seqs,
    )
    return out, _lse_or_empty(lse, q)


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, recipe, scale, is_causal,
      return_lse):
    lse = q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), lse


def call(q, k, v, recipe: Recipe, *, scale: float, is_causal: bool, causal_offset: int,
         nhd: bool, return_lse: bool):
    """Run the dense op with a :class:`Recipe`."""
    return attention_fwd(q, k, v, recipe_key(recipe), scale, is_causal, causal_offset, nhd,
                         return_lse)


def call_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, recipe: Recipe, *, scale: float,
                is_causal: bool, return_lse: bool):
    """Run the packed op with a :class:`Recipe`."""
    return attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, recipe_key(recipe), scale,
                                is_causal, return_lse)
