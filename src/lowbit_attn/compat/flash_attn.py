"""FlashAttention 2's public functions (six of the ``flash_attn`` package's seven:
``flash_attn_func``, ``flash_attn_varlen_func`` and their packed forms; not
``flash_attn_with_kvcache``), with its signatures, on lowbit_attn: change
``from flash_attn import flash_attn_func`` to ``from lowbit_attn.compat.flash_attn import
flash_attn_func`` and compare the two on your model.

What each call runs:

* Under ``torch.no_grad()``, ``torch.inference_mode()`` or with inputs that need no gradient, the
  8-bit forward, :func:`lowbit_attn.attention` (``recipe="auto"``; the keyword-only ``recipe``,
  which FlashAttention does not have, picks another).
* Where autograd needs gradients of q, k or v, the trainable 8-bit attention,
  :func:`lowbit_attn.trainable_attention` (``train_recipe="sagebwd_int8"``), forward and backward.
  Packed sequences with gradients run one call per sequence (no packed training kernel).

The arguments are read as FlashAttention 2 reads them (``csrc/flash_attn/flash_api.cpp``):

* ``causal`` aligns the mask bottom-right when ``seqlen_q != seqlen_k``, as ours does.
* ``window_size=(left, right)``: query ``i`` sees keys ``i + Nk - Nq - left`` to
  ``i + Nk - Nq + right``. A negative side is unbounded; a side ``>= Nk`` (``max_seqlen_k`` for
  packed sequences) is unbounded; ``causal`` sets ``right`` to 0; where one side is bounded and the
  other is not, the other is ``Nk``, as FlashAttention 2's kernels take it (this differs from an
  unbounded side only for the first ``Nq - Nk - 1`` queries when ``Nq > Nk + 1``).
* ``softcap > 0`` caps the scores, ``c·tanh(S/c)``; 0 or below is off.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``: the natural-log LSE of each
  row of ``q·kᵀ·softmax_scale`` (after the cap), fp32, ``[B, H, Nq]`` (``[H, total_q]`` packed); a
  row that sees no key has ``+inf``, as FlashAttention 2 gives it. ``S_dmask`` is an empty tensor
  of q's dtype, as FlashAttention 2's is without dropout.

What differs:

* ``dropout_p`` must be 0 and ``alibi_slopes`` and ``block_table`` None (``ValueError``):
  lowbit_attn has no attention dropout, ALiBi bias or paged keys here (its paged cache is
  :mod:`lowbit_attn.kvcache`). ``return_attn_probs`` where gradients are needed is refused too (the
  trainable attention returns no LSE).
* ``deterministic`` is accepted: our forward is deterministic, and so is the backward unless
  ``LOWBIT_ATTN_TRAIN_DQ=atomic``.
* Refused where FlashAttention 2 computes something: a dense call with no key (``Nk = 0``; theirs
  gives zeros and a ``+inf`` LSE; packed sequences without keys give that here too); a
  ``softmax_scale`` that is not a positive number from 2**-125 to 2**126, a ``softcap`` that is
  NaN (theirs reads it as off) or above 2**16; ``max_seqlen_q`` or ``max_seqlen_k`` below the
  longest sequence (theirs computes wrong rows).
* An LSE that is NaN stays NaN (FlashAttention 2 writes ``+inf`` for a row whose sum is NaN).
* The caller's tensors are never modified; CPU tensors work (the PyTorch reference with the same
  numerics); float32 inputs too, where no gradient is needed on a GPU; head dims 1 to 256.
"""

from __future__ import annotations

import math
import numbers

import torch

from lowbit_attn.compat import flash_calls
from lowbit_attn.core import checks

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func"]


def _unsupported(dropout_p, alibi_slopes, block_table=None) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {checks.shown(dropout_p)}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0.0: lowbit_attn has no attention dropout (pass 0.0, "
                         f"or set the model's attention dropout to 0), got {dropout_p!r}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes must be None: lowbit_attn has no ALiBi bias")
    if block_table is not None:
        raise ValueError("block_table must be None: paged keys and values are not taken here "
                         "(lowbit_attn.kvcache has an 8-bit paged cache of its own)")


def _variant(causal, window_size, softcap, nk: int) -> dict:
    """``is_causal``, ``window`` and ``softcap`` for our functions, from FlashAttention 2's
    ``causal``, ``window_size`` and ``softcap`` with ``nk`` keys (the longest sequence's when
    packed), read as its ``mha_fwd`` and ``set_params_fprop`` read them."""
    causal = checks.flag("causal", causal)
    left, right = (x if x < nk else -1 for x in flash_calls.window_sides(window_size))
    if causal:
        right = 0
    cap = flash_calls.softcap_of(softcap)
    if right == 0 and left < 0:
        return {"is_causal": True, "window": None, "softcap": cap}
    if left < 0 and right < 0:
        return {"is_causal": False, "window": None, "softcap": cap}
    # FlashAttention 2 makes an unbounded side nk when the other is bounded: on the left that
    # still reaches key 0 from every query (nothing changes); on the right it cuts the first
    # Nq - Nk - 1 queries when Nq > Nk + 1.
    return {"is_causal": False, "window": (left, nk if right < 0 else right), "softcap": cap}


def _with_lse(result: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor) -> tuple:
    """``(out, softmax_lse, S_dmask)`` as FlashAttention 2 returns them without dropout: a row
    that sees no key has LSE ``+inf`` (ours ``-inf``), and ``S_dmask`` is empty."""
    out, lse = result
    return out, lse.masked_fill(lse == -math.inf, math.inf), q.new_empty((0,))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, recipe="auto", train_recipe="sagebwd_int8"):
    """FlashAttention 2's ``flash_attn_func`` on lowbit_attn (the module's notes say what differs).

    Args:
        q: ``[B, Nq, Hq, D]``.
        k: ``[B, Nk, Hkv, D]``, ``Hq`` a multiple of ``Hkv`` (MQA/GQA).
        v: the same shape as k.
        dropout_p: must be 0.0.
        softmax_scale: ``D ** -0.5`` by default.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)``, ``-1`` unbounded, read as FlashAttention 2 reads it.
        softcap: ``> 0`` caps the scores at ``softcap·tanh(S/softcap)``; ``<= 0`` is off.
        alibi_slopes: must be None.
        deterministic: accepted (see the module's notes).
        return_attn_probs: also return the LSE ``[B, Hq, Nq]`` and an empty ``S_dmask``.
        recipe: the inference recipe (keyword only; see :func:`lowbit_attn.attention`).
        train_recipe: the training recipe where gradients are needed (keyword only; see
            :func:`lowbit_attn.trainable_attention`).

    Returns:
        ``out [B, Nq, Hq, D]``, or ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs``.

    Raises:
        ValueError: ``dropout_p`` not 0, ``alibi_slopes`` given, ``return_attn_probs`` where
            gradients are needed, a NaN ``softcap``; and as :func:`lowbit_attn.attention`.
        TypeError: ``causal``, ``deterministic`` or ``return_attn_probs`` not a bool,
            ``window_size`` not a pair of ints, ``softcap`` not a real number; and as
            :func:`lowbit_attn.attention`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn import flash_attn_func
        >>> q = torch.randn(2, 64, 8, 64)  # [B, N, H, D]
        >>> k, v = torch.randn(2, 64, 2, 64), torch.randn(2, 64, 2, 64)  # GQA 8:2
        >>> flash_attn_func(q, k, v, causal=True, window_size=(31, 0), softcap=50.0).shape
        torch.Size([2, 64, 8, 64])
        >>> q = q.requires_grad_()  # gradients: the trainable attention runs
        >>> flash_attn_func(q, k, v, causal=True, train_recipe="exact").sum().backward()
        >>> q.grad.shape
        torch.Size([2, 64, 8, 64])
    """
    _unsupported(dropout_p, alibi_slopes)
    checks.flag("deterministic", deterministic)
    return_attn_probs = checks.flag("return_attn_probs", return_attn_probs)
    nk = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    variant = _variant(causal, window_size, softcap, nk)
    result = flash_calls.dense(q, k, v, scale=softmax_scale, variant=variant, recipe=recipe,
                               train_recipe=train_recipe, return_lse=return_attn_probs)
    return _with_lse(result, q) if return_attn_probs else result


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, recipe="auto",
                             train_recipe="sagebwd_int8"):
    """FlashAttention 2's ``flash_attn_kvpacked_func``: :func:`flash_attn_func` with K and V
    stacked.

    Args:
        q: ``[B, Nq, Hq, D]``.
        kv: ``[B, Nk, 2, Hkv, D]``: ``kv[:, :, 0]`` is K, ``kv[:, :, 1]`` is V.
        dropout_p: must be 0.0.
        softmax_scale: as :func:`flash_attn_func`.
        causal: as :func:`flash_attn_func`.
        window_size: as :func:`flash_attn_func`.
        softcap: as :func:`flash_attn_func`.
        alibi_slopes: must be None.
        deterministic: as :func:`flash_attn_func`.
        return_attn_probs: as :func:`flash_attn_func`.
        recipe: as :func:`flash_attn_func`.
        train_recipe: as :func:`flash_attn_func`.

    Returns:
        As :func:`flash_attn_func`.

    Raises:
        ValueError: ``kv`` not of that shape; as :func:`flash_attn_func`.
        TypeError: ``kv`` not a tensor; as :func:`flash_attn_func`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn import flash_attn_kvpacked_func
        >>> q, kv = torch.randn(1, 64, 4, 64), torch.randn(1, 64, 2, 2, 64)
        >>> flash_attn_kvpacked_func(q, kv, causal=True).shape
        torch.Size([1, 64, 4, 64])
    """
    k, v = flash_calls.unpack("kv", kv, 2, dims=5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, recipe=recipe,
                           train_recipe=train_recipe)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, recipe="auto",
                              train_recipe="sagebwd_int8"):
    """FlashAttention 2's ``flash_attn_qkvpacked_func``: :func:`flash_attn_func` with Q, K and V
    stacked.

    Args:
        qkv: ``[B, N, 3, H, D]``: ``qkv[:, :, 0]`` is Q, ``1`` K, ``2`` V.
        dropout_p: must be 0.0.
        softmax_scale: as :func:`flash_attn_func`.
        causal: as :func:`flash_attn_func`.
        window_size: as :func:`flash_attn_func`.
        softcap: as :func:`flash_attn_func`.
        alibi_slopes: must be None.
        deterministic: as :func:`flash_attn_func`.
        return_attn_probs: as :func:`flash_attn_func`.
        recipe: as :func:`flash_attn_func`.
        train_recipe: as :func:`flash_attn_func`.

    Returns:
        As :func:`flash_attn_func`.

    Raises:
        ValueError: ``qkv`` not of that shape; as :func:`flash_attn_func`.
        TypeError: ``qkv`` not a tensor; as :func:`flash_attn_func`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn import flash_attn_qkvpacked_func
        >>> qkv = torch.randn(2, 64, 3, 4, 64)
        >>> out, lse, _ = flash_attn_qkvpacked_func(qkv, window_size=(16, 0), return_attn_probs=True)
        >>> lse.shape
        torch.Size([2, 4, 64])
    """
    q, k, v = flash_calls.unpack("qkv", qkv, 3, dims=5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, recipe=recipe,
                           train_recipe=train_recipe)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, recipe="auto",
                           train_recipe="sagebwd_int8"):
    """FlashAttention 2's ``flash_attn_varlen_func`` on lowbit_attn (the module's notes say what
    differs): :func:`lowbit_attn.attention_varlen`, or where gradients are needed one
    :func:`lowbit_attn.trainable_attention` call per sequence.

    Args:
        q: ``[total_q, Hq, D]``; sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
        k: ``[total_k, Hkv, D]``.
        v: the same shape as k.
        cu_seqlens_q: int32 ``[B + 1]`` offsets into q on q's device.
        cu_seqlens_k: the same for k and v.
        max_seqlen_q: an int at least the longest query sequence.
        max_seqlen_k: an int at least the longest key sequence; it also bounds ``window_size`` as
            FlashAttention 2 reads it.
        dropout_p: as :func:`flash_attn_func`.
        softmax_scale: as :func:`flash_attn_func`.
        causal: as :func:`flash_attn_func`, per sequence.
        window_size: as :func:`flash_attn_func`, per sequence.
        softcap: as :func:`flash_attn_func`.
        alibi_slopes: must be None.
        deterministic: as :func:`flash_attn_func`.
        return_attn_probs: also return the LSE ``[Hq, total_q]`` and an empty ``S_dmask``.
        block_table: must be None.
        recipe: as :func:`flash_attn_func`.
        train_recipe: as :func:`flash_attn_func`.

    Returns:
        ``out [total_q, Hq, D]``, or ``(out, softmax_lse [Hq, total_q], S_dmask)``.

    Raises:
        ValueError: as :func:`flash_attn_func` and :func:`lowbit_attn.attention_varlen`;
            ``block_table`` given.
        TypeError: as :func:`flash_attn_func` and :func:`lowbit_attn.attention_varlen`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn import flash_attn_varlen_func
        >>> cu = torch.tensor([0, 40, 100], dtype=torch.int32)  # two sequences: 40 and 60 tokens
        >>> q, k, v = (torch.randn(100, 4, 64) for _ in range(3))
        >>> out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 60, 60, causal=True,
        ...                                      return_attn_probs=True)
        >>> out.shape, lse.shape
        (torch.Size([100, 4, 64]), torch.Size([4, 100]))
    """
    _unsupported(dropout_p, alibi_slopes, block_table)
    checks.flag("deterministic", deterministic)
    return_attn_probs = checks.flag("return_attn_probs", return_attn_probs)
    variant = _variant(causal, window_size, softcap,
                       checks.max_seqlen("max_seqlen_k", max_seqlen_k, None))
    result = flash_calls.packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale=softmax_scale, variant=variant, recipe=recipe,
                                train_recipe=train_recipe, return_lse=return_attn_probs)
    return _with_lse(result, q) if return_attn_probs else result


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *,
                                    recipe="auto", train_recipe="sagebwd_int8"):
    """FlashAttention 2's ``flash_attn_varlen_kvpacked_func``: :func:`flash_attn_varlen_func`
    with K and V stacked.

    Args:
        q: ``[total_q, Hq, D]``.
        kv: ``[total_k, 2, Hkv, D]``: ``kv[:, 0]`` is K, ``kv[:, 1]`` is V.
        cu_seqlens_q: as :func:`flash_attn_varlen_func`.
        cu_seqlens_k: as :func:`flash_attn_varlen_func`.
        max_seqlen_q: as :func:`flash_attn_varlen_func`.
        max_seqlen_k: as :func:`flash_attn_varlen_func`.
        dropout_p: must be 0.0.
        softmax_scale: as :func:`flash_attn_varlen_func`.
        causal: as :func:`flash_attn_varlen_func`.
        window_size: as :func:`flash_attn_varlen_func`.
        softcap: as :func:`flash_attn_varlen_func`.
        alibi_slopes: must be None.
        deterministic: as :func:`flash_attn_varlen_func`.
        return_attn_probs: as :func:`flash_attn_varlen_func`.
        recipe: as :func:`flash_attn_varlen_func`.
        train_recipe: as :func:`flash_attn_varlen_func`.

    Returns:
        As :func:`flash_attn_varlen_func`.

    Raises:
        ValueError: ``kv`` not of that shape; as :func:`flash_attn_varlen_func`.
        TypeError: ``kv`` not a tensor; as :func:`flash_attn_varlen_func`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn import flash_attn_varlen_kvpacked_func
        >>> cu = torch.tensor([0, 40, 100], dtype=torch.int32)
        >>> q, kv = torch.randn(100, 4, 64), torch.randn(100, 2, 2, 64)
        >>> flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 60, 60, causal=True).shape
        torch.Size([100, 4, 64])
    """
    k, v = flash_calls.unpack("kv", kv, 2, dims=4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  recipe=recipe, train_recipe=train_recipe)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, recipe="auto",
                                     train_recipe="sagebwd_int8"):
    """FlashAttention 2's ``flash_attn_varlen_qkvpacked_func``: :func:`flash_attn_varlen_func`
    with Q, K and V stacked, one ``cu_seqlens`` and ``max_seqlen`` for both.

    Args:
        qkv: ``[total, 3, H, D]``: ``qkv[:, 0]`` is Q, ``1`` K, ``2`` V.
        cu_seqlens: int32 ``[B + 1]`` offsets, for the queries and the keys.
        max_seqlen: an int at least the longest sequence.
        dropout_p: must be 0.0.
        softmax_scale: as :func:`flash_attn_varlen_func`.
        causal: as :func:`flash_attn_varlen_func`.
        window_size: as :func:`flash_attn_varlen_func`.
        softcap: as :func:`flash_attn_varlen_func`.
        alibi_slopes: must be None.
        deterministic: as :func:`flash_attn_varlen_func`.
        return_attn_probs: as :func:`flash_attn_varlen_func`.
        recipe: as :func:`flash_attn_varlen_func`.
        train_recipe: as :func:`flash_attn_varlen_func`.

    Returns:
        As :func:`flash_attn_varlen_func`.

    Raises:
        ValueError: ``qkv`` not of that shape; as :func:`flash_attn_varlen_func`.
        TypeError: ``qkv`` not a tensor; as :func:`flash_attn_varlen_func`.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.flash_attn import flash_attn_varlen_qkvpacked_func
        >>> cu = torch.tensor([0, 40, 100], dtype=torch.int32)
        >>> flash_attn_varlen_qkvpacked_func(torch.randn(100, 3, 4, 64), cu, 60, softcap=30.0).shape
        torch.Size([100, 4, 64])
    """
    q, k, v = flash_calls.unpack("qkv", qkv, 3, dims=4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, recipe=recipe,
                                  train_recipe=train_recipe)
