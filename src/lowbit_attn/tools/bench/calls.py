"""What each method calls (our public call or one of its stages, SDPA on one backend,
SageAttention), and the SDPA reference every method is checked against."""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import torch

from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.recipes import resolve
from lowbit_attn.integrations.sdpa import TORCH_SDPA
from lowbit_attn.tools.bench.protocol import SAGE_VERSION, Method


@contextlib.contextmanager
def environment(**values: str | None):
    """The environment variables ``values`` set for the block (``None``: unset, the library's
    default), each restored after it: how the scripts time an option's value."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _set(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set(name, value)


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class Unsupported(Exception):
    """The backend cannot run this configuration (recorded, not an error)."""


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


def reference_output(q, k, v, causal: bool) -> tuple[torch.Tensor, str]:
    """The reference every method is checked against, on the same input values: on a GPU SDPA
    flash in fp16 (bf16 inputs convert to fp16 exactly at these magnitudes; memory-efficient and
    math backends as fallbacks), on a CPU SDPA math in fp32."""
    from torch.nn.attention import sdpa_kernel

    if q.device.type != "cuda":
        with sdpa_kernel([_sdpa_backend("MATH")]):
            out = TORCH_SDPA(q.float(), k.float(), v.float(), is_causal=causal)
        return out, "sdpa_math_fp32"
    x = [t.to(torch.float16) for t in (q, k, v)]
    errors = []
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([_sdpa_backend(name)]):
                    out = TORCH_SDPA(*x, is_causal=causal)
            return out, f"sdpa_{name.split('_')[0].lower()}_fp16"
        except RuntimeError as exc:  # no kernel for this case, or OOM of the math backend
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            errors.append(f"{name}: {first_line(exc)}")
    raise Unsupported("no SDPA reference could run: " + "; ".join(errors))


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``"<ExceptionType>: <first line of its message>"``, at most ``limit`` characters."""
    text = str(exc).strip().splitlines()
    msg = f"{type(exc).__name__}: {text[0] if text else ''}"
    return msg[:limit]


def _sdpa_fn(method: Method, q, k, v, causal):
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backend(method.backend)

    def fn():
        return TORCH_SDPA(q, k, v, is_causal=causal)

    return fn, (lambda: sdpa_kernel([backend]))


def _sage_fn(method: Method, q, k, v, causal):
    if q.device.type != "cuda":
        raise Unsupported("sageattention needs CUDA tensors")
    if q.shape[-1] not in (64, 96, 128):
        raise Unsupported(f"sageattention supports head dims 64, 96, 128 (got {q.shape[-1]})")
    try:
        from sageattention import sageattn
    except ImportError as exc:
        raise Unsupported(
            f"sageattention is not importable ({first_line(exc)}); install "
            f"sageattention=={SAGE_VERSION} (carry "
            f"wheels/sageattention-{SAGE_VERSION}-py3-none-any.whl)"
        ) from None
    # sageattn smooths K in place (k -= mean): give it its own copy; after the first call the copy
    # has zero mean, so later calls compute the same function on the same values.
    k_own = k.clone()

    def fn():
        return sageattn(q, k_own, v, tensor_layout="HND", is_causal=causal)

    return fn, contextlib.nullcontext


def _ours_fn(method: Method, q, k, v, causal):
    from lowbit_attn.inference import attention

    def fn():
        return attention(q, k, v, is_causal=causal, recipe=method.recipe)

    return fn, contextlib.nullcontext


def _stage_fn(method: Method, q, k, v, causal):
    """Our call split in its two stages, as ``inference.op.run`` does on the Triton backend."""
    if backend_for(q.device) != "triton":
        raise Unsupported("stage timings need the Triton backend (a CUDA GPU, or "
                          "LOWBIT_ATTN_BACKEND=triton with TRITON_INTERPRET=1)")
    from lowbit_attn.inference import kernel_fp4 as attn_fwd_fp4, kernel_int8 as attn_fwd_int8
    from lowbit_attn.inference.prepare import quantize_qkv, quantize_qkv_fp4

    cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    r = resolve(method.recipe, cap)
    scale = q.shape[-1] ** -0.5
    if r.is_fp4:
        def prepare():
            return quantize_qkv_fp4(q, k, v, r, scale, need_lse_shift=False, backend="triton")
    else:
        def prepare():
            return quantize_qkv(q, k, v, r, scale, need_lse_shift=False, backend="triton")

    if method.backend == "prepare":
        return prepare, contextlib.nullcontext
    qz = prepare()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    offset = 0 if causal else None

    def attend():
        if r.is_fp4:
            attn_fwd_fp4.attention(
                qz, out=out, head_dim=q.shape[-1], block_q=r.block_q, block_k=r.block_k,
                causal_offset=offset, two_level=r.two_level_p, return_lse=False,
            )
        else:
            attn_fwd_int8.attention(
                qz, out=out, pv=r.pv, granularity=r.granularity, block_q=r.block_q,
                block_k=r.block_k, causal_offset=offset, return_lse=False,
            )
        return out

    return attend, contextlib.nullcontext


BUILDERS = {
    "ours": _ours_fn,
    "cpu_reference": _ours_fn,
    "stage": _stage_fn,
    "sdpa": _sdpa_fn,
    "sage": _sage_fn,
}


def autotune_choice() -> str | None:
    """The config the INT8 attention kernel's autotuner chose last (``None`` when unknown)."""
    try:
        from lowbit_attn.inference import kernel_int8 as attn_fwd_int8

        best = getattr(attn_fwd_int8._attn_fwd_int8, "best_config", None)
        return None if best is None else str(best)
    except Exception:  # diagnostic only; the kernel module may change
        return None


# How long a benchmark waits for the admission checks of opt-in kernels (each starts in the
# background on its kernel's first call) before it measures what runs. Not measured yet: NOTES
# §18 estimates ~4 s with Triton's cache warm, 36 s (forward) and 53 s (backward) cold, and such
# estimates have run 1.6-3x optimistic. In the GPU stages the admission probe leaves its verdict
# on disk, so no check runs there; this bounds the other case, and a check that hangs.
ADMISSION_WAIT_S = 90.0


def await_admission(row: dict) -> None:
    """Wait, at most :data:`ADMISSION_WAIT_S`, for the admission checks this process started, and
    record in ``row`` the seconds waited (``admission_wait_s``) and each kernel's verdict
    (``admission``: ``"admitted"``, why not, or that its check is still running: the calls that
    follow then run the Triton kernel)."""
    from lowbit_attn.inference import gluon_check

    t0 = time.perf_counter()
    verdicts = gluon_check.wait_for_admission(timeout=ADMISSION_WAIT_S)
    row["admission_wait_s"] = time.perf_counter() - t0
    row["admission"] = {kernel: verdict or "admitted" for kernel, verdict in verdicts.items()}
