"""Argument validation for the public functions: each error names the argument, what it got and what
it needs."""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# read on every call: bound once
_is_compiling = torch.compiler.is_compiling
_any_autocast = torch._C._is_any_autocast_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad
LAYOUTS = ("HND", "NHD")
MAX_HEAD_DIM = 256


def tensor(name: str, x, ndim: int, dtypes: tuple = FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        raise TypeError(f"{name} must be {', '.join(names[:-1])} or {names[-1]}, got {x.dtype}")


def same_kind(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def layout(value) -> None:
    if value not in LAYOUTS:
        raise ValueError(f"layout must be 'HND' ([B, H, N, D]) or 'NHD' ([B, N, H, D]), got {value!r}")


def shown(value) -> str:
    """``type value`` for messages, e.g. ``int 1``, ``numpy.float32 0.25`` (long reprs cut)."""
    kind = type(value)
    kind_name = kind.__name__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__name__}")
    big = isinstance(value, int) and value.bit_length() > 64  # its repr may be thousands of digits
    text = f"~{'-' if value < 0 else ''}1e{int(math.log10(abs(value)))}" if big else repr(value)
    return f"{kind_name} {text if len(text) <= 60 else text[:57] + '...'}"


def is_numpy_bool(value) -> bool:
    """``numpy.bool_`` (``numpy.bool`` in NumPy 2), recognised without importing NumPy."""
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def concrete(value):
    """A number that ``torch.compile`` traces symbolically (``SymInt``, ``SymFloat``,
    ``SymBool``: a size, or arithmetic on one, under ``dynamic=True``) as the Python number it
    is, so the checks read it as eager code does (one guard on its value, no graph break);
    anything else unchanged."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    return value


def flag(name: str, value) -> bool:
    """A bool argument: ``bool`` or ``numpy.bool_``, returned as a Python ``bool`` (the custom ops'
    schemas and ``==`` between recipes need one type)."""
    value = concrete(value)
    if isinstance(value, bool) or is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {shown(value)}")


def positive_int(name: str, value, *, at_most: int | None = None) -> int:
    """A count argument: an int (not a bool) from 1 (to ``at_most``), returned as a Python int."""
    value = concrete(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {shown(value)}")
    if value < 1 or (at_most is not None and value > at_most):
        bound = f"between 1 and {at_most}" if at_most is not None else "at least 1"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def integer(name: str, value, allowed: tuple[int, ...]) -> int:
    """An int argument from ``allowed``: an ``int`` or NumPy integer (not a bool, not a float),
    returned as a Python ``int``."""
    value = concrete(value)
    if isinstance(value, bool) or is_numpy_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {shown(value)}")
    if value not in allowed:
        raise ValueError(
            f"{name} must be {', '.join(map(str, allowed[:-1]))} or {allowed[-1]}, got {value!r}"
        )
    return int(value)


def choice(name: str, value, allowed: tuple[str, ...]) -> str:
    """A str argument from ``allowed``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {allowed}, got {shown(value)}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def identifier(name: str, value) -> str:
    """A name that is a Python identifier (letters, digits, ``_``; so ``;``, ``=``, ``,`` and
    spaces never appear in the text forms that carry it)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {shown(value)}")
    if not value.isidentifier():
        raise ValueError(
            f"{name} must be a Python identifier (letters, digits and '_'), got {value!r}"
        )
    return value


# The kernels take a scale or a softcap c in fp32 with log2 e folded in (c·log2 e, and 2/c):
# what stays a normal fp32 number through that, so that no kernel flushes it to 0 or rounds it
# to ∞ (either would give NaN or a silently different softmax).
FP32_NORMAL_RANGE = (2.0**-125, 2.0**126)


def positive_float(name: str, value, *,
                   top: tuple[float, str] = (FP32_NORMAL_RANGE[1],
                                             "2**126 (the kernels compute in float32)")) -> float:
    """``value`` (a real number: int, float or NumPy scalar) as a float, positive, finite and
    within :data:`FP32_NORMAL_RANGE` (about 2.4e-38 to 8.5e37), or up to ``top`` (the bound and
    how the error names it); else ``TypeError`` or ``ValueError`` naming ``name``."""
    value = concrete(value)
    if isinstance(value, bool) or is_numpy_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {shown(value)}")
    try:
        got = float(value)
    except OverflowError:
        got = math.inf
    if not 0 < got < math.inf:  # NaN fails too (comparisons, which a traced number takes)
        raise ValueError(f"{name} must be a positive finite number, got {shown(value)}")
    if not FP32_NORMAL_RANGE[0] <= got <= top[0]:
        raise ValueError(f"{name} must be between 2**-125 and {top[1]}, got {shown(value)}")
    return got


def softmax_scale(scale, head_dim: int) -> float:
    """``scale`` (:func:`positive_float`) as a float, or ``D ** -0.5`` for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return positive_float("scale", scale)


def heads_and_dims(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...],
    *, batch_dim: int | None, head_dim_axis: int, seq_axis: int | None,
) -> None:
    """Shared checks of (batch,) heads, head dim and K/V agreement; axes index the given shapes."""
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape, got {k_shape} and {v_shape}")
    if batch_dim is not None and q_shape[batch_dim] != k_shape[batch_dim]:
        raise ValueError(
            f"q and k must have the same batch size, got {q_shape[batch_dim]} and {k_shape[batch_dim]}"
        )
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"q and k must have the same head dim, got {q_shape[-1]} and {k_shape[-1]}"
        )
    d = q_shape[-1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    hq, hkv = q_shape[head_dim_axis], k_shape[head_dim_axis]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of key/value "
            f"heads ({hkv})"
        )
    if seq_axis is not None and k_shape[seq_axis] == 0:
        raise ValueError(f"k and v must hold at least one token, got shape {k_shape}")


def dense_qkv(q, k, v, qkv_layout: str, dtypes: tuple = FLOAT_DTYPES):
    """Checks shared by the dense public functions: 4-D tensors of one dtype (from ``dtypes``) and
    device, a known layout, heads and head dims that fit. Returns the ``[B, H, N, D]`` views."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        tensor(name, x, 4, dtypes=dtypes)
    layout(qkv_layout)
    same_kind(q, k, v)
    heads, seq = (2, 1) if qkv_layout == "NHD" else (1, 2)  # the caller's shapes in the messages
    heads_and_dims(tuple(q.shape), tuple(k.shape), tuple(v.shape), batch_dim=0,
                   head_dim_axis=heads, seq_axis=seq)
    return tuple(x.transpose(1, 2) if qkv_layout == "NHD" else x for x in (q, k, v))


def on_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    """The tensor argument ``name`` lies on ``device``."""
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")


def cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device, *,
               values: bool = True) -> list[int] | None:
    """Validate a ``cu_seqlens`` tensor; with ``values``, also its offsets, read on the host (one
    small copy: a GPU synchronisation), and return them."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor of batch+1 offsets, got dtype {cu.dtype}, "
            f"shape {tuple(cu.shape)}"
        )
    on_device(name, cu, device)
    if not values:
        return None
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"{name} must start at 0 and end at the number of packed tokens ({total}), "
            f"got {bounds[0]} … {bounds[-1]}"
        )
    if any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"{name} must be non-decreasing, got {bounds}")
    return bounds


def same_sequence_count(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """Two offset tensors (checked by :func:`cu_seqlens`) for the same sequences."""
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )


def max_seqlen(name: str, value, bounds: list[int] | None) -> int:
    """``max_seqlen_q`` or ``max_seqlen_k``: an int at least the longest sequence of ``bounds``
    (offsets from :func:`cu_seqlens`; None: not read, any int from 0)."""
    longest = 0 if bounds is None else max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if isinstance(value, bool) or is_numpy_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (>= the longest sequence, {longest}), got "
                        f"{shown(value)}")
    if value < longest:
        raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), got {value!r}")
    return int(value)  # a NumPy integer too: the custom op takes an int


def sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
              dtypes: tuple = FLOAT_DTYPES) -> list[tuple[int, int, int, int]]:
    """A packed call's ``[total, H, D]`` q, k, v, offsets and maxima, checked (the offsets read on
    the host), as each sequence's ``(q0, q1, k0, k1)`` rows: for code that runs one call per
    sequence."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        tensor(name, x, 3, dtypes)
    same_kind(q, k, v)
    heads_and_dims(tuple(q.shape), tuple(k.shape), tuple(v.shape), batch_dim=None,
                   head_dim_axis=1, seq_axis=None)
    bq = cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    bk = cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    same_sequence_count(cu_seqlens_q, cu_seqlens_k)
    max_seqlen("max_seqlen_q", max_seqlen_q, bq)
    max_seqlen("max_seqlen_k", max_seqlen_k, bk)
    return list(zip(bq, bq[1:], bk, bk[1:]))


def recipe_runs_here(recipe, device: torch.device, capability, *,
                     target: str = "this GPU") -> None:
    """The Triton kernels need INT8 tensor cores (sm_80+) and, for FP8 P·V, sm_89+ (``target``:
    what the message calls the capability's owner)."""
    if device.type != "cuda" or recipe.is_exact or capability is None:
        return
    if capability < (8, 0):
        raise ValueError(
            f"recipe {recipe.name!r} needs a GPU of compute capability 8.0 or newer, {target} is "
            f"{capability[0]}.{capability[1]}; use recipe='exact' or LOWBIT_ATTN_BACKEND=reference"
        )
    if recipe.pv == "fp8" and capability < (8, 9):
        raise ValueError(
            f"recipe {recipe.name!r} needs FP8 tensor cores (compute capability 8.9 or newer), "
            f"{target} is {capability[0]}.{capability[1]}; use recipe='qk_int8_pv_fp16'"
        )


def recipe_fits(recipe, head_dim: int) -> None:
    """FP4 recipes group Q and K along the head dim: 32 channels per MXFP4 scale, and the kernels
    take NVFP4 the same way (whole 32-channel halves of a 64-deep FP4 MMA)."""
    if recipe.is_fp4 and head_dim % 32 != 0:
        raise ValueError(
            f"recipe {recipe.name!r} needs a head dim that is a multiple of 32, got {head_dim}; "
            "use an 8-bit recipe ('qk_int8_pv_fp8' or 'qk_int8_pv_fp16') for this head dim"
        )


def resolved(*tensors) -> tuple:
    """``tensors`` with a view whose negation is only a flag (``x.conj().imag``: ``is_neg()``)
    materialized: the kernels read memory, and PyTorch's dispatcher resolves it only for the
    custom ops (the eager paths launch directly; under ``torch.compile`` every call is an op)."""
    if _is_compiling():
        return tensors
    for x in tensors:
        if isinstance(x, torch.Tensor) and x.is_neg():
            return tuple(y.resolve_neg() if isinstance(y, torch.Tensor) else y for y in tensors)
    return tensors


def operands(*tensors) -> tuple:
    """``tensors`` as ``scaled_dot_product_attention`` takes them: :func:`resolved`, and under
    ``torch.autocast`` float16, bfloat16 and float32 tensors cast to its dtype for the first
    one's device (float64 kept). What is not a tensor is returned as it is (the checks say what
    is wrong with it)."""
    tensors = resolved(*tensors)
    if not _any_autocast():
        return tensors
    first = tensors[0]
    if (not isinstance(first, torch.Tensor) or first.device.type not in ("cuda", "cpu")
            or not torch.is_autocast_enabled(first.device.type)):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES else x
                 for x in tensors)


def no_autocast(x: torch.Tensor):
    """A context for the custom ops' bodies: PyTorch operations on ``x``'s device keep the dtypes
    the recipe gives them, whatever ``torch.autocast`` the call came from (its inputs were cast on
    the way in: :func:`operands`)."""
    device = x.device.type
    if _any_autocast() and device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


def needs_grad(*tensors) -> bool:
    """Whether autograd needs gradients of any of ``tensors`` (non-tensors ignored) in this call."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


def other_autodiff(*tensors) -> str | None:
    """What differentiates this call other than reverse-mode autograd, or None: forward-mode AD
    (``torch.autograd.forward_ad``) or a ``torch.func`` transform (``grad``, ``vjp``, ``jvp``,
    ``jacrev``...) on one of ``tensors``. The custom ops define reverse-mode gradients only, and
    PyTorch drops a forward-mode tangent through them without a word. (``vmap`` alone is served.)
    Under ``torch.compile`` nothing is read: the transforms are traced there."""
    if _is_compiling():
        return None
    if _forward_ad._current_level >= 0 and any(
            isinstance(x, torch.Tensor) and _forward_ad.unpack_dual(x).tangent is not None
            for x in tensors):
        return "forward-mode AD (torch.autograd.forward_ad, torch.func.jvp, jacfwd)"
    if _functorch_active() and any(
            isinstance(x, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(x)
            for x in tensors):
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        kinds = {i.key().name for i in retrieve_all_functorch_interpreters()}
        if kinds & {"Grad", "Jvp"}:
            return "a torch.func transform that differentiates (grad, vjp, jvp, jacrev, jacfwd)"
    return None


def forward_only(*tensors: torch.Tensor, names: str = "q, k and v") -> None:
    """The kernels have no backward: refuse to cut a graph (or drop a tangent) silently.
    ``names``: the arguments ``tensors`` are, as the error names them."""
    if needs_grad(*tensors):
        raise ValueError(
            f"{names} must not require grad: lowbit_attn attention is forward-only (no "
            "backward); call it under torch.no_grad() or torch.inference_mode(), or detach them"
        )
    other = other_autodiff(*tensors)
    if other is not None:
        raise ValueError(
            f"lowbit_attn attention is forward-only and cannot be differentiated by {other}; "
            "call it on tensors without tangents, or use torch.nn.functional."
            "scaled_dot_product_attention there"
        )


def quant_groups(x, group: int, name: str = "x") -> None:
    """A tensor to quantize in groups of ``group`` along its last dimension."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (the one grouped), got a 0-dim tensor")
    if x.shape[-1] % group != 0:
        raise ValueError(
            f"{name}'s last dimension must be a multiple of the group size {group}, "
            f"got shape {tuple(x.shape)}"
        )


def fp4_amax(fmt: str, amax) -> None:
    """NVFP4 attention operands take their tensor scale from the per-channel amax."""
    if fmt == "nvfp4" and amax is None:
        raise ValueError("NVFP4 operands need the per-channel amax (for the tensor scale)")
