"""Hugging Face transformers: an attention implementation that runs lowbit_attn::

    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register()                                   # "lowbit", recipe "auto"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="lowbit")
    lowbit_hf.register("lowbit_fp16pv", recipe="qk_int8_pv_fp16")
    model.set_attn_implementation("lowbit_fp16pv")

Calls the kernels cannot take (a padding or sliding-window mask, attention dropout while training,
gradients, ``softcap``, attention weights asked for) run PyTorch's exact SDPA instead, with one
warning per reason. The masks are built as for ``"sdpa"``, which leaves them out (``None``) when
they are purely causal or all-ones, so those calls reach the kernels with ``is_causal``.
"""

from __future__ import annotations

import torch

from ..api import TORCH_SDPA, warn_fallback, sdpa_or_fallback
from ..recipes import Recipe, resolve

# Arguments some models pass that the kernels have no use for; when set, the model's call goes to
# transformers' own SDPA function.
_UNSERVED = ("softcap", "position_bias", "cache", "s_aux", "sinks")


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "lowbit_attn.integrations.transformers needs transformers: "
            "pip install 'lowbit-attention[transformers]'"
        ) from exc
    return transformers


def attention_function(recipe: "str | Recipe" = "auto"):
    """The function transformers calls for each attention layer (the ``AttentionInterface``
    contract: ``(module, query [B, H, N, D], key, value, attention_mask, dropout, scaling,
    is_causal, **kwargs) → (output [B, N, H, D], None)``)."""
    resolve(recipe, None)

    def lowbit_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                 scaling=None, is_causal=None, **kwargs):
        unserved = [k for k in _UNSERVED if kwargs.get(k) is not None]
        if kwargs.get("output_attentions"):
            unserved.append("output_attentions")
        if unserved:
            warn_fallback(f"the model passes {', '.join(unserved)}")
            sdpa = _transformers().modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]
            return sdpa(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, is_causal=is_causal, **kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # as transformers' SDPA path: causal only for more than one query and no explicit mask
        causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
        out = sdpa_or_fallback(query, key, value, attention_mask, dropout, causal, scaling,
                               key.shape[1] != query.shape[1], recipe=recipe, fallback=TORCH_SDPA)
        return out.transpose(1, 2).contiguous(), None

    return lowbit_attention_forward


def register(name: str = "lowbit", recipe: "str | Recipe" = "auto") -> str:
    """Register ``name`` as an ``attn_implementation`` running ``recipe`` (its masks built as for
    ``"sdpa"``); registering again replaces it. Returns ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    tf = _transformers()
    from transformers.masking_utils import sdpa_mask

    tf.AttentionInterface.register(name, attention_function(recipe))
    tf.AttentionMaskInterface.register(name, sdpa_mask)
    return name


__all__ = ["attention_function", "register"]
