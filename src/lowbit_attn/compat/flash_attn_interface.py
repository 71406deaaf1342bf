"""FlashAttention 3's public attention functions (its Hopper package, imported as
``flash_attn_interface``: ``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_qkvpacked_func``; not ``flash_attn_with_kvcache`` or ``flash_attn_combine``), with
its signatures as of flash-attention 2.8.4 (``hopper/flash_attn_interface.py``), on lowbit_attn:
change ``from flash_attn_interface import flash_attn_func`` to ``from
lowbit_attn.compat.flash_attn_interface import flash_attn_func``.

What each call runs: as :mod:`lowbit_attn.compat.flash_attn` (the 8-bit forward, or where
autograd needs gradients the trainable attention; the keyword-only ``recipe`` and
``train_recipe`` pick them).

The arguments are read as FlashAttention 3 reads them (``hopper/flash_api.cpp``, ``mask.h``):

* ``causal`` aligns the mask bottom-right when ``seqlen_q != seqlen_k`` and sets the window's
  right side to 0.
* ``window_size=(left, right)`` (ints, or a two-element integer tensor): query ``i`` sees keys
  ``i + Nk - Nq - left`` to ``i + Nk - Nq + right``; a negative side is unbounded, and so is one
  that bounds nothing (``left >= Nk - 1``, ``right >= Nq - 1``; ``max_seqlen_*`` when packed),
  however large (FlashAttention 3 puts ``Nk - 1`` and ``Nq - 1`` in a negative side). This is
  :func:`lowbit_attn.attention`'s ``window``.
* ``attention_chunk=C > 0``: query ``i`` sees only keys of its chunk, ``[⌊p/C⌋·C, ⌊p/C⌋·C + C)``
  with ``p = i + Nk - Nq``, within the window: :func:`lowbit_attn.attention`'s ``chunk``.
* ``softcap > 0`` caps the scores, ``c·tanh(S/c)``; 0 or below is off.
* ``return_attn_probs=True`` returns ``(out, softmax_lse)``: the natural-log LSE of each row of
  ``q·kᵀ·softmax_scale`` (after the cap), fp32, ``[B, H, Nq]`` (``[H, total_q]`` packed); a row
  that sees no key has ``-inf``, as FlashAttention 3 gives it (packed sequences none of which has
  a key: ``+inf``, as theirs, which skips its kernel then).

What differs:

* ``qv``, ``q_descale``, ``k_descale``, ``v_descale``, ``seqused_q`` and ``seqused_k`` must be
  None (``ValueError``): no second query for MLA, no FP8 inputs with their scales (our recipes
  quantize 16-bit inputs themselves), no used-length limits inside packed sequences.
* ``num_splits``, ``pack_gqa``, ``sm_margin`` and ``deterministic`` are checked and have no
  effect: they schedule FlashAttention 3's kernels. Our forward is deterministic, and so is the
  backward unless ``LOWBIT_ATTN_TRAIN_DQ=atomic``. ``return_attn_probs`` where gradients are
  needed is refused (the trainable attention returns no LSE).
* Where gradients are needed, ``attention_chunk`` works too (FlashAttention 3's backward
  refuses it), and packed sequences run one trainable call per sequence.
* Refused where FlashAttention 3 computes something: a dense call with no key (``Nk = 0``;
  theirs gives zeros and a ``+inf`` LSE); a ``softmax_scale`` that is not a positive number from
  2**-125 to 2**126, a ``softcap`` that is NaN or above 2**16; ``max_seqlen_q`` or
  ``max_seqlen_k`` below the longest sequence.
* V's head dim must be Q's (FlashAttention 3 also takes Q/K of 192 channels with V of 128, and
  V up to 512 with Q/K up to 64).
* NaN: a row whose scores hold a NaN gets a NaN LSE (FlashAttention 3 writes ``-inf``), and the
  8-bit recipes spread a NaN in q or k over its head (:func:`lowbit_attn.attention`).
* The caller's tensors are never modified; CPU tensors work (the PyTorch reference with the same
  numerics); float32 inputs too, where no gradient is needed on a GPU; head dims 1 to 256.
"""

from __future__ import annotations

import math

import torch

from lowbit_attn.compat import flash_calls
from lowbit_attn.core import checks

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"]

# The largest chunk passed on (ours are below 2**30): a longer one is the same mask for every
# sequence shorter than it.
CHUNK_MAX = 2**30 - 1


def _unsupported(**given) -> None:
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name} must be None: lowbit_attn takes 16-bit (or float32) q, k, v "
                             "and quantizes them itself; it has no second query (qv), FP8 inputs "
                             "with descales, or used lengths (seqused_q, seqused_k)")


def _scheduling(num_splits, pack_gqa, sm_margin, deterministic) -> None:
    """FlashAttention 3's scheduling arguments: checked, no effect here."""
    flash_calls.integer("num_splits", num_splits)
    flash_calls.integer("sm_margin", sm_margin)
    if pack_gqa is not None:
        checks.flag("pack_gqa", pack_gqa)
    checks.flag("deterministic", deterministic)


def _variant(causal, window_size, attention_chunk, softcap, nq: int, nk: int) -> dict:
    """Our ``is_causal``, ``window``, ``chunk`` and ``softcap`` from FlashAttention 3's, with
    ``nq`` queries and ``nk`` keys (the longest sequences when packed). A side that bounds
    nothing (``left >= nk - 1``, ``right >= nq - 1``) is unbounded, as ``mha_fwd`` makes it."""
    causal = checks.flag("causal", causal)
    left, right = flash_calls.window_sides(window_size)
    left, right = (-1 if left >= nk - 1 else left), (-1 if right >= nq - 1 else right)
    chunk = flash_calls.integer("attention_chunk", attention_chunk)
    if chunk < 0:
        raise ValueError(f"attention_chunk must be 0 (off) or positive, got {chunk}")
    return {"is_causal": causal, "window": None if left < 0 and right < 0 else (left, right),
            "chunk": min(chunk, CHUNK_MAX) or None, "softcap": flash_calls.softcap_of(softcap)}


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False, *, recipe="auto", train_recipe="sagebwd_int8"):
    """FlashAttention 3's ``flash_attn_func`` on lowbit_attn (the module's notes say what differs).

    Args:
        q: ``[B, Nq, Hq, D]``.
        k: ``[B, Nk, Hkv, D]``, ``Hq`` a multiple of ``Hkv`` (MQA/GQA).
        v: the same shape as k.
        softmax_scale: ``D ** -0.5`` by default.
        causal: bottom-right aligned causal mask.
        qv: must be None.
        q_descale: must be None.
        k_descale: must be None.
        v_descale: must be None.
        window_size: ``(left, right)``, a negative side unbounded.
        attention_chunk: ``C > 0``: chunked local attention; 0 off.
        softcap: ``> 0`` caps the scores at ``softcap·tanh(S/softcap)``; ``<= 0`` is off.
        num_splits: an int; no effect.
        pack_gqa: None or a bool; no effect.
        deterministic: a bool (see the module's notes).
        sm_margin: an int; no effect.
        return_attn_probs: also return the LSE ``[B, Hq, Nq]``.
        recipe: the inference recipe (keyword only; see :func:`lowbit_attn.attention`).
        train_recipe: the training recipe where gradients are needed (keyword only; see
            :func:`lowbit_attn.trainable_attention`).

    Returns:
        ``out [B, Nq, Hq, D]``, or ``(out, softmax_lse)`` with ``return_attn_probs``.

    Raises:
        ValueError: ``qv`` or a descale given, a negative ``attention_chunk``, a NaN ``softcap``,
            ``return_attn_probs`` where gradients are needed; and as :func:`lowbit_attn.attention`.
        TypeError: a flag that is not a bool, ``window_size`` not a pair of ints,
            ``attention_chunk``, ``num_splits`` or ``sm_margin`` not an int, ``softcap`` not a
            real number; and as :func:`lowbit_attn.attention`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn_interface import flash_attn_func
        >>> q, k, v = (torch.randn(2, 64, 4, 64) for _ in range(3))  # [B, N, H, D]
        >>> out, lse = flash_attn_func(q, k, v, causal=True, attention_chunk=32,
        ...                            return_attn_probs=True)
        >>> out.shape, lse.shape
        (torch.Size([2, 64, 4, 64]), torch.Size([2, 4, 64]))
    """
    _unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    _scheduling(num_splits, pack_gqa, sm_margin, deterministic)
    return_attn_probs = checks.flag("return_attn_probs", return_attn_probs)
    nq, nk = (x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 4 else 0 for x in (q, k))
    return flash_calls.dense(q, k, v, scale=softmax_scale,
                             variant=_variant(causal, window_size, attention_chunk, softcap, nq, nk),
                             recipe=recipe, train_recipe=train_recipe,
                             return_lse=return_attn_probs)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None,
                              k_descale=None, v_descale=None, window_size=(-1, -1),
                              attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False, *,
                              recipe="auto", train_recipe="sagebwd_int8"):
    """FlashAttention 3's ``flash_attn_qkvpacked_func``: :func:`flash_attn_func` with Q, K and V
    stacked, ``[B, N, 3, H, D]``, or with GQA along the heads, ``[B, N, Hq + 2·Hkv, D]`` and
    ``num_heads_q=Hq``.

    Args:
        qkv: ``[B, N, 3, H, D]`` (``qkv[:, :, 0]`` is Q, ``1`` K, ``2`` V), or ``[B, N, Hq +
            2·Hkv, D]`` with ``num_heads_q``: heads ``:Hq`` Q, then K's and V's.
        softmax_scale: as :func:`flash_attn_func`.
        causal: as :func:`flash_attn_func`.
        q_descale: must be None.
        k_descale: must be None.
        v_descale: must be None.
        window_size: as :func:`flash_attn_func`.
        attention_chunk: as :func:`flash_attn_func`.
        softcap: as :func:`flash_attn_func`.
        deterministic: as :func:`flash_attn_func`.
        num_heads_q: ``Hq`` for a 4-D ``qkv``; None for a 5-D one.
        sm_margin: as :func:`flash_attn_func`.
        return_attn_probs: as :func:`flash_attn_func`.
        recipe: as :func:`flash_attn_func`.
        train_recipe: as :func:`flash_attn_func`.

    Returns:
        As :func:`flash_attn_func`.

    Raises:
        ValueError: ``qkv`` of another shape, or ``num_heads_q`` that does not split its heads
            into Hq and twice Hkv; as :func:`flash_attn_func`.
        TypeError: ``qkv`` not a tensor, ``num_heads_q`` not an int; as :func:`flash_attn_func`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn_interface import flash_attn_qkvpacked_func
        >>> qkv = torch.randn(1, 64, 8 + 2 * 2, 64)  # GQA 8:2 along the heads
        >>> flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=8).shape
        torch.Size([1, 64, 8, 64])
    """
    if isinstance(qkv, torch.Tensor) and qkv.dim() == 4:
        num_heads_q = flash_calls.integer("num_heads_q (for a 4-D qkv)", num_heads_q)
        hkv2 = qkv.shape[2] - num_heads_q
        if num_heads_q < 1 or hkv2 < 2 or hkv2 % 2:
            raise ValueError(f"num_heads_q must leave an even, positive number of key and value "
                             f"heads of qkv's {qkv.shape[2]}, got {num_heads_q}")
        q, k, v = qkv.split([num_heads_q, hkv2 // 2, hkv2 // 2], dim=2)
    else:
        q, k, v = flash_calls.unpack("qkv", qkv, 3, dims=5)
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                           q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                           window_size=window_size, attention_chunk=attention_chunk,
                           softcap=softcap, deterministic=deterministic, sm_margin=sm_margin,
                           return_attn_probs=return_attn_probs, recipe=recipe,
                           train_recipe=train_recipe)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, recipe="auto",
                           train_recipe="sagebwd_int8"):
    """FlashAttention 3's ``flash_attn_varlen_func`` on lowbit_attn:
    :func:`lowbit_attn.attention_varlen`, or where gradients are needed one
    :func:`lowbit_attn.trainable_attention` call per sequence.

    Args:
        q: ``[total_q, Hq, D]``; sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
        k: ``[total_k, Hkv, D]``.
        v: the same shape as k.
        cu_seqlens_q: int32 ``[B + 1]`` offsets into q on q's device.
        cu_seqlens_k: the same for k and v.
        max_seqlen_q: an int at least the longest query sequence.
        max_seqlen_k: an int at least the longest key sequence.
        seqused_q: must be None.
        seqused_k: must be None.
        softmax_scale: as :func:`flash_attn_func`.
        causal: as :func:`flash_attn_func`, per sequence.
        qv: must be None.
        q_descale: must be None.
        k_descale: must be None.
        v_descale: must be None.
        window_size: as :func:`flash_attn_func`, per sequence.
        attention_chunk: as :func:`flash_attn_func`, per sequence.
        softcap: as :func:`flash_attn_func`.
        num_splits: as :func:`flash_attn_func`.
        pack_gqa: as :func:`flash_attn_func`.
        deterministic: as :func:`flash_attn_func`.
        sm_margin: as :func:`flash_attn_func`.
        return_attn_probs: also return the LSE ``[Hq, total_q]``.
        recipe: as :func:`flash_attn_func`.
        train_recipe: as :func:`flash_attn_func`.

    Returns:
        ``out [total_q, Hq, D]``, or ``(out, softmax_lse [Hq, total_q])``.

    Raises:
        ValueError: ``seqused_q`` or ``seqused_k`` given; as :func:`flash_attn_func` and
            :func:`lowbit_attn.attention_varlen`.
        TypeError: as :func:`flash_attn_func` and :func:`lowbit_attn.attention_varlen`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn_interface import flash_attn_varlen_func
        >>> cu = torch.tensor([0, 40, 100], dtype=torch.int32)  # two sequences: 40 and 60 tokens
        >>> q, k, v = (torch.randn(100, 4, 64) for _ in range(3))
        >>> flash_attn_varlen_func(q, k, v, cu, cu, 60, 60, causal=True, window_size=(15, 0)).shape
        torch.Size([100, 4, 64])
    """
    _unsupported(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale,
                 k_descale=k_descale, v_descale=v_descale)
    _scheduling(num_splits, pack_gqa, sm_margin, deterministic)
    return_attn_probs = checks.flag("return_attn_probs", return_attn_probs)
    variant = _variant(causal, window_size, attention_chunk, softcap,
                       checks.max_seqlen("max_seqlen_q", max_seqlen_q, None),
                       checks.max_seqlen("max_seqlen_k", max_seqlen_k, None))
    result = flash_calls.packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale=softmax_scale, variant=variant, recipe=recipe,
                                train_recipe=train_recipe, return_lse=return_attn_probs)
    if return_attn_probs and k.shape[0] == 0:  # no key in any sequence: theirs skips the kernel
        out, lse = result
        return out, torch.full_like(lse, math.inf)
    return result
