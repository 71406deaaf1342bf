"""An append to the quantized KV cache as one Triton launch: the new tokens of every sequence
written into their pages, K quantized per token, and V quantized per channel on each page that
fills. The same bytes as ``QuantizedKVCache._write`` (the twin, and the path of non-Triton
backends), whose numerics are ``kvcache/quantize.py``: K as ``quantize_keys``, a full page's V as
``quantize_v_page``.

``_append_kernel``: one program per (sequence, KV head). It walks, in order, every page the
append touches for its sequence: a page's slots before the append's first token (the sequence's
open page) are read back from ``v_open``, the new tokens are gathered from the input through the
compacted indices ``SRC``, and a page that fills is quantized from that tile in registers. A
sequence's open V page ``v_open[b]`` is shared by its heads but not across programs (each
program owns ``v_open[b, head]``), and all the pages of one (sequence, head) are handled by a
single program in order: nothing races on an open page.

The host (``cache.py``) checks the append, freezes a sequence's first statistics, takes the
pages from the free list and writes the block table before the launch; the kernel reads each
sequence's start (its length before the append) from ``lengths`` and the page ids from the block
table, and advances ``lengths`` once every program of the sequence has read it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core.triton_helpers import exact_fp8, next_pow2, strides, to_e4m3
from lowbit_attn.kvcache.pages import PagedLayer
from lowbit_attn.kvcache.recipes import KVRecipe
from lowbit_attn.quant.tile import balance_multiplier, e4m3_scale, int8_lines, line_amax


@triton.jit
def _append_kernel(
    KIN, VIN, SRC, CNT, K, KS, V, VS, VO, KM, AQ, AK, BT, LEN, ERR, TICKET,
    kin_strides, vin_strides, src_strides, k_strides, ks_strides, v_strides, vs_strides,
    vo_strides, km_strides, amax_strides, bt_strides, N, D, MAX_PAGES,
    PAGE: tl.constexpr, V_FP8: tl.constexpr, EXACT_FP8: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Strides: the inputs ``KIN``, ``VIN`` (batch, head, token, dim); ``SRC`` (batch, token):
    the indices of the stored tokens among the ``N``, valid ones first and in order, ``CNT[b]``
    of them (both None: every sequence stores all ``N`` tokens, in order); the pools ``K``, ``V`` (page, head, slot, dim), ``KS`` (page, head, slot), ``VS``
    (page, head, dim); the open pages ``VO`` (batch, head, slot, dim); μ ``KM`` (batch, head,
    dim); the balancing statistics ``AQ``, ``AK`` (batch, head; unit stride over dim); ``BT``
    (batch, page), ``MAX_PAGES`` columns. ``ERR``: None where the host took every page (an
    eager append); for a captured decode step, int32 ``[B]`` set to 1 for a sequence whose
    token finds no page (past its reserved pages or ``MAX_PAGES``), which then writes nothing
    there. ``TICKET``: int32 ``[B]`` of zeros, with which an eager append advances ``LEN``
    itself: each program of a sequence takes a ticket after its last read of ``LEN`` (an
    acquire-release atomic), and the last to take one stores the new length and zeroes the
    ticket (None for a decode step, whose merge advances ``LEN``)."""
    sib, sih, sin, sid = kin_strides
    svib, svih, svin, svid = vin_strides
    ssb, ssn = src_strides
    skp, skh, skn, skd = k_strides
    sksp, sksh, sksn = ks_strides
    svp, svh, svn, svd = v_strides
    svsp, svsh, svsd = vs_strides
    sob, soh, son, sod = vo_strides
    smb, smh, smd = km_strides
    sbb, sbp = bt_strides
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)

    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    start = tl.load(LEN + b).to(tl.int32)
    if CNT is None:
        count = N
    else:
        count = tl.load(CNT + b).to(tl.int32)
    mu = tl.load(KM + b * smb + h * smh + offs_d * smd, mask=dmask, other=0.0)
    inv_alpha = balance_multiplier(AQ, AK, b, h, offs_d, D, amax_strides, amax_strides, 1,
                                   ROLE=2, BLOCK_D=BLOCK_D)  # statistics per KV head: a group of 1

    end = start + count
    for page_no in range(start // PAGE, tl.cdiv(end, PAGE)):
        if ERR is None:
            page = tl.load(BT + b * sbb + page_no * sbp).to(tl.int64)
        else:  # a replayed step: the pages were reserved by the host, maybe not enough of them
            page = tl.load(BT + b * sbb + page_no * sbp, mask=page_no < MAX_PAGES,
                           other=-1).to(tl.int64)
            if page < 0:
                tl.store(ERR + b, 1)
        t = page_no * PAGE + offs_p - start  # slot → the append's t-th stored token
        slots = (offs_p < PAGE) & (page >= 0)  # no page (a replay's overflow): nothing written
        new = slots & (t >= 0) & (t < count)
        tile = new[:, None] & dmask[None, :]
        if SRC is None:
            src = t.to(tl.int64)
        else:
            src = tl.load(SRC + b * ssb + t * ssn, mask=new, other=0).to(tl.int64)

        # K: (K - μ)/α, INT8 per token (quantize.quantize_keys)
        x = tl.load(KIN + b * sib + h * sih + src[:, None] * sin + offs_d[None, :] * sid,
                    mask=tile, other=0.0).to(tl.float32)
        x = (x - mu[None, :]) * inv_alpha[None, :]
        k8, k_scale = int8_lines(x, 1)
        tl.store(K + page * skp + h * skh + offs_p[:, None] * skn + offs_d[None, :] * skd, k8,
                 mask=tile)
        tl.store(KS + page * sksp + h * sksh + offs_p * sksn, k_scale, mask=new)

        vo = VO + b * sob + h * soh + offs_p[:, None] * son + offs_d[None, :] * sod
        vn = tl.load(VIN + b * svib + h * svih + src[:, None] * svin + offs_d[None, :] * svid,
                     mask=tile, other=0.0)
        if page_no * PAGE + PAGE <= end:  # the page fills: V per channel (quantize_v_page)
            old = (offs_p < PAGE) & (t < 0)  # the open page's earlier tokens
            vp = tl.load(vo, mask=old[:, None] & dmask[None, :], other=0.0)
            vp = tl.where(tile, vn, vp).to(tl.float32)
            if V_FP8:
                v_scale = e4m3_scale(line_amax(vp, 0))
                v8 = to_e4m3(tl.div_rn(vp, v_scale[None, :]), EXACT_FP8)
            else:
                v8, v_scale = int8_lines(vp, 0)
            tl.store(V + page * svp + h * svh + offs_p[:, None] * svn + offs_d[None, :] * svd, v8,
                     mask=slots[:, None] & dmask[None, :])
            tl.store(VS + page * svsp + h * svsh + offs_d * svsd, v_scale,
                     mask=dmask & (page >= 0))
        else:  # the page stays open: V kept exact (a full page's v_open slots are never read)
            tl.store(vo, vn, mask=tile)

    if TICKET is not None:  # every program of the sequence has read LEN before its ticket
        tl.debug_barrier()  # every warp of this program too: the ticket is one thread's atomic
        if tl.atomic_add(TICKET + b, 1, sem="acq_rel") == tl.num_programs(1) - 1:
            tl.store(LEN + b, end.to(tl.int64))
            tl.store(TICKET + b, 0)


def stored_tokens(valid: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(src int32 [B, n], counts int32 [B])``, on the device without a host read: sequence
    ``b`` stores tokens ``src[b, :counts[b]]`` of the ``n`` (its valid ones in order). Without
    ``valid``, ``(None, None)``: the kernel then stores every token, with no index tensors to
    build (two launches fewer per decode step)."""
    if valid is None:
        return None, None
    src = torch.argsort((~valid).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return src, valid.sum(dim=1, dtype=torch.int32)


def append(layer: PagedLayer, recipe: KVRecipe, k: torch.Tensor, v: torch.Tensor,
           valid: torch.Tensor | None, *, replayable: bool = False) -> None:
    """Writes ``k``, ``v [B, Hkv, n, D]`` (the cache's dtype, any strides; the tokens ``valid``
    marks, all without it) after each sequence's ``layer.lengths`` tokens. The caller has frozen
    the statistics of sequences appended to for the first time, taken their pages and written
    the block table; the launch advances ``layer.lengths`` (the host mirror is the caller's).
    ``replayable``: the pages were reserved for a captured decode step, whose replays may run
    past them: a token without a page is not written and sets ``layer.overflow``, and the
    lengths are left to the step's merge."""
    bsz, hkv, n, d = k.shape
    page = layer.page_size
    src, counts = stored_tokens(valid)
    _append_kernel[(bsz, hkv)](
        KIN=k, VIN=v, SRC=src, CNT=counts, K=layer.k, KS=layer.k_scale, V=layer.v,
        VS=layer.v_scale, VO=layer.v_open, KM=layer.k_mean, AQ=layer.q_amax, AK=layer.k_amax,
        BT=layer.block_table, LEN=layer.lengths, ERR=layer.overflow if replayable else None,
        TICKET=None if replayable else layer.tickets, kin_strides=strides(k, 4),
        vin_strides=strides(v, 4), src_strides=strides(src, 2),
        k_strides=strides(layer.k, 4), ks_strides=strides(layer.k_scale, 3),
        v_strides=strides(layer.v, 4), vs_strides=strides(layer.v_scale, 3),
        vo_strides=strides(layer.v_open, 4), km_strides=strides(layer.k_mean, 3),
        amax_strides=layer.q_amax.stride()[:2], bt_strides=strides(layer.block_table, 2), N=n, D=d,
        MAX_PAGES=layer.block_table.shape[1],
        PAGE=page, V_FP8=recipe.v_dtype == torch.float8_e4m3fn, EXACT_FP8=exact_fp8(),
        BLOCK_P=next_pow2(page, 16), BLOCK_D=next_pow2(d, 16),
    )
