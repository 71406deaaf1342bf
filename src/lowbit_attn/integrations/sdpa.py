"""``scaled_dot_product_attention`` as a drop-in for PyTorch's (same signature and semantics; what
the kernels cannot serve goes to PyTorch's function), and the patch that puts it in place of
``torch.nn.functional.scaled_dot_product_attention`` and back.

Every model that calls ``F.scaled_dot_product_attention`` (or ``torch.nn.functional.…``) at run time
then runs the low-bit kernels; calls they cannot serve (masks, dropout, gradients, unsupported
shapes) go to the function that was there before, with one warning per reason. Code that bound the
function at import (``from torch.nn.functional import scaled_dot_product_attention``) keeps its
own reference and is not affected.

Patches nest: each :func:`patch_sdpa` pushes a recipe, the innermost one is used, and the original
function object is restored when the last one is removed. The bookkeeping is under a lock; the
replacement is process-wide (as the function it replaces is), and ``torch.compile(fullgraph=True)``
traces through it. :func:`routed` routes only the calls made in the current context (thread or
asyncio task): what the framework integrations use around one model's forward (under
``torch.compile`` the context lookup is a graph break; use :func:`patch_sdpa` there).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings

import torch
import torch.nn.functional as F

from lowbit_attn.core import checks
from lowbit_attn.core.arch import backend_for, get_capability
from lowbit_attn.core.recipes import Recipe, resolve, resolve_train
from lowbit_attn.inference import op
from lowbit_attn.training import trainable_attention

# Captured at import, before anyone patches F.scaled_dot_product_attention with ours.
TORCH_SDPA = F.scaled_dot_product_attention


def exact_sdpa(query, key, value, attn_mask=None, **kwargs):
    """:data:`TORCH_SDPA` for the package's own exact paths (the attention it computes instead of
    a low-bit one, as :func:`lowbit_attn.compat.sageattention.masked_exact`), with the same
    arguments; float16/bfloat16 CPU tensors are computed in float32 (a float mask too) and the
    output cast back. PyTorch's reduced-precision CPU kernel is not available on every CPU (with
    ``ATEN_CPU_CAPABILITY=default`` on some AVX-512 CPUs it raises ``pack_vnni2 is only
    supported when avx512 is supported``), and float32 is the more exact answer. The drop-in's
    fallback is PyTorch's function itself, unchanged: its callers get PyTorch's result."""
    if query.device.type != "cpu" or query.dtype not in (torch.float16, torch.bfloat16):
        return TORCH_SDPA(query, key, value, attn_mask=attn_mask, **kwargs)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    out = TORCH_SDPA(query.float(), key.float(), value.float(), attn_mask=attn_mask, **kwargs)
    return out.to(query.dtype)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_fallback(reason: str) -> None:
    """Warn that calls for ``reason`` go to PyTorch: once per reason and process (until
    :func:`reset_fallback_warnings`); not while ``torch.compile`` traces the call (its lock is
    a graph break, so ``fullgraph=True`` failed on every fallback: an eager call warns)."""
    if torch.compiler.is_compiling():
        return
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(
        f"lowbit_attn.scaled_dot_product_attention: {reason}; falling back to PyTorch's exact "
        "attention for such calls",
        stacklevel=3,
    )


def reset_fallback_warnings() -> None:
    """Forget which fallback reasons were warned about, so each warns again on its next call (for
    tools and tests that record the warnings of a run).

    Examples:
        >>> from lowbit_attn.integrations.sdpa import reset_fallback_warnings
        >>> reset_fallback_warnings()   # the next fallback of each reason warns again
    """
    with _warned_lock:
        _warned.clear()


def _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                     scale) -> str | None:
    """Why the kernels cannot serve this ``scaled_dot_product_attention`` call (then PyTorch's
    function does, raising only where it would), or None. Only a reason, never an exception: any
    argument PyTorch takes must reach it."""
    if not all(isinstance(x, torch.Tensor) for x in (query, key, value)):
        return "inputs are not tensors"
    if attn_mask is not None:
        return "an attn_mask was given"
    if dropout_p != 0.0:
        return "dropout_p > 0"
    if not all(isinstance(flag, (bool, torch.SymBool)) for flag in (is_causal, enable_gqa)):
        # PyTorch takes only a bool (a SymBool when traced symbolically) and raises for "False", 1,
        # numpy.bool_ or None: its function decides, rather than bool() reading "False" as true
        return "is_causal or enable_gqa is not a bool"
    if not (query.dim() == key.dim() == value.dim() and query.dim() in (3, 4)):
        return f"only 3-D and 4-D inputs are supported (got {query.dim()}-D)"
    if not query.dtype == key.dtype == value.dtype:
        return (f"query, key and value have different dtypes ({query.dtype}, {key.dtype}, "
                f"{value.dtype})")
    if query.dtype not in checks.FLOAT_DTYPES:
        return f"dtype {query.dtype} is not supported"
    if not (query.device == key.device == value.device):
        return "inputs are on different devices"
    if key.shape != value.shape or query.shape[-1] != key.shape[-1]:
        return "value's head dim differs from query's"
    if not 1 <= query.shape[-1] <= checks.MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} is not supported"
    if query.shape[0] != key.shape[0] or query.shape[-2] == 0 or key.shape[-2] == 0:
        return "shapes need broadcasting or are empty"
    if query.dim() == 4:
        hq, hkv = query.shape[1], key.shape[1]
        if hq == 0 or hkv == 0:
            return "shapes need broadcasting or are empty"
        if hq != hkv and (not enable_gqa or hq % hkv != 0):
            return "query and key heads differ without enable_gqa"
    try:
        checks.softmax_scale(scale, query.shape[-1])
    except (TypeError, ValueError):
        return (f"scale is not a positive finite number between 2**-125 and 2**126 (got "
                f"{type(scale).__name__})")
    return None


def _training_reason(query, key, is_causal, train_recipe) -> str | None:
    """Why a call that needs gradients cannot go to :func:`trainable_attention`, or None."""
    if train_recipe is None:
        return ("a gradient is required (these kernels are forward-only; "
                "patch_sdpa(train_recipe='sagebwd_int8') trains with trainable_attention)")
    if backend_for(query.device) == "triton" and query.dtype not in (torch.float16, torch.bfloat16):
        return f"training on the kernels takes float16 or bfloat16, got {query.dtype}"
    if is_causal and query.shape[-2] != key.shape[-2]:
        return "causal training with different query and key lengths (PyTorch aligns top-left)"
    return None


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` with the same
    signature and semantics (causal masks aligned top-left, as PyTorch does), computed with the
    ``"auto"`` recipe (another recipe: :func:`lowbit_attn.patch_sdpa`).

    Calls the kernels cannot serve go to PyTorch's own function, with one warning per reason
    (:func:`~lowbit_attn.integrations.sdpa.reset_fallback_warnings` makes each warn again): an
    ``attn_mask``, dropout, inputs that require grad (the kernels are forward-only), dtypes other
    than float16/bfloat16/float32, head dims over 256 or differing between query and value,
    inputs that are not 3-D or 4-D, shapes that need broadcasting or hold no heads or tokens, a
    scale that is not a positive finite real number, an ``is_causal`` or ``enable_gqa`` that is
    not a ``bool``, and a recipe this GPU cannot run. So apart from the environment errors below
    it raises only where PyTorch's function does, and as it does.

    Args:
        query: ``[B, Hq, L, D]`` or ``[B·Hq, L, D]`` (3-D).
        key: ``[B, Hkv, S, D]`` (or 3-D); ``Hkv`` differs from ``Hq`` only with ``enable_gqa``.
        value: the same shape as key.
        attn_mask: a mask or bias; given, the call goes to PyTorch.
        dropout_p: dropout probability; above 0, the call goes to PyTorch.
        is_causal: a causal mask aligned top-left (as PyTorch's).
        scale: softmax scale, ``D ** -0.5`` by default.
        enable_gqa: allow fewer key/value heads than query heads.

    Returns:
        The attention output, query's shape and dtype (PyTorch's result for the calls it serves).

    Raises:
        ValueError: a ``LOWBIT_ATTN_*`` variable set to a value outside its choices.
        RuntimeError: ``LOWBIT_ATTN_BACKEND=triton`` for CPU tensors without
            ``TRITON_INTERPRET=1``.

    Examples:
        >>> import torch, lowbit_attn
        >>> q = torch.randn(1, 4, 64, 32)
        >>> k = v = torch.randn(1, 2, 64, 32)               # GQA, as SDPA takes it
        >>> lowbit_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True).shape
        torch.Size([1, 4, 64, 32])
        >>> # a mask: PyTorch's exact SDPA runs
        >>> mask = torch.ones(64, 64, dtype=torch.bool)
        >>> out = lowbit_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
        ...                                                enable_gqa=True)
        >>> out.shape
        torch.Size([1, 4, 64, 32])
    """
    return sdpa_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            recipe="auto", fallback=TORCH_SDPA)


def recipe_reason(r: Recipe, device: torch.device, capability, head_dim: int) -> str | None:
    """Why the kernels cannot run recipe ``r`` for this call (the GPU is too old for it, or an FP4
    recipe meets a head dim it cannot group), or None: ``attention`` raises there, the drop-in
    hands the call to PyTorch."""
    try:
        checks.recipe_runs_here(r, device, capability)
        checks.recipe_fits(r, head_dim)
    except ValueError as err:
        return str(err)
    return None


def sdpa_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *,
                     recipe, fallback, train_recipe=None):
    """:func:`scaled_dot_product_attention` with the function that serves what the kernels
    cannot (``fallback``, called with the same arguments); calls that need gradients go to
    :func:`trainable_attention` with ``train_recipe`` when one is given."""
    reason = _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                              scale)
    if reason is None:
        reason = checks.other_autodiff(query, key, value)  # PyTorch's function serves those
    train = reason is None and checks.needs_grad(query, key, value)
    if train:
        reason = _training_reason(query, key, is_causal, train_recipe)
    elif reason is None:
        capability = get_capability() if query.device.type == "cuda" else None
        r = resolve(recipe, capability)  # an unknown recipe is the caller's error: it raises
        reason = recipe_reason(r, query.device, capability, query.shape[-1])
    if reason is not None:
        warn_fallback(reason)
        return fallback(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa,
        )
    query, key, value = checks.operands(query, key, value)
    squeeze = query.dim() == 3
    q, k, v = (x.unsqueeze(1) for x in (query, key, value)) if squeeze else (query, key, value)
    if train:
        out = trainable_attention(q, k, v, is_causal=bool(is_causal), scale=scale,
                                  recipe=train_recipe)
    else:
        out, _ = op.call(
            q, k, v, r, scale=checks.softmax_scale(scale, q.shape[-1]), is_causal=bool(is_causal),
            causal_offset=0, nhd=False, return_lse=False,
        )
    return out.squeeze(1) if squeeze else out


_lock = threading.Lock()
_active: list["SDPAPatch"] = []
_original = None  # what F.scaled_dot_product_attention was before the first active patch
# (innermost patch or None, the function to fall back to): replaced whole under the lock, read
# once per call, so a call racing with patch/unpatch sees one consistent pair.
_state: tuple = (None, None)
_routed_users = 0  # active routed() scopes, in any context
_route: contextvars.ContextVar = contextvars.ContextVar("lowbit_attn_sdpa_route", default=None)


class SDPAPatch:
    """One active patch (returned by :func:`patch_sdpa`); a context manager that removes itself
    on exit."""

    def __init__(self, recipe: str | Recipe, train_recipe=None):
        self.recipe = recipe
        self.train_recipe = train_recipe

    def __enter__(self) -> SDPAPatch:
        return self

    def __exit__(self, *exc) -> None:
        unpatch_sdpa(self)

    def __repr__(self) -> str:
        name = self.recipe if isinstance(self.recipe, str) else self.recipe.name
        train = self.train_recipe if self.train_recipe is None or isinstance(
            self.train_recipe, str) else self.train_recipe.name
        return f"SDPAPatch(recipe={name!r}, train_recipe={train!r}, active={self in _active})"


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` as patched by
    :func:`lowbit_attn.patch_sdpa`: the innermost patch's recipe, or the function it replaced for
    the calls the kernels cannot serve."""
    patch, original = _state
    # only read the context when a routed() scope exists: torch.compile cannot trace
    # ContextVar.get, and patch_sdpa alone should compile without a graph break
    route = _route.get() if _routed_users else None
    if route is None:
        route = patch
    if route is None:  # not routed here, or the last patch went away while this call started
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return sdpa_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            recipe=route.recipe, train_recipe=route.train_recipe,
                            fallback=original)


def _install() -> None:
    """Put the wrapper in place if nothing holds it yet (under the lock)."""
    global _original
    if not _active and not _routed_users:
        _original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _patched_sdpa


def _release() -> None:
    """Restore the original when no patch or routed scope holds the wrapper (under the lock)."""
    global _original, _state
    if _active:
        _state = (_active[-1], _original)
        return
    _state = (None, _original)
    if _routed_users:
        return
    if F.scaled_dot_product_attention is _patched_sdpa:
        F.scaled_dot_product_attention = _original
    else:
        warnings.warn(
            "lowbit_attn: torch.nn.functional.scaled_dot_product_attention was replaced by someone "
            "else after patch_sdpa; leaving their function in place",
            stacklevel=3,
        )
    _original = None


@contextlib.contextmanager
def routed(recipe: str | Recipe = "auto"):
    """Within the block, ``F.scaled_dot_product_attention`` calls made in this context (thread,
    asyncio task) run ``recipe``; other threads' calls are untouched."""
    resolve(recipe, None)
    global _routed_users, _state
    with _lock:
        _install()
        _routed_users += 1
        _state = (_state[0], _original)
    token = _route.set(SDPAPatch(recipe))
    try:
        yield
    finally:
        try:
            _route.reset(token)
        finally:  # the count comes down even where the reset raises (another context's token)
            with _lock:
                _routed_users -= 1
                _release()


def patch_sdpa(recipe: str | Recipe = "auto", *, train_recipe=None) -> SDPAPatch:
    """Make ``torch.nn.functional.scaled_dot_product_attention`` run ``recipe`` (see
    :func:`lowbit_attn.attention`) until the returned patch is removed::

        with lowbit_attn.patch_sdpa("qk_int8_pv_fp8"):
            image = pipe(prompt).images[0]

        lowbit_attn.patch_sdpa()        # or for the rest of the program ...
        lowbit_attn.unpatch_sdpa()      # ... until this

    Patches nest (the innermost recipe runs); the bookkeeping is thread-safe, and the original
    function object comes back when the last patch goes. Calls the kernels cannot take go to the
    function that was there, as :func:`scaled_dot_product_attention` describes.
    ``torch.compile(fullgraph=True)`` traces through the patched function. Code that bound the
    function at import (``from torch.nn.functional import scaled_dot_product_attention``) is not
    affected.

    Args:
        recipe: the inference recipe, a name or a :class:`~lowbit_attn.Recipe`, as for
            :func:`lowbit_attn.attention`.
        train_recipe: ``None`` (calls that need gradients run the function that was there), or a
            training recipe (e.g. ``"sagebwd_int8"``, see :func:`lowbit_attn.trainable_attention`)
            for those calls (fp16/bf16 on a GPU; causal only with as many queries as keys).

    Returns:
        The patch: a context manager that removes itself on exit, or an argument for
            :func:`unpatch_sdpa`.

    Raises:
        TypeError: ``recipe`` or ``train_recipe`` of the wrong type.
        ValueError: an unknown recipe name (checked here, not in the middle of a model).

    Examples:
        >>> import torch, lowbit_attn
        >>> # [B, H, N, D], on the CPU here
        >>> q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
        >>> with lowbit_attn.patch_sdpa("qk_int8_pv_fp16"):
        ...     out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        >>> out.shape
        torch.Size([1, 2, 64, 32])
    """
    resolve(recipe, None)  # an unknown recipe fails here, not in the middle of a model
    if train_recipe is not None:
        resolve_train(train_recipe)
    patch = SDPAPatch(recipe, train_recipe)
    global _state
    with _lock:
        _install()
        _active.append(patch)
        _state = (patch, _original)
    return patch


def unpatch_sdpa(patch: SDPAPatch | None = None) -> bool:
    """Remove a patch of :func:`patch_sdpa`; when none is left, restore the original function
    object.

    Args:
        patch: the patch to remove; ``None`` removes the most recent one.

    Returns:
        Whether a patch was removed (``False`` when it was not active, or none was).

    Examples:
        >>> import lowbit_attn
        >>> patch = lowbit_attn.patch_sdpa().__enter__()   # as `with` does on entry
        >>> lowbit_attn.unpatch_sdpa(patch)
        True
        >>> lowbit_attn.unpatch_sdpa(patch)                # no longer active
        False
    """
    with _lock:
        if patch is None and _active:
            patch = _active[-1]
        if patch is None or patch not in _active:
            return False
        _active.remove(patch)
        _release()
    return True


def sdpa_patched() -> bool:
    """Whether a patch is active."""
    return bool(_active)
