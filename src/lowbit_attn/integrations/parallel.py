"""Sequence-parallel attention over ``torch.distributed`` (forward only, for inference).

Both functions take the *local shard* of every rank of ``group``: the sequence dimension of q, k and
v split evenly and contiguously over the ``P`` ranks, rank ``r`` (its rank in ``group``) holding
tokens ``[r·n, (r+1)·n)``. Each returns the output for its own query tokens, as if
:func:`lowbit_attn.attention` had run on the whole sequences and the result been split the same way.

:func:`ulysses_attention` (DeepSpeed-Ulysses)
    One all-to-all turns sequence-sharded q (and one k, v) ``[B, H, n, D]`` into head-sharded
    ``[B, H/P, P·n, D]``; each rank runs :func:`~lowbit_attn.attention` on whole sequences for its
    heads, and one all-to-all turns the output back. Needs ``Hq % P == 0``; K/V heads are
    replicated when ``Hkv`` is not a multiple of ``P``. With ``Hkv % P == 0`` every rank holds
    whole GQA groups and the result equals a single-device call bit for bit; with replicated K/V
    heads, Q·K balancing (per K/V head, over its query heads) sees only the local query heads, so
    low-bit results differ slightly (exact ones do not).
:func:`ring_attention`
    The K/V chunks travel around the ring of ranks in ``P`` steps (the next transfer overlaps the
    current step's attention); each step attends the local queries to one chunk and the partial
    results are merged with their log-sum-exp. Any head counts. Each K/V chunk is smoothed and
    quantized on its own, so low-bit results differ slightly from a single-device call (within the
    recipes' accuracy bars).

Errors: every rank checks its own inputs, then one small all-gather lets all ranks compare what
they found (their errors, shapes, dtype, layout, ``is_causal``, recipe and scale), so a bad argument
on one rank makes *every* rank raise the same exception instead of leaving the others blocked in a
collective. Any other exception raised before that exchange (an ``OverflowError``, a bug) reaches
every rank too: the rank where it happened re-raises it, the others raise a ``RuntimeError`` naming
that rank, the exception's type and its message. A rank that never makes the call (crashed, or
stuck elsewhere) cannot be detected this way: the process group's timeout, set by the caller with
``init_process_group(timeout=...)``, is what bounds the wait then.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.distributed as dist

from lowbit_attn.core import checks
from lowbit_attn.core.recipes import resolve_for
from lowbit_attn.inference import attention
from lowbit_attn.core.recipes import Recipe

# Bytes each rank contributes to the agreement all-gather (ASCII JSON, zero-padded). Every text in
# a report is cut to _MAX_TEXT_CHARS characters plus a marker of < 80 bytes; a character takes at
# most 12 bytes of ASCII JSON (one beyond the BMP becomes two \uXXXX escapes), so the 3 texts of a
# report (an error's type and message; or dtype, layout and recipe) take < 6000 bytes and its
# numbers and shapes < 600.
_REPORT_BYTES = 8192
_MAX_TEXT_CHARS = 160
# Errors every rank raises alike; any other exception is re-raised where it happened.
_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "HND",
    recipe: str | Recipe = "auto",
) -> torch.Tensor:
    """Sequence-parallel attention by head resharding (DeepSpeed-Ulysses).

    One all-to-all turns the sequence-sharded inputs into head-sharded whole sequences, each rank
    runs :func:`lowbit_attn.attention` for its heads, and one all-to-all turns the output back.

    Args:
        q: this rank's query tokens, ``[B, Hq, n, D]`` (``"HND"``) or ``[B, n, Hq, D]`` (``"NHD"``);
            the same shape, dtype and arguments on every rank of ``group``. ``Hq`` must be a
            multiple of the group size ``P``.
        k: this rank's key tokens, ``[B, Hkv, n_k, D]`` (or NHD); ``Hq`` a multiple of ``Hkv``.
            When ``Hkv`` is not a multiple of ``P`` each K/V head is replicated
            ``P / gcd(Hkv, P)`` times before the exchange (query head ``h`` still reads K/V head
            ``h // (Hq / Hkv)``), which costs that factor in K/V traffic.
        v: this rank's value tokens, k's shape.
        group: the process group the sequence is sharded over; ``None`` for the default group.
        is_causal: as in :func:`lowbit_attn.attention`, over the whole sequences (aligned
            bottom-right over ``P·n`` queries and ``P·n_k`` keys).
        scale: softmax scale, ``D ** -0.5`` by default.
        layout: ``"HND"`` or ``"NHD"``.
        recipe: as in :func:`lowbit_attn.attention`.

    Returns:
        This rank's ``n`` query tokens of the output, q's dtype, shape and layout.

    Raises:
        TypeError: on every rank alike, when any rank's inputs fail a type check of
            :func:`lowbit_attn.attention`.
        ValueError: on every rank alike, when any rank's inputs are invalid (as
            :func:`lowbit_attn.attention` checks them, or ``Hq`` not a multiple of ``P``) or
            differ from the other ranks' (shapes, dtype, layout, ``is_causal``, recipe or scale);
            a ``group`` that does not contain this process.
        RuntimeError: ``torch.distributed`` is not initialized; on the other ranks, when one
            rank's checks raised another exception (which that rank re-raises).

    Examples:
        >>> import tempfile, torch, torch.distributed as dist
        >>> from lowbit_attn import parallel
        >>> # a group of one process here; torchrun's otherwise
        >>> store = tempfile.mkdtemp() + "/store"
        >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
        ...                         world_size=1)
        >>> # NHD: this rank's tokens, all heads
        >>> q = torch.randn(1, 64, 4, 32)
        >>> k = v = torch.randn(1, 64, 2, 32)              # GQA 2:1
        >>> parallel.ulysses_attention(q, k, v, layout="NHD").shape
        torch.Size([1, 64, 4, 32])
        >>> dist.destroy_process_group()
    """
    group, _, world = _group_info(group)
    qh, kh, vh, r, sm_scale, is_causal = _agreed_inputs(
        "ulysses_attention", q, k, v, group=group, is_causal=is_causal, scale=scale,
        layout=layout, recipe=recipe, extra_check=lambda qh, kh: _ulysses_heads(qh, world),
    )
    replicas = world // math.gcd(kh.shape[1], world)
    if replicas > 1:
        kh, vh = (x.repeat_interleave(replicas, dim=1) for x in (kh, vh))
    b = kh.shape[0]
    q_full = _seq_to_heads(qh, group, world)
    kv_full = _seq_to_heads(torch.cat((kh, vh)), group, world)
    out = attention(q_full, kv_full[:b], kv_full[b:], is_causal=is_causal, scale=sm_scale,
                    recipe=r)
    return _heads_to_seq(out, group, world, nhd=layout == "NHD")


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "HND",
    recipe: str | Recipe = "auto",
) -> torch.Tensor:
    """Sequence-parallel attention by passing K/V chunks around a ring of ranks.

    Each of the ``P`` steps computes ``attention(..., return_lse=True)`` of the local queries
    against one K/V chunk while the chunk is sent on to the next rank (``dist.batch_isend_irecv``,
    double-buffered); the partial outputs are merged in fp32 with their log-sum-exp.

    Args:
        q: as for :func:`ulysses_attention`, with any head count.
        k: as for :func:`ulysses_attention`; with ``is_causal``, ``n_k`` must equal ``n``.
        v: this rank's value tokens, k's shape.
        group: the process group the sequence is sharded over; ``None`` for the default group.
        is_causal: over the whole sequences: the queries of chunk ``i`` attend fully to K/V
            chunks ``j < i``, causally to chunk ``i`` and not at all to ``j > i`` (those steps only
            forward the chunk).
        scale: as for :func:`ulysses_attention`.
        layout: likewise.
        recipe: likewise.

    Returns:
        This rank's ``n`` query tokens of the output, q's dtype, shape and layout.

    Raises:
        TypeError: as :func:`ulysses_attention`.
        ValueError: as :func:`ulysses_attention`, with a causal call whose ``n_k`` is not ``n``
            in place of the head count.
        RuntimeError: as :func:`ulysses_attention`.

    Examples:
        >>> import tempfile, torch, torch.distributed as dist
        >>> from lowbit_attn import parallel
        >>> # a group of one process here; torchrun's otherwise
        >>> store = tempfile.mkdtemp() + "/store"
        >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
        ...                         world_size=1)
        >>> # this rank's slice of the tokens
        >>> q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
        >>> parallel.ring_attention(q, k, v, is_causal=True).shape
        torch.Size([1, 2, 64, 32])
        >>> dist.destroy_process_group()
    """
    group, rank, world = _group_info(group)
    qh, kh, vh, r, sm_scale, is_causal = _agreed_inputs(
        "ring_attention", q, k, v, group=group, is_causal=is_causal, scale=scale, layout=layout,
        recipe=recipe, extra_check=lambda qh, kh: _ring_lengths(qh, kh, is_causal),
    )
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    out_h = out.transpose(1, 2) if layout == "NHD" else out
    lse = torch.full(qh.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack((kh, vh))
    buffers = [kv, torch.empty_like(kv)]  # the K/V chunk attended to, the one arriving
    send_to = dist.get_global_rank(group, (rank + 1) % world)
    recv_from = dist.get_global_rank(group, (rank - 1) % world)
    for step in range(world):
        chunk = (rank - step) % world  # the rank whose K/V tokens buffers[0] holds
        pending = []
        if step < world - 1:
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, buffers[0], send_to, group),
                dist.P2POp(dist.irecv, buffers[1], recv_from, group),
            ])
        if not (is_causal and chunk > rank):
            k_chunk, v_chunk = buffers[0]
            o, o_lse = attention(qh, k_chunk, v_chunk, is_causal=is_causal and chunk == rank,
                                 scale=sm_scale, recipe=r, return_lse=True)
            _merge_partial(out_h, lse, o, o_lse)
        for work in pending:
            work.wait()
        buffers.reverse()
    return out.to(q.dtype)


def _merge_partial(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor,
                   o_lse: torch.Tensor) -> None:
    """Merge a partial attention result into a running one, in place.

    ``out`` ``[B, H, N, D]`` fp32 and ``lse`` ``[B, H, N]`` fp32 are the output and log-sum-exp over
    the keys seen so far; ``o`` (any float dtype) and ``o_lse`` the same over other keys. Afterwards
    they cover both key sets: ``lse ← log(e^lse + e^o_lse)`` and ``out`` the matching weighted mean,
    computed relative to ``m = max(lse, o_lse)`` so nothing overflows. Rows with ``-inf`` on both
    sides (no key seen yet) stay ``out = 0, lse = -inf``, without NaN.
    """
    m = torch.maximum(lse, o_lse)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_out = torch.exp(lse - m)
    w_o = torch.exp(o_lse - m)
    total = w_out + w_o  # in [1, 2] unless both sides are -inf (then 0)
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out.mul_((w_out / denom).unsqueeze(-1)).add_(o.float() * (w_o / denom).unsqueeze(-1))
    lse.copy_(m + torch.log(total))


def _group_info(group):
    """``(group, rank in group, group size)`` with ``None`` meaning the default group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() on "
            "every rank first (sequence-parallel attention runs over a process group)"
        )
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"group must contain this process (global rank {dist.get_rank()}), it does not"
        )
    return group, rank, dist.get_world_size(group)


def _ulysses_heads(qh: torch.Tensor, world: int) -> None:
    if qh.shape[1] % world != 0:
        raise ValueError(
            f"ulysses_attention needs the number of query heads ({qh.shape[1]}) to be a multiple "
            f"of the group size ({world}); use ring_attention for these heads"
        )


def _ring_lengths(qh: torch.Tensor, kh: torch.Tensor, is_causal: bool) -> None:
    if is_causal and qh.shape[2] != kh.shape[2]:
        raise ValueError(
            f"causal ring_attention needs as many local query as key tokens, got q with "
            f"{qh.shape[2]} and k with {kh.shape[2]}"
        )


def _local_inputs(q, k, v, *, is_causal, scale, layout, recipe, extra_check):
    """This rank's own checks (as :func:`lowbit_attn.attention` makes them, plus
    ``extra_check(qh, kh)``); returns the HND views, the recipe and the scale."""
    qh, kh, vh = checks.dense_qkv(q, k, v, layout)
    is_causal = checks.flag("is_causal", is_causal)
    checks.forward_only(q, k, v)
    r = resolve_for(recipe, q.device)
    checks.recipe_fits(r, q.shape[-1])
    sm_scale = checks.softmax_scale(scale, q.shape[-1])
    extra_check(qh, kh)
    return qh, kh, vh, r, sm_scale, is_causal


def _agreed_inputs(name, q, k, v, *, group, is_causal, scale, layout, recipe, extra_check):
    """:func:`_local_inputs` on every rank, then one all-gather of each rank's report (its
    exception, or what it was called with): every rank raises unless all ranks succeeded with the
    same shapes and arguments. Returns :func:`_local_inputs`' result."""
    error = None
    try:
        args = _local_inputs(q, k, v, is_causal=is_causal, scale=scale, layout=layout,
                             recipe=recipe, extra_check=extra_check)
    except Exception as e:  # noqa: BLE001 -- whatever it is, the other ranks must hear of it
        error = e
        kind = next((n for n, t in _ERROR_TYPES.items() if isinstance(e, t)), type(e).__name__)
        report = {"error": kind, "message": str(e)}
    else:
        qh, kh, _, r, sm_scale, causal = args
        report = {
            "q shape": list(q.shape), "k and v shape": list(k.shape),
            "dtype": str(q.dtype).removeprefix("torch."), "layout": layout,
            "is_causal": causal, "scale": sm_scale, "recipe": repr(r),
        }
    reports = _all_gather_reports(report, group)
    _raise_if_any_failed(name, reports, error)
    _raise_if_different(name, reports)
    return args


def _clip(text: str) -> str:
    """``text`` cut to ``_MAX_TEXT_CHARS`` characters when longer, with a marker giving its length
    and a digest of the whole (so two long texts that differ only after the cut still differ)."""
    if len(text) <= _MAX_TEXT_CHARS:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{text[:_MAX_TEXT_CHARS]}… [cut: {len(text)} characters in all, sha256 {digest}]"


def _all_gather_reports(report: dict, group) -> list[dict]:
    """Every rank's ``report`` (a small dict of ints, floats, bools, lists of ints and texts; texts
    longer than ``_MAX_TEXT_CHARS`` are clipped), in group rank order."""
    report = {key: _clip(value) if isinstance(value, str) else value
              for key, value in report.items()}
    data = json.dumps(report).encode()  # ASCII: any text encodes, at most 12 bytes a character
    device = _collective_device(group)
    mine = torch.zeros(_REPORT_BYTES, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [json.loads(bytes(t.cpu().tolist()).rstrip(b"\0")) for t in gathered]


def _collective_device(group) -> torch.device:
    """NCCL groups move only CUDA tensors; the other backends take CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_if_any_failed(name: str, reports: list[dict], error: Exception | None) -> None:
    """Raise if any rank's report holds an error. ``error`` is this rank's own exception: one that
    is not a ValueError/TypeError is re-raised as it is; otherwise every rank raises the same
    exception about the first failed rank (its ValueError/TypeError, or a RuntimeError naming the
    unexpected exception)."""
    failed = [i for i, rep in enumerate(reports) if "error" in rep]
    if not failed:
        return
    if error is not None and not isinstance(error, tuple(_ERROR_TYPES.values())):
        raise error
    first = reports[failed[0]]
    also = f" (and on rank(s) {', '.join(map(str, failed[1:]))})" if len(failed) > 1 else ""
    if first["error"] in _ERROR_TYPES:
        raise _ERROR_TYPES[first["error"]](
            f"{name}: invalid inputs on rank {failed[0]}{also}: {first['message']}"
        ) from error
    raise RuntimeError(
        f"{name}: rank {failed[0]}{also} raised {first['error']} before the ranks exchanged "
        f"their inputs: {first['message']}"
    ) from error


def _raise_if_different(name: str, reports: list[dict]) -> None:
    for key, value in reports[0].items():
        for i, rep in enumerate(reports[1:], start=1):
            if rep[key] != value:
                raise ValueError(
                    f"{name}: {key} must be the same on every rank of the group, got "
                    f"{_show(value)} on rank 0 and {_show(rep[key])} on rank {i}"
                )


def _show(value) -> str:
    return str(tuple(value)) if isinstance(value, list) else repr(value)


def _seq_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[B, H, n, D]`` holding this rank's tokens of all heads → ``[B, H/P, P·n, D]`` holding all
    tokens of this rank's ``H/P`` heads (one all-to-all)."""
    b, h, n, d = x.shape
    send = x.reshape(b, world, h // world, n, d).transpose(0, 1).contiguous()  # [P, B, H/P, n, D]
    recv = torch.empty_like(send)  # recv[r]: rank r's tokens of our heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * n, d)


def _heads_to_seq(x: torch.Tensor, group, world: int, *, nhd: bool) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`, returned contiguous in ``[B, H, n, D]`` or, with
    ``nhd``, ``[B, n, H, D]``."""
    b, h_local, n_total, d = x.shape
    n = n_total // world
    send = x.reshape(b, h_local, world, n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # recv[r]: our tokens of rank r's heads, [P, B, H/P, n, D]
    dist.all_to_all_single(recv, send, group=group)
    if nhd:
        return recv.permute(1, 3, 0, 2, 4).contiguous().view(b, n, world * h_local, d)
    return recv.permute(1, 0, 2, 3, 4).contiguous().view(b, world * h_local, n, d)


__all__ = ["ring_attention", "ulysses_attention"]
