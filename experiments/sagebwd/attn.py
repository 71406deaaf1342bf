"""The attention functions under comparison, selected by name.

Every function takes ``q [B, Hq, N, D]``, ``k, v [B, Hkv, N, D]`` (HND) and returns ``[B, Hq, N, D]``.

* ``exact``               — ``torch.nn.functional.scaled_dot_product_attention`` (the baseline);
* ``exact_lowbit``        — ``lowbit_attn.trainable_attention(recipe="exact")`` (checks the wrapper
                            itself: its loss curve should lie on top of SDPA's);
* ``sagebwd``             — SageBwd INT8: 6 of 7 matmuls in INT8, dP = dO·Vᵀ in 16-bit (the default);
* ``sagebwd_dp_int8``     — the same with dP in INT8 too (``keep_16bit=()``; the paper's ablation);
* ``sagebwd_no_smooth_k`` — SageBwd without K smoothing;
* ``sagebwd_smooth_q``    — SageBwd with Q smoothing added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# name -> keyword arguments of lowbit_attn.trainable_attention (None: PyTorch's SDPA)
VARIANTS: dict[str, dict | None] = {
    "exact": None,
    "exact_lowbit": {"recipe": "exact"},
    "sagebwd": {"recipe": "sagebwd_int8"},
    "sagebwd_dp_int8": {"recipe": "sagebwd_int8", "keep_16bit": ()},
    "sagebwd_no_smooth_k": {"recipe": "sagebwd_int8", "smooth_k": False},
    "sagebwd_smooth_q": {"recipe": "sagebwd_int8", "smooth_q": True},
}


def _sdpa(q, k, v, *, is_causal=False, scale=None):
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def get_attention(name: str):
    """The function ``attend(q, k, v, *, is_causal=False, scale=None)`` named ``name`` (see VARIANTS)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown attention {name!r}; choose from {sorted(VARIANTS)}")
    kwargs = VARIANTS[name]
    if kwargs is None:
        return _sdpa
    import lowbit_attn

    fn = getattr(lowbit_attn, "trainable_attention", None)
    if fn is None:
        raise RuntimeError(
            f"attention {name!r} needs lowbit_attn.trainable_attention, which this lowbit_attn "
            f"({lowbit_attn.__file__}) does not have yet"
        )

    def attend(q, k, v, *, is_causal=False, scale=None):
        return fn(q, k, v, is_causal=is_causal, scale=scale, layout="HND", **kwargs)

    return attend
