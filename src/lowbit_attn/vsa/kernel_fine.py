"""Block-sparse attention over tiles (the fine stage of video sparse attention), forward and
backward. Q, K, V come as padded tiles ``[B, H, n_tiles, TS, D]`` (tile-contiguous, each tile's
``count`` first rows valid); each query tile attends to the key tiles of its index list, read by
index (no dense mask). Forward: online softmax in base 2, the LSE saved. Backward (FlashAttention-2
style): Δ = rowsum(dO∘O); a dQ kernel over each query tile's key tiles, and a dK/dV kernel over each
key tile's query tiles (the transposed lists, built on the host), looping over the query heads
that share the K/V head. Twin: ``lowbit_attn.vsa.naive.fine``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core import triton_support
from lowbit_attn.core.arch import interpreter_enabled
from lowbit_attn.core.operands import QuantizedQKV
from lowbit_attn.core.triton_helpers import (
    LaunchConfig, batch_head, exact_fp8, finish_rows, mm, next_pow2, online_max, p_offset,
    strides, to_e4m3, autotuned,
)

LOG2E = tl.constexpr(1.4426950408889634)
CONFIGS = {
    "interpreter": [LaunchConfig(4, 1)],
    "sm_80": [LaunchConfig(4, 2), LaunchConfig(8, 2)],
    "sm_89": [LaunchConfig(4, 2), LaunchConfig(8, 2)],
    "sm_90": [LaunchConfig(4, 2), LaunchConfig(8, 2), LaunchConfig(4, 3)],
}


@triton.jit
def _tile(X, b, h, t, offs_s, offs_d, mask, x_strides, TRANS: tl.constexpr):
    """One padded tile ``[TS, D]`` (``[D, TS]`` with ``TRANS``) of ``X [B, H, n_tiles, TS, D]``
    (``x_strides``: batch, head, tile, slot, dim)."""
    sxb, sxh, sxt, sxs, sxd = x_strides
    base = X + b * sxb + h * sxh + t.to(tl.int64) * sxt
    if TRANS:
        x = tl.load(base + offs_s[None, :] * sxs + offs_d[:, None] * sxd, mask=tl.trans(mask),
                    other=0.0)
    else:
        x = tl.load(base + offs_s[:, None] * sxs + offs_d[None, :] * sxd, mask=mask, other=0.0)
    return x


@triton.jit
def _own_tile(CNT, pid_t, H, D, TS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's (batch, head) among ``H`` heads, its slot and channel offsets, and its own
    tile's token count and element mask."""
    b, h = batch_head(tl.program_id(1), H)
    offs_s = tl.arange(0, TS)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    cnt = tl.load(CNT + pid_t)
    return b, h, offs_s, offs_d, dmask, cnt, (offs_s < cnt)[:, None] & dmask[None, :]


@triton.jit
def _query_tile(Q, CNT, pid_t, HQ, GROUP, D, q_strides, TS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's (batch, head, K/V head), offsets, and its query tile with its row mask."""
    b, h, offs_s, offs_d, dmask, cnt_q, qmask = _own_tile(CNT, pid_t, HQ, D, TS, BLOCK_D)
    q = _tile(Q, b, h, pid_t, offs_s, offs_d, qmask, q_strides, False)
    return b, h, h // GROUP, offs_s, offs_d, dmask, cnt_q, qmask, q


@triton.jit
def _key_tile(K, CNT, b, hk, j, offs_s, offs_d, dmask, k_strides):
    """Key tile ``j`` transposed ``[D, TS]``, its token count and row mask."""
    cnt_k = tl.load(CNT + j)
    kmask = (offs_s < cnt_k)[:, None] & dmask[None, :]
    return cnt_k, kmask, _tile(K, b, hk, j, offs_s, offs_d, kmask, k_strides, True)


@triton.jit
def _vsa_fwd_kernel(
    Q, K, V, QS, KS, VS, VM, IDX, CNT, O, LSE,
    q_strides, k_strides, v_strides, idx_strides, o_strides, lse_strides, qs_strides, ks_strides,
    vs_strides, HQ, GROUP, D, KK, scale,
    TS: tl.constexpr, BLOCK_D: tl.constexpr, EMU_FP32: tl.constexpr, INT8_QK: tl.constexpr,
    PV_FP8: tl.constexpr, HAS_VSCALE: tl.constexpr, HAS_VMEAN: tl.constexpr,
    EXACT_FP8: tl.constexpr,
):
    """One query tile over its key tiles. 16-bit: scores ``q·kᵀ·scale`` and the LSE written.
    ``INT8_QK``: INT8 tiles with one scale per token (Q's times ``scale·log2 e``), P̃ and V in E4M3
    (``PV_FP8``, P̃ offset by ``log2 448``) or fp16, V's per-channel scale (if any) in the
    epilogue. Strides: (batch, head, tile, slot, dim) of the tiles ``Q``, ``K``, ``V``, ``O``;
    (batch, head, query tile, entry) of ``IDX``; (batch, head, tile, slot) of ``LSE``, ``QS``,
    ``KS``; (batch, head, dim) of V's channel vectors ``VS``/``VM``."""
    sib, sih, sit, sik = idx_strides
    sob, soh, sot, sos, sod = o_strides
    slb, slh, slt, sls = lse_strides
    sqsb, sqsh, sqst, sqss = qs_strides
    sksb, sksh, skst, skss = ks_strides
    svsb, svsh, svsd = vs_strides
    pid_t = tl.program_id(0)
    b, h, hk, offs_s, offs_d, dmask, cnt_q, qmask, q = _query_tile(
        Q, CNT, pid_t, HQ, GROUP, D, q_strides, TS, BLOCK_D)
    if INT8_QK:
        qs = tl.load(QS + b * sqsb + h * sqsh + pid_t.to(tl.int64) * sqst + offs_s * sqss,
                     mask=offs_s < cnt_q, other=0.0)
    offset = p_offset(PV_FP8)
    m_i = tl.full([TS], float("-inf"), tl.float32)
    l_i = tl.zeros([TS], dtype=tl.float32)
    acc = tl.zeros([TS, BLOCK_D], dtype=tl.float32)
    for s in range(0, KK):
        j = tl.load(IDX + b * sib + h * sih + pid_t * sit + s * sik)
        cnt_k, kmask, kt = _key_tile(K, CNT, b, hk, j, offs_s, offs_d, dmask, k_strides)
        if INT8_QK:
            ks = tl.load(KS + b * sksb + hk * sksh + j.to(tl.int64) * skst + offs_s * skss,
                         mask=offs_s < cnt_k, other=0.0)
            sc = mm(q, kt, True, False) * (qs[:, None] * ks[None, :])
        else:
            sc = mm(q, kt, False, EMU_FP32) * (scale * LOG2E)
        sc = tl.where((offs_s < cnt_k)[None, :], sc, float("-inf"))
        m_new, m_safe, alpha = online_max(m_i, tl.max(sc, axis=1))
        p = tl.exp2(sc - (m_safe - offset)[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # E4M3 V comes slot-contiguous (FP8 MMAs read it so): a mask along the slots would cut
        # its loads to single bytes; the tiles' empty slots hold zeros, which P̃'s zeros multiply
        vmask = kmask if not PV_FP8 else (offs_s < TS)[:, None] & dmask[None, :]
        v = _tile(V, b, hk, j, offs_s, offs_d, vmask, v_strides, False)
        if PV_FP8:
            pv = tl.dot(to_e4m3(p, EXACT_FP8), v, out_dtype=tl.float32)
        else:
            pv = mm(p.to(V.dtype.element_ty), v, False, EMU_FP32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = finish_rows(acc, l_i, VS, VM, b * svsb + hk * svsh, offs_d, dmask, svsd, HAS_VSCALE,
                      HAS_VMEAN)
    base_o = O + b * sob + h * soh + pid_t.to(tl.int64) * sot
    tl.store(base_o + offs_s[:, None] * sos + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=qmask)
    if not INT8_QK:
        tl.store(LSE + b * slb + h * slh + pid_t.to(tl.int64) * slt + offs_s * sls,
                 m_i + tl.log2(l_i), mask=offs_s < cnt_q)


@triton.jit
def _tile_ds(q, kt, v_t, do, lse, delta, cnt_k, offs_s, scale, EMU_FP32: tl.constexpr):
    """P and dS (natural-log units) of one (query tile, key tile) pair, recomputed."""
    sc = mm(q, kt, False, EMU_FP32) * (scale * LOG2E)
    sc = tl.where((offs_s < cnt_k)[None, :], sc, float("-inf"))
    p = tl.exp2(sc - tl.where(lse == float("-inf"), 0.0, lse)[:, None])
    dp = mm(do, v_t, False, EMU_FP32)
    return p, p * (dp - delta[:, None])


@triton.jit
def _vsa_dq_kernel(
    Q, K, V, DO, IDX, CNT, LSE, DELTA, DQ, q_strides, k_strides, idx_strides, lse_strides,
    HQ, GROUP, D, KK, scale,
    TS: tl.constexpr, BLOCK_D: tl.constexpr, EMU_FP32: tl.constexpr,
):
    """dQ of one query tile. Strides: (batch, head, tile, slot, dim) of the query-side tiles ``Q``,
    ``DO``, ``DQ`` (``q_strides``) and of the key-side ``K``, ``V`` (``k_strides``); the rest as in
    :func:`_vsa_fwd_kernel`, ``DELTA`` as ``LSE``."""
    sqb, sqh, sqt, sqs, sqd = q_strides
    sib, sih, sit, sik = idx_strides
    slb, slh, slt, sls = lse_strides
    pid_t = tl.program_id(0)
    b, h, hk, offs_s, offs_d, dmask, cnt_q, qmask, q = _query_tile(
        Q, CNT, pid_t, HQ, GROUP, D, q_strides, TS, BLOCK_D)
    do = _tile(DO, b, h, pid_t, offs_s, offs_d, qmask, q_strides, False)
    lse_base = b * slb + h * slh + pid_t.to(tl.int64) * slt + offs_s * sls
    lse = tl.load(LSE + lse_base, mask=offs_s < cnt_q, other=float("-inf"))
    delta = tl.load(DELTA + lse_base, mask=offs_s < cnt_q, other=0.0)
    dq = tl.zeros([TS, BLOCK_D], dtype=tl.float32)
    for s in range(0, KK):
        j = tl.load(IDX + b * sib + h * sih + pid_t * sit + s * sik)
        cnt_k, kmask, kt = _key_tile(K, CNT, b, hk, j, offs_s, offs_d, dmask, k_strides)
        v_t = _tile(V, b, hk, j, offs_s, offs_d, kmask, k_strides, True)
        _, ds = _tile_ds(q, kt, v_t, do, lse, delta, cnt_k, offs_s, scale, EMU_FP32)
        k = _tile(K, b, hk, j, offs_s, offs_d, kmask, k_strides, False)
        dq += mm(ds.to(K.dtype.element_ty), k, False, EMU_FP32)
    base = DQ + b * sqb + h * sqh + pid_t.to(tl.int64) * sqt
    tl.store(base + offs_s[:, None] * sqs + offs_d[None, :] * sqd, (dq * scale).to(DQ.dtype.element_ty),
             mask=qmask)


@triton.jit
def _vsa_dkdv_kernel(
    Q, K, V, DO, RIDX, RCNT, CNT, LSE, DELTA, DK, DV,
    q_strides, k_strides, ridx_strides, rcnt_strides, lse_strides,
    HKV, GROUP, D, scale,
    TS: tl.constexpr, BLOCK_D: tl.constexpr, EMU_FP32: tl.constexpr,
):
    """dK and dV of one key tile. Strides: (batch, head, tile, slot, dim) of ``Q``, ``DO``
    (``q_strides``) and of ``K``, ``V``, ``DK``, ``DV`` (``k_strides``); (batch, head, key tile,
    entry) of ``RIDX``; (batch, head, key tile) of ``RCNT``; ``LSE`` and ``DELTA`` as in
    :func:`_vsa_dq_kernel`."""
    skb, skh, skt, sks, skd = k_strides
    srb, srh, srt, srk = ridx_strides
    srcb, srch, srct = rcnt_strides
    slb, slh, slt, sls = lse_strides
    pid_t = tl.program_id(0)
    b, hk, offs_s, offs_d, dmask, cnt_k, kmask = _own_tile(CNT, pid_t, HKV, D, TS, BLOCK_D)
    kt = _tile(K, b, hk, pid_t, offs_s, offs_d, kmask, k_strides, True)
    v_t = _tile(V, b, hk, pid_t, offs_s, offs_d, kmask, k_strides, True)
    dk = tl.zeros([TS, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([TS, BLOCK_D], dtype=tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        n_q = tl.load(RCNT + b * srcb + h * srch + pid_t * srct)
        for s in range(0, n_q):
            i = tl.load(RIDX + b * srb + h * srh + pid_t * srt + s * srk)
            cnt_q = tl.load(CNT + i)
            qmask = (offs_s < cnt_q)[:, None] & dmask[None, :]
            q = _tile(Q, b, h, i, offs_s, offs_d, qmask, q_strides, False)
            do = _tile(DO, b, h, i, offs_s, offs_d, qmask, q_strides, False)
            lse_base = b * slb + h * slh + i.to(tl.int64) * slt + offs_s * sls
            lse = tl.load(LSE + lse_base, mask=offs_s < cnt_q, other=float("-inf"))
            delta = tl.load(DELTA + lse_base, mask=offs_s < cnt_q, other=0.0)
            p, ds = _tile_ds(q, kt, v_t, do, lse, delta, cnt_k, offs_s, scale, EMU_FP32)
            dv += mm(tl.trans(p.to(DO.dtype.element_ty)), do, False, EMU_FP32)
            dk += mm(tl.trans(ds.to(Q.dtype.element_ty)), q, False, EMU_FP32)
    base_k = DK + b * skb + hk * skh + pid_t.to(tl.int64) * skt
    tl.store(base_k + offs_s[:, None] * sks + offs_d[None, :] * skd,
             (dk * scale).to(DK.dtype.element_ty), mask=kmask)
    base_v = DV + b * skb + hk * skh + pid_t.to(tl.int64) * skt
    tl.store(base_v + offs_s[:, None] * sks + offs_d[None, :] * skd, dv.to(DV.dtype.element_ty),
             mask=kmask)


_KEY = ["TS", "BLOCK_D"]
_fwd = autotuned(CONFIGS, key=_KEY + ["INT8_QK", "PV_FP8"])(
    triton.heuristics({"HAS_VSCALE": lambda a: a["VS"] is not None,
                       "HAS_VMEAN": lambda a: a["VM"] is not None})(_vsa_fwd_kernel))
_dq = autotuned(CONFIGS, key=_KEY)(_vsa_dq_kernel)
_dkdv = autotuned(CONFIGS, key=_KEY)(_vsa_dkdv_kernel)


def _consts(d: int):
    return dict(BLOCK_D=next_pow2(d), EMU_FP32=interpreter_enabled())


def _launch_fwd(qt, kt, vt, qs, ks, vs, vm, idx, counts, out, lse, *, scale: float, int8: bool,
                pv_fp8: bool):
    b, hq, nt, ts, d = qt.shape
    _fwd[(nt, b * hq)](
        Q=qt, K=kt, V=vt, QS=qs, KS=ks, VS=vs, VM=vm, IDX=idx, CNT=counts, O=out, LSE=lse,
        q_strides=qt.stride(), k_strides=kt.stride(), v_strides=vt.stride(),
        idx_strides=idx.stride(), o_strides=out.stride(), lse_strides=strides(lse, 4),
        qs_strides=strides(qs, 4), ks_strides=strides(ks, 4),
        vs_strides=strides(vs if vs is not None else vm, 3),
        HQ=hq, GROUP=hq // kt.shape[1], D=d, KK=idx.shape[-1], scale=float(scale), TS=ts,
        BLOCK_D=next_pow2(d, minimum=32 if int8 else 16), EMU_FP32=interpreter_enabled(),
        INT8_QK=int8, PV_FP8=pv_fp8, EXACT_FP8=exact_fp8(),
    )


def forward(qt, kt, vt, idx, counts, *, scale: float):
    """Padded tiles ``qt [B, Hq, nt, TS, D]``, ``kt, vt [B, Hkv, nt, TS, D]`` (contiguous), index
    lists ``idx [B, Hq, nt, k]`` int32 and tile sizes ``counts [nt]`` int32 →
    ``(out [B, Hq, nt, TS, D]`` (zero past a tile's count), ``lse [B, Hq, nt, TS]`` fp32, base 2
    (``-inf`` there))."""
    b, hq, nt, ts, d = qt.shape
    out = torch.zeros_like(qt)
    lse = torch.full((b, hq, nt, ts), float("-inf"), device=qt.device, dtype=torch.float32)
    _launch_fwd(qt, kt, vt, None, None, None, None, idx, counts, out, lse, scale=scale,
                int8=False, pv_fp8=False)
    return out, lse


def forward_int8(qz: QuantizedQKV, idx, counts, *, out_dtype: torch.dtype) -> torch.Tensor:
    """The 8-bit fine stage on padded tiles: ``qz`` holds INT8 ``q [B, Hq, nt, TS, D]``,
    ``k [B, Hkv, nt, TS, D]``, their per-token scales ``[B, H, nt, TS]`` (Q's times
    ``scale·log2 e``; zeros in empty slots), V in E4M3 or fp16 with its ``v_scale`` (optional for
    fp16), ``v_mean`` optional → ``out [B, Hq, nt, TS, D]`` in ``out_dtype``. TS ≥ 32 (the FP8
    MMA's depth)."""
    out = torch.zeros(qz.q.shape, device=qz.q.device, dtype=out_dtype)
    _launch_fwd(qz.q, qz.k, qz.v, qz.q_scale, qz.k_scale, qz.v_scale, qz.v_mean, idx, counts, out,
                None, scale=1.0, int8=True, pv_fp8=qz.v.dtype == torch.float8_e4m3fn)
    return out


def reverse_lists(idx: torch.Tensor, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each key tile, the query tiles that chose it: ``(ridx [B, Hq, nt, nt]`` int32, the
    first ``rcount`` entries valid, ``rcount [B, Hq, nt]`` int32)."""
    b, hq, nt, _ = idx.shape
    chosen = torch.zeros((b, hq, nt, n_tiles), dtype=torch.bool, device=idx.device)
    chosen.scatter_(-1, idx.long(), True)
    by_key = chosen.transpose(-1, -2)                        # [B, Hq, key tile, query tile]
    order = torch.argsort((~by_key).to(torch.int8), dim=-1, stable=True)
    return order.to(torch.int32).contiguous(), by_key.sum(-1).to(torch.int32)


def backward(qt, kt, vt, ot, lse, dot, idx, counts, *, scale: float, kernel: str = "triton"):
    """``(dq, dk, dv)`` padded tiles for the fine stage's forward ``ot, lse``; with
    ``kernel="sm90"``, on the Gluon backward loops for Hopper
    (``training.kernel_bwd_sm90.vsa_backward``) where they apply."""
    b, hq, nt, ts, d = qt.shape
    hkv = kt.shape[1]
    if dot.stride() != qt.stride():
        dot = dot.contiguous()
    delta = (dot.float() * ot.float()).sum(-1).contiguous()
    dq, dk, dv = torch.zeros_like(qt), torch.zeros_like(kt), torch.zeros_like(vt)
    ridx, rcount = reverse_lists(idx, nt)
    if kernel == "sm90" and triton_support.gluon_available("hopper"):
        from lowbit_attn.training import kernel_bwd_sm90

        if kernel_bwd_sm90.vsa_refusal(qt, d) is None:
            kernel_bwd_sm90.vsa_backward(qt, kt, vt, dot, lse, delta, idx, (ridx, rcount),
                                         counts, dq, dk, dv, scale=scale)
            return dq, dk, dv
    _dq[(nt, b * hq)](
        Q=qt, K=kt, V=vt, DO=dot, IDX=idx, CNT=counts, LSE=lse, DELTA=delta, DQ=dq,
        q_strides=qt.stride(), k_strides=kt.stride(), idx_strides=idx.stride(),
        lse_strides=lse.stride(), HQ=hq, GROUP=hq // hkv, D=d, KK=idx.shape[-1],
        scale=float(scale), TS=ts, **_consts(d),
    )
    _dkdv[(nt, b * hkv)](
        Q=qt, K=kt, V=vt, DO=dot, RIDX=ridx, RCNT=rcount, CNT=counts, LSE=lse, DELTA=delta,
        DK=dk, DV=dv, q_strides=qt.stride(), k_strides=kt.stride(), ridx_strides=ridx.stride(),
        rcnt_strides=rcount.stride(), lse_strides=lse.stride(), HKV=hkv, GROUP=hq // hkv, D=d,
        scale=float(scale), TS=ts, **_consts(d),
    )
    return dq, dk, dv
