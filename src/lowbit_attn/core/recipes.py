"""Named numeric recipes: what is quantized, how, and with which exact transformations.

A recipe is a frozen dataclass; the public functions accept either its name or an instance, so
options are set with :meth:`Recipe.replace`::

    r = lowbit_attn.get_recipe("qk_int8_pv_fp8").replace(granularity="per_token")
    out = lowbit_attn.attention(q, k, v, recipe=r)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from lowbit_attn.core import checks
from lowbit_attn.core.arch import get_capability

Granularity = Literal["per_block", "per_token", "per_thread"]

GRANULARITIES = ("per_block", "per_token", "per_thread")
QK_FORMATS = ("int8", "nvfp4", "mxfp4", "none")
PV_FORMATS = ("fp16", "fp8", "nvfp4", "mxfp4", "none")
FP4_FORMATS = ("nvfp4", "mxfp4")
BLOCK_SIZES = (16, 32, 64, 128)
# The trainable backward's INT8 scale groups of P and dS (TrainRecipe.backward_granularity).
BACKWARD_GRANULARITIES = ("per_tile", "per_row")
# The values a str or int field may take (the other fields: ``name``, bools, TrainRecipe.int8).
FIELD_CHOICES = {"qk": QK_FORMATS, "pv": PV_FORMATS, "granularity": GRANULARITIES,
                 "block_q": BLOCK_SIZES, "block_k": BLOCK_SIZES,
                 "backward_granularity": BACKWARD_GRANULARITIES}


def _check_fields(recipe) -> None:
    """Type and value checks of each field of a :class:`Recipe` or :class:`TrainRecipe` on its
    own (TypeError for a wrong type, ValueError for a wrong value, naming ``Class.field``). Bools
    and ints are stored as Python ``bool`` and ``int`` (a ``numpy.bool_`` becomes a ``bool``), so
    equal options give equal recipes and equal op keys."""
    for f in dataclasses.fields(recipe):
        where = f"{type(recipe).__name__}.{f.name}"
        value = getattr(recipe, f.name)
        if f.name == "name":
            checks.identifier(where, value)
        elif f.type == "bool":  # annotations are text here (``from __future__``)
            object.__setattr__(recipe, f.name, checks.flag(where, value))
        elif f.type == "int":
            object.__setattr__(recipe, f.name, checks.integer(where, value, FIELD_CHOICES[f.name]))
        elif f.name in FIELD_CHOICES:
            checks.choice(where, value, FIELD_CHOICES[f.name])


def _replaced(recipe, changes: dict):
    """``recipe.replace(**changes)`` of a :class:`Recipe` or :class:`TrainRecipe`: an unknown
    field is a TypeError naming the class; the copy is validated by its ``__post_init__``."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(recipe)}
    if unknown:
        raise TypeError(f"{type(recipe).__name__}.replace got unknown option(s) {sorted(unknown)}")
    return dataclasses.replace(recipe, **changes)


@dataclass(frozen=True)
class Recipe:
    """How attention is computed.

    Attributes:
        name: the recipe's name, a Python identifier (``"exact"``, ``"qk_int8_pv_fp16"``,
            ``"qk_int8_pv_fp8"``,
            ``"qk_fp4_pv_fp4"``, ``"qk_mxfp4_pv_mxfp4"``).
        qk: ``"int8"`` for INT8 Q·Kᵀ with int32 accumulation; ``"nvfp4"`` / ``"mxfp4"`` for FP4
            microscaling Q and K (groups of 16 / 32 channels, E4M3 / E8M0 scales); ``"none"`` for
            exact.
        pv: ``"fp16"`` (P̃ and V in fp16, fp32 accumulation), ``"fp8"`` (E4M3 P̃ with static scale 448,
            E4M3 V with one scale per channel, each key block's product added into an fp32
            accumulator), ``"nvfp4"`` / ``"mxfp4"`` (P̃ in groups of keys, V in groups of tokens;
            the same format as ``qk``) or ``"none"``.
        granularity: INT8 scale groups for Q and K: ``"per_block"`` (one scale per ``block_q`` query
            rows and per ``block_k`` key rows), ``"per_token"`` (one scale per row) or
            ``"per_thread"`` (SageAttention2's sm90 groups, the rows and keys one thread of a
            Hopper wgmma holds: Q's rows ``r`` and ``r + 8`` of each 16-row slice, and in each
            128-key block the keys ``2c, 2c + 1`` (mod 8), for c = 0..3; a kernel then
            dequantizes all of a thread's scores with one scalar). FP4 recipes' groups are fixed
            by their format and keep ``"per_block"``.
        smooth_k: subtract the per-(batch, head, channel) mean of K over tokens. Exact: softmax ignores
            the constant it adds to each row of scores.
        smooth_q: subtract the mean of each block of ``block_q`` query rows and add the correction
            ``ΔS = mean(Q_block)·K'ᵀ`` back to every score, computed in fp32.
        smooth_v: subtract the per-channel mean of V and add it back to O (rows of P sum to 1).
        balance_qk: rescale channel c of Q by ``α_c`` and of K by ``1/α_c`` with
            ``α_c = sqrt(amax|K'_c| / amax|Q'_c|)`` per (batch, KV head), after smoothing. Scores are
            unchanged in exact arithmetic; outlier channels stop dominating one operand's scale.
        two_level_p: FP4 only: scale each row of P̃ in a key block so its maximum maps to
            ``448·6`` before the group quantization, and fold the factor back after P·V
            (SageAttention3's two-level quantization); ``False`` quantizes ``P̃ ∈ [0, 1]`` directly.
        block_q: query rows per tile (and per scale group with ``per_block``): 16, 32, 64 or 128.
        block_k: key rows per tile (and per scale group with ``per_block``): 16, 32, 64 or 128;
            at least 32 for FP4 recipes.

    Fields are checked when a recipe is built or changed with :meth:`replace`: options are
    ``bool`` (or ``numpy.bool_``, stored as ``bool``), block sizes ints, the name a Python
    identifier.

    Raises:
        TypeError: a field of the wrong type (the message names ``Recipe.<field>``).
        ValueError: a name that is not a Python identifier; a value outside a field's choices;
            ``qk`` and ``pv`` not both ``"none"`` or both quantized, or an FP4 format paired with
            another; an FP4 recipe with ``granularity="per_token"``, ``balance_qk`` or
            ``block_k`` below 32.

    Examples:
        >>> import lowbit_attn
        >>> recipe = lowbit_attn.get_recipe("qk_int8_pv_fp8")
        >>> recipe = recipe.replace(granularity="per_block")
        >>> recipe.qk, recipe.pv, recipe.granularity
        ('int8', 'fp8', 'per_block')
    """

    name: str
    qk: Literal["int8", "nvfp4", "mxfp4", "none"]
    pv: Literal["fp16", "fp8", "nvfp4", "mxfp4", "none"]
    granularity: Granularity = "per_block"
    smooth_k: bool = True
    smooth_q: bool = False
    smooth_v: bool = False
    balance_qk: bool = True
    two_level_p: bool = True
    block_q: int = 128
    block_k: int = 64

    def __post_init__(self) -> None:
        _check_fields(self)
        if (self.qk == "none") != (self.pv == "none"):
            raise ValueError("Recipe: qk and pv must both be 'none' (exact) or both be quantized")
        if (self.qk in FP4_FORMATS or self.pv in FP4_FORMATS) and self.qk != self.pv:
            raise ValueError(
                f"Recipe: an FP4 recipe quantizes Q·Kᵀ and P·V in one format, got qk={self.qk!r} "
                f"and pv={self.pv!r}"
            )
        if self.is_fp4:
            if self.granularity != "per_block":
                raise ValueError(
                    "Recipe.granularity applies to INT8 recipes; FP4 groups are fixed by the format "
                    f"(keep 'per_block'), got {self.granularity!r}"
                )
            if self.balance_qk:
                raise ValueError("Recipe.balance_qk is not available for FP4 recipes; set it False")
            if self.block_k < 32:
                raise ValueError(
                    f"Recipe.block_k must be at least 32 for FP4 recipes (P's scale groups lie "
                    f"within a key block), got {self.block_k}"
                )

    @property
    def is_exact(self) -> bool:
        return self.qk == "none"

    @property
    def is_fp4(self) -> bool:
        return self.qk in FP4_FORMATS

    def replace(self, **changes) -> Recipe:
        """A copy with some options changed, validated as a new recipe.

        Args:
            **changes: fields and their new values, e.g. ``granularity="per_token"``.

        Returns:
            The new :class:`Recipe`.

        Raises:
            TypeError: an unknown field, or a value of the wrong type.
            ValueError: a value the recipe does not allow (see :class:`Recipe`).
        """
        return _replaced(self, changes)


EXACT = Recipe(name="exact", qk="none", pv="none", smooth_k=False, balance_qk=False)
QK_INT8_PV_FP16 = Recipe(name="qk_int8_pv_fp16", qk="int8", pv="fp16")
# FP8 P·V takes per-token INT8 scales: with per-block ones its outlier-channel accuracy sits at the
# 0.999 cosine bar (experiments/accuracy_defaults); FP16 P·V meets every bar with per-block scales.
QK_INT8_PV_FP8 = Recipe(name="qk_int8_pv_fp8", qk="int8", pv="fp8", granularity="per_token")

# SageAttention3: FP4 Q·Kᵀ and P·V with Q smoothing (per query block, ΔS correction), K smoothing
# and two-level P quantization. NVFP4 is the FP4 default; MXFP4 is its power-of-two-scale cousin.
QK_FP4_PV_FP4 = Recipe(
    name="qk_fp4_pv_fp4", qk="nvfp4", pv="nvfp4", smooth_q=True, balance_qk=False
)
QK_MXFP4_PV_MXFP4 = Recipe(
    name="qk_mxfp4_pv_mxfp4", qk="mxfp4", pv="mxfp4", smooth_q=True, balance_qk=False
)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (EXACT, QK_INT8_PV_FP16, QK_INT8_PV_FP8, QK_FP4_PV_FP4, QK_MXFP4_PV_MXFP4)
}
"""The named inference recipes with their default options, by name: ``"exact"``,
``"qk_int8_pv_fp16"`` (SageAttention), ``"qk_int8_pv_fp8"`` (SageAttention2),
``"qk_fp4_pv_fp4"`` (SageAttention3, NVFP4) and ``"qk_mxfp4_pv_mxfp4"``. ``"auto"`` is not among
them: it is resolved per device."""


def get_recipe(name: str) -> Recipe:
    """The named recipe with its default options.

    Args:
        name: a key of :data:`RECIPES` (``"auto"`` is not one: it is resolved per device when a
            call runs).

    Returns:
        The frozen :class:`Recipe`; change options with :meth:`Recipe.replace`.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: an unknown name.

    Examples:
        >>> import lowbit_attn
        >>> lowbit_attn.get_recipe("qk_int8_pv_fp16").pv
        'fp16'
        >>> sorted(lowbit_attn.RECIPES)
        ['exact', 'qk_fp4_pv_fp4', 'qk_int8_pv_fp16', 'qk_int8_pv_fp8', 'qk_mxfp4_pv_mxfp4']
    """
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
    if name == "auto":
        raise ValueError("recipe 'auto' is chosen per device when a call runs (pass "
                         f"recipe='auto' to the call); get_recipe takes one of {sorted(RECIPES)}")
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(
            f"unknown recipe {name!r}; expected 'auto' or one of {sorted(RECIPES)}"
        ) from None


def auto_recipe(capability: tuple[int, int] | None) -> Recipe:
    """FP8 P·V where the GPU has FP8 tensor cores (sm_89 and newer), FP16 P·V before and on CPU."""
    if capability is not None and capability >= (8, 9):
        return QK_INT8_PV_FP8
    return QK_INT8_PV_FP16


def resolve(recipe: str | Recipe, capability: tuple[int, int] | None) -> Recipe:
    """Turn the ``recipe`` argument of the public functions into a :class:`Recipe`."""
    if isinstance(recipe, Recipe):
        return recipe
    if recipe == "auto":
        return auto_recipe(capability)
    if isinstance(recipe, str):
        return get_recipe(recipe)
    raise TypeError(f"recipe must be a str or lowbit_attn.Recipe, got {type(recipe).__name__}")


def resolve_for(recipe: str | Recipe, device) -> Recipe:
    """:func:`resolve` for a call on ``device`` (a :class:`torch.device`): ``"auto"`` picks by the
    GPU's capability, and a recipe this GPU cannot run raises ``ValueError``."""
    capability = get_capability() if device.type == "cuda" else None
    r = resolve(recipe, capability)
    checks.recipe_runs_here(r, device, capability)
    return r


@dataclass(frozen=True)
class TrainRecipe:
    """How the trainable attention computes its seven matmuls (SageBwd).

    Attributes:
        name: ``"sagebwd_int8"`` or ``"exact"`` (or a custom name).
        int8: the matmuls computed in INT8, from ``"qk"`` (the forward's Q·Kᵀ and its recompute in
            the backward), ``"pv"``, ``"dp"`` (dO·Vᵀ), ``"dv"`` (Pᵀ·dO), ``"dq"`` (dS·K), ``"dk"``
            (dSᵀ·Q). The others run on the input dtype (fp16/bf16 operands, fp32 accumulation).
        smooth_k: subtract K's per-channel mean over tokens (exact; no gradient correction).
        smooth_q: subtract the mean of each block of 64 query rows and add ``ΔS`` back in fp32
            (exact; dK gets the correction ``Σ_i dS_ij·mean(Q_block(i))``).
        balance_qk: multiply Q's channel c by ``α_c = sqrt(amax|K_c| / amax|Q_c|)`` and divide K's
            by it before quantizing (after smoothing), as the inference recipes do; scores are
            unchanged and the gradients come back as ``dQ∘α``, ``dK/α`` (exact). Not part of
            SageBwd: an option for models whose Q or K has outlier channels.
        backward_granularity: the INT8 scale groups of P and dS in the backward's products
            (``dV = Pᵀ·dO``, ``dK = dSᵀ·Q``, ``dQ = dS·K``), each a 64×64 tile (64 queries by 64
            keys): ``"per_tile"``, one scale per tile; or ``"per_row"``, one scale per row of the
            product's output, the dimension it does not contract (per key for dV and dK, per
            query for dQ), which factors out of the product as a tile's scale does and is finer.

    Raises:
        TypeError: a field of the wrong type (the message names ``TrainRecipe.<field>``).
        ValueError: a name that is not a Python identifier; ``int8`` not a frozenset of the
            matmul names above.

    Examples:
        >>> import lowbit_attn
        >>> recipe = lowbit_attn.TRAIN_RECIPES["sagebwd_int8"]
        >>> # the products computed in INT8
        >>> sorted(recipe.int8)
        ['dk', 'dq', 'dv', 'pv', 'qk']
        >>> recipe.replace(backward_granularity="per_row").backward_granularity
        'per_row'
    """

    name: str
    int8: frozenset
    smooth_k: bool = True
    smooth_q: bool = False
    balance_qk: bool = False
    backward_granularity: Literal["per_tile", "per_row"] = "per_tile"

    def __post_init__(self) -> None:
        from lowbit_attn.core.operands import TRAIN_MATMULS

        _check_fields(self)
        if not isinstance(self.int8, frozenset) or not self.int8 <= set(TRAIN_MATMULS):
            raise ValueError(
                f"TrainRecipe.int8 must be a frozenset of names from {TRAIN_MATMULS}, got {self.int8!r}"
            )

    @property
    def is_exact(self) -> bool:
        return not self.int8

    def replace(self, **changes) -> TrainRecipe:
        """A copy with some options changed, validated as a new recipe.

        Args:
            **changes: fields and their new values, e.g. ``smooth_q=True``.

        Returns:
            The new :class:`TrainRecipe`.

        Raises:
            TypeError: an unknown field, or a value of the wrong type.
            ValueError: a value the recipe does not allow.
        """
        return _replaced(self, changes)


# SageBwd: six of the seven matmuls in INT8; dP = dO·Vᵀ stays 16-bit (dS's error dominates all
# gradients, and it starts in dP).
SAGEBWD_INT8 = TrainRecipe(name="sagebwd_int8", int8=frozenset({"qk", "pv", "dv", "dq", "dk"}))
TRAIN_EXACT = TrainRecipe(name="exact", int8=frozenset(), smooth_k=False)
TRAIN_RECIPES: dict[str, TrainRecipe] = {r.name: r for r in (SAGEBWD_INT8, TRAIN_EXACT)}
"""The named training recipes, by name: ``"sagebwd_int8"`` (INT8 in six of the seven matmuls,
``dP = dO·Vᵀ`` in 16-bit, K smoothed) and ``"exact"`` (no quantization)."""


def resolve_train(recipe, *, smooth_k=None, smooth_q=None, keep_16bit=None,
                  balance_qk=None) -> TrainRecipe:
    """The ``recipe``, ``smooth_*``, ``balance_qk`` and ``keep_16bit`` arguments of
    ``trainable_attention`` → one :class:`TrainRecipe`. ``None`` keeps the recipe's setting;
    ``keep_16bit`` (names of matmuls) replaces the recipe's INT8 set."""
    from lowbit_attn.core.operands import TRAIN_MATMULS

    if isinstance(recipe, TrainRecipe):
        r = recipe
    elif isinstance(recipe, str):
        if recipe not in TRAIN_RECIPES:
            raise ValueError(
                f"unknown trainable recipe {recipe!r}; expected one of {sorted(TRAIN_RECIPES)} or "
                "a lowbit_attn.TrainRecipe"
            )
        r = TRAIN_RECIPES[recipe]
    else:
        raise TypeError(f"recipe must be a str or lowbit_attn.TrainRecipe, got {type(recipe).__name__}")
    options = {"smooth_k": smooth_k, "smooth_q": smooth_q, "balance_qk": balance_qk}
    changes = {name: value for name, value in options.items() if value is not None}
    if keep_16bit is not None:
        if isinstance(keep_16bit, str) or not isinstance(keep_16bit, Iterable):
            raise TypeError(
                f"keep_16bit must be a tuple of matmul names (e.g. ('dp',)), got "
                f"{checks.shown(keep_16bit)}"
            )
        names = tuple(keep_16bit)
        if not all(isinstance(x, str) for x in names):
            raise TypeError(f"keep_16bit must hold matmul names (str), got {names!r}")
        unknown = set(names) - set(TRAIN_MATMULS)
        if unknown:
            raise ValueError(
                f"keep_16bit names unknown matmul(s) {sorted(unknown)}; choose from {TRAIN_MATMULS}"
            )
        base = frozenset() if r.is_exact else frozenset(TRAIN_MATMULS)
        changes["int8"] = base - frozenset(names)
    return r.replace(**changes)


# --- the recipe as the custom ops take it ----------------------------------------------------

def _parse_names(text: str) -> frozenset:
    return frozenset(text.split(",")) if text else frozenset()


# Field annotations are text (``from __future__ import annotations``); str fields read as they are.
_PARSE = {"bool": {"True": True, "False": False}.__getitem__, "int": int,
          "frozenset": _parse_names}


def _text(value) -> str:
    return ",".join(sorted(value)) if isinstance(value, frozenset) else f"{value}"


def recipe_key(recipe: Recipe | TrainRecipe) -> str:
    """A :class:`Recipe` or :class:`TrainRecipe` as every custom op takes it: ``name=value`` of
    each field in field order, joined by ``;`` (a plain string argument, so the ops' schemas stay
    fixed as recipes gain options; built with operations torch.compile traces). A set of matmul
    names is written sorted, joined by ``,``. Unambiguous because a recipe's fields are validated:
    its name, formats and matmul names are identifiers, its options Python bools and ints, whose
    text reads back exactly."""
    fields = dataclasses.fields(recipe)
    return ";".join(f"{f.name}={_text(getattr(recipe, f.name))}" for f in fields)


def recipe_from_key(key: str, kind: type = Recipe) -> Recipe | TrainRecipe:
    """The ``kind`` (:class:`Recipe` or :class:`TrainRecipe`) that :func:`recipe_key` wrote;
    ``ValueError`` for any other text (a missing, unknown or repeated field, a value that is not a
    bool or int literal where one is due, or the recipe's own validation error)."""
    fields = {f.name: f.type for f in dataclasses.fields(kind)}
    values = dict(item.partition("=")[::2] for item in key.split(";"))
    if tuple(values) != tuple(fields):
        raise ValueError(f"recipe key {key!r} must give {'=…;'.join(fields)}=… in this order")
    try:
        parsed = {k: _PARSE.get(fields[k], str)(x) for k, x in values.items()}
    except (KeyError, ValueError):
        raise ValueError(f"recipe key {key!r} has a value of the wrong type") from None
    recipe = kind(**parsed)
    if recipe_key(recipe) != key:
        raise ValueError(f"recipe key {key!r} is not in the form recipe_key writes")
    return recipe
