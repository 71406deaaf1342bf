"""Accuracy of the recipes against float64 exact attention on named input families.

Behind ``lowbit-attn accuracy``; usable from Python too::

    from lowbit_attn.tools import accuracy
    rows = accuracy.evaluate(["qk_int8_pv_fp8"], ["channel_bias_k"], n=4096, head_dim=128,
                             heads_q=2, heads_kv=2, causal=False, seed=0, device="cpu")
    print(accuracy.format_table(rows))

On a CUDA device the recipes run as Triton kernels, on a CPU as the PyTorch reference (the same
numerics). The oracle is :func:`~lowbit_attn.inference.naive.exact_attention` in float64 on the
same (already rounded) inputs, so the errors are those of the recipe alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from lowbit_attn.tools import inputs
from lowbit_attn.tools.args import (
    UsageError, device_arg, head_dim_arg, output_file, parse_recipe, positive_int, ranged,
    recipe_spec,
)
from lowbit_attn.inference import attention
from lowbit_attn.core.metrics import errors
from lowbit_attn.core.recipes import RECIPES, Recipe
from lowbit_attn.inference.naive import exact_attention
from lowbit_attn.kvcache.recipes import KV_RECIPES

DEFAULT_RECIPES = ("exact", "qk_int8_pv_fp16", "qk_int8_pv_fp8", "qk_fp4_pv_fp4")

# The issue's quality bars, stated at N=4096, D=128 for the recipes' default options:
# (family, recipe name) -> (minimum cosine, maximum relative L1).
BARS: dict[tuple[str, str], tuple[float, float | None]] = {
    ("channel_bias_k", "qk_int8_pv_fp16"): (0.9999, 0.015),
    # FP8 on channel-biased K: E4M3 V alone costs cosine 0.99932 / rel L1 0.0368 with exact scores
    # (experiments/accuracy_defaults §6); SageAttention2's own code measures 0.99930 / 0.0376 on
    # this input. The bar is the measured level (worst of seeds 0-4: 0.99922 / 0.0394) with margin.
    ("channel_bias_k", "qk_int8_pv_fp8"): (0.999, 0.045),
    ("outliers", "qk_int8_pv_fp16"): (0.999, 0.05),
    ("outliers", "qk_int8_pv_fp8"): (0.999, 0.05),
    # FP4 (issue 3): a cosine bar only (and NVFP4 better than MXFP4, checked in the tests)
    ("channel_bias_k", "qk_fp4_pv_fp4"): (0.975, None),
}
BAR_SHAPE = {"n": 4096, "head_dim": 128}

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Row:
    """One (family, recipe) measurement."""

    family: str
    recipe: str
    options: str  # options that differ from the named recipe's defaults, "" when none
    causal: bool
    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str
    seed: int
    device: str
    cosine: float
    rel_l1: float
    rmse: float
    seconds: float
    bar: str  # "ok" / "FAIL" against BARS where one applies (default options, bar shape), else ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def describe(recipe: Recipe) -> str:
    """The options of ``recipe`` that differ from its named defaults, e.g. ``"per_token smooth_q"``;
    ``"smooth_k=off"`` for a flag turned off. Empty for the defaults."""
    base = RECIPES.get(recipe.name)
    if base is None:
        return "custom"
    parts = []
    for f in dataclasses.fields(recipe):
        if f.name == "name":
            continue
        value, default = getattr(recipe, f.name), getattr(base, f.name)
        if value == default:
            continue
        if isinstance(value, bool):
            parts.append(f.name if value else f"{f.name}=off")
        elif f.name == "granularity":
            parts.append(str(value))
        else:
            parts.append(f"{f.name}={value}")
    return " ".join(parts)


def _bar_status(
    family: str, recipe: Recipe, n_q: int, n_k: int, head_dim: int, cos: float, l1: float
) -> str:
    bar = BARS.get((family, recipe.name))
    at_bar_shape = n_q == n_k == BAR_SHAPE["n"] and head_dim == BAR_SHAPE["head_dim"]
    if bar is None or describe(recipe) or not at_bar_shape:
        return ""
    return "ok" if cos >= bar[0] and (bar[1] is None or l1 <= bar[1]) else "FAIL"


def _progress(total: int, enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr, leave=False, unit="run")


def evaluate(
    recipes: Sequence["str | Recipe"],
    families: Sequence[str],
    *,
    n: int,
    head_dim: int,
    heads_q: int,
    heads_kv: int,
    causal: bool,
    seed: int,
    device: str | torch.device = "cpu",
    n_k: int | None = None,
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
    progress: bool = False,
) -> list[Row]:
    """Errors of each recipe against float64 exact attention, for each input family.

    Args:
        recipes: names (``"exact"`` gives a sanity row: fp32 exact attention, output rounded to
            ``dtype``), ``"name:key=value,..."`` specs (see :func:`parse_recipe`) or Recipes.
        families: keys of :data:`lowbit_attn.tools.inputs.FAMILIES`.
        n: query tokens (and key tokens unless ``n_k`` is given); head_dim, heads_q, heads_kv, batch:
            the shapes (``heads_q`` a multiple of ``heads_kv``).
        causal: bottom-right aligned causal mask.
        seed: each family's tensors are drawn from ``torch.Generator().manual_seed(seed)`` on the CPU,
            so every device and every recipe sees the same inputs.
        device: where the recipes run (``"cuda"``: Triton kernels; ``"cpu"``: PyTorch reference).
        progress: a tqdm progress bar when tqdm is installed and stderr is a terminal.
    Returns:
        one :class:`Row` per (family, recipe), families outermost.
    """
    resolved = [parse_recipe(r) for r in recipes]
    n_k = n if n_k is None else n_k
    device = torch.device(device)
    scale = head_dim ** -0.5
    offset = (n_k - n) if causal else None
    dtype_name = str(dtype).removeprefix("torch.")
    bar = _progress(len(families) * len(resolved), progress)
    rows: list[Row] = []
    try:
        for family in families:
            q, k, v = inputs.make(
                family, seed=seed, batch=batch, heads_q=heads_q, heads_kv=heads_kv, n_q=n, n_k=n_k,
                head_dim=head_dim, dtype=dtype, device=device,
            )
            ref, _ = exact_attention(q, k, v, scale=scale, causal_offset=offset, dtype=torch.float64)
            for recipe in resolved:
                if bar is not None:
                    bar.set_description(f"{family} {recipe.name}")
                start = time.perf_counter()
                out = attention(q, k, v, recipe=recipe, is_causal=causal, scale=scale, layout="HND")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start
                e = errors(out, ref)
                rows.append(Row(
                    family=family, recipe=recipe.name, options=describe(recipe), causal=causal,
                    batch=batch, heads_q=heads_q, heads_kv=heads_kv, n_q=n, n_k=n_k,
                    head_dim=head_dim, dtype=dtype_name, seed=seed, device=str(device),
                    cosine=e.cosine, rel_l1=e.rel_l1, rmse=e.rmse, seconds=seconds,
                    bar=_bar_status(family, recipe, n, n_k, head_dim, e.cosine, e.rel_l1),
                ))
                if bar is not None:
                    bar.update(1)
            del q, k, v, ref
    finally:
        if bar is not None:
            bar.close()
    return rows


def _shape(row: Row) -> str:
    heads = f"H{row.heads_q}" if row.heads_q == row.heads_kv else f"H{row.heads_q}/{row.heads_kv}"
    n = f"N{row.n_q}" if row.n_q == row.n_k else f"N{row.n_q}x{row.n_k}"
    return f"B{row.batch} {heads} {n} D{row.head_dim}{' causal' if row.causal else ''}"


def format_table(rows: Iterable[Row]) -> str:
    """A markdown table of the rows. Shape and option columns appear only when they vary / are set;
    the ``bar`` column only when a row is checked against :data:`BARS`."""
    rows = list(rows)
    if not rows:
        return "(no rows)"
    shapes = {_shape(r) for r in rows}
    show_shape = len(shapes) > 1
    show_options = any(r.options for r in rows)
    show_bar = any(r.bar for r in rows)
    header = ["family", "recipe"]
    if show_options:
        header.append("options")
    if show_shape:
        header.append("shape")
    header += ["cosine", "rel L1", "RMSE"]
    if show_bar:
        header.append("bar")
    lines = []
    if not show_shape:
        lines.append(f"{shapes.pop()}, {rows[0].dtype}, seed {rows[0].seed}, {rows[0].device}")
        lines.append("")
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        cells = [r.family, r.recipe]
        if show_options:
            cells.append(r.options or "defaults")
        if show_shape:
            cells.append(_shape(r))
        cells += [f"{r.cosine:.6f}", f"{r.rel_l1:.4g}", f"{r.rmse:.3g}"]
        if show_bar:
            cells.append(r.bar)
        lines.append("| " + " | ".join(cells) + " |")
    if show_bar:
        lines.append("")
        lines.append(
            "bar: the issue's quality bars at N=4096, D=128 for the default options — "
            + "; ".join(f"{f}/{r}: cosine ≥ {c}, rel L1 ≤ {l}" for (f, r), (c, l) in BARS.items())
        )
    return "\n".join(lines)


def _split_list(values: Sequence[str]) -> list[str]:
    """Items given as separate arguments and/or comma-separated (``--families a,b c``)."""
    return [item for value in values for item in value.split(",") if item]


class _Explicit(argparse.Action):
    """Store the option (``const`` for a flag, ``nargs=0``) and note its name in
    ``args.explicit``: --model has its own defaults, and an option of another mode is refused."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.explicit = {*getattr(namespace, "explicit", ()), self.dest}


# Options that only one mode reads: given in another, they are a usage error, not ignored.
SYNTHETIC_ONLY = ("n", "n_k", "head_dim", "batch", "heads", "kv_heads", "causal", "families",
                  "seed", "no_progress")
GENERATION_ONLY = ("gen_prompt", "gen_tokens", "kv_recipes")


def _refuse_other_modes(args: argparse.Namespace) -> None:
    """A usage error naming the first option given that the chosen mode would ignore."""
    explicit = getattr(args, "explicit", set())
    misplaced = [(name, "only with --generation") for name in GENERATION_ONLY
                 if name in explicit and not args.generation]
    misplaced += [(name, "only for synthetic inputs, without --model") for name in SYNTHETIC_ONLY
                  if name in explicit and args.model]
    if misplaced:
        name, where = misplaced[0]
        raise UsageError(f"argument --{name.replace('_', '-')}: {where}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``lowbit-attn accuracy``."""
    from lowbit_attn.core.checks import MAX_HEAD_DIM

    parser.add_argument("--n", action=_Explicit, type=positive_int, default=1024,
                        help="query (and key) tokens (default 1024)")
    parser.add_argument("--n-k", action=_Explicit, type=positive_int, default=None,
                        help="key tokens (default: --n)")
    parser.add_argument("--head-dim", action=_Explicit, type=head_dim_arg, default=128,
                        help=f"head dim D, 1 to {MAX_HEAD_DIM} (default 128)")
    parser.add_argument("--batch", action=_Explicit, type=positive_int, default=1,
                        help="batch size (default 1)")
    parser.add_argument("--heads", action=_Explicit, type=positive_int, default=2,
                        help="query heads (default 2)")
    parser.add_argument("--kv-heads", action=_Explicit, type=positive_int, default=None,
                        help="key/value heads, a divisor of --heads (default: --heads)")
    parser.add_argument("--causal", action=_Explicit, nargs=0, const=True, default=False,
                        help="bottom-right aligned causal mask")
    parser.add_argument(
        "--families", nargs="+", default=list(inputs.FAMILIES), metavar="FAMILY",
        action=_Explicit,
        help=f"input families, space- or comma-separated (default: all of {', '.join(inputs.FAMILIES)})",
    )
    parser.add_argument(
        "--recipes", nargs="+", default=list(DEFAULT_RECIPES), metavar="RECIPE", action=_Explicit,
        type=recipe_spec,
        help="recipes, each NAME or NAME:KEY=VALUE,... e.g. qk_int8_pv_fp8:granularity=per_token,"
             f"smooth_q=1 (default: {' '.join(DEFAULT_RECIPES)}; with --model: all but exact)",
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float16", action=_Explicit,
                        help="input dtype (default float16; with --model: float32 on a CPU)")
    parser.add_argument("--seed", action=_Explicit, type=ranged(int, 0, 2**64 - 1), default=0,
                        help="input seed (default 0)")
    parser.add_argument("--device", type=device_arg, default=None,
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--json", metavar="PATH", type=output_file, default=None,
                        help="also write the rows as JSON (into an existing directory)")
    parser.add_argument("--no-progress", action=_Explicit, nargs=0, const=True, default=False,
                        help="no progress bar")
    parser.add_argument(
        "--model", choices=("minilm", "smollm2", "all"), default=None,
        help="instead of synthetic inputs, compare each recipe with exact attention end to end in a "
             "real model (lowbit_attn.tools.model_accuracy; needs transformers and the model wheels)",
    )
    parser.add_argument(
        "--generation", action="store_true",
        help="with --model smollm2: greedy generation with the 8-bit KV cache (QuantizedCache), "
             "teacher-forced on the exact run's tokens (lowbit_attn.tools.generation_accuracy)",
    )
    parser.add_argument("--gen-prompt", action=_Explicit, type=positive_int, default=512,
                        metavar="P",
                        help="with --generation: prompt tokens (default 512)")
    parser.add_argument("--gen-tokens", action=_Explicit, type=positive_int, default=256,
                        metavar="G",
                        help="with --generation: generated tokens (default 256)")
    parser.add_argument("--kv-recipes", nargs="+", default=list(KV_RECIPES), action=_Explicit,
                        choices=list(KV_RECIPES), metavar="KV_RECIPE",
                        help=f"with --generation: KV cache recipes (default: {' '.join(KV_RECIPES)})")


def cli_main(args: argparse.Namespace) -> int:
    """Run :func:`evaluate` with parsed :func:`add_arguments` options, print the table; 0 on success.
    With ``--model``: :func:`lowbit_attn.tools.model_accuracy.cli_main` instead (with
    ``--generation``: :func:`lowbit_attn.tools.generation_accuracy.cli_main`)."""
    _refuse_other_modes(args)
    if args.generation:
        from lowbit_attn.tools import generation_accuracy

        return generation_accuracy.cli_main(args)
    if args.model:
        from lowbit_attn.tools import model_accuracy

        return model_accuracy.cli_main(args)
    from lowbit_attn.core.checks import recipe_fits

    families = _split_list(args.families)
    unknown = [f for f in families if f not in inputs.FAMILIES]
    if not families:
        raise UsageError("argument --families: no family named; choose from "
                         f"{list(inputs.FAMILIES)}")
    if unknown:
        raise UsageError(
            f"argument --families: unknown famil(ies) {unknown}; choose from "
            f"{list(inputs.FAMILIES)}"
        )
    # Recipe specs use commas for their options, so only split on whitespace (nargs) here.
    recipes = [parse_recipe(spec) for spec in args.recipes]  # each checked by argparse already
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads % kv_heads != 0:
        raise UsageError(
            f"argument --kv-heads: must divide --heads, got {kv_heads} and {args.heads}")
    try:
        for recipe in recipes:
            recipe_fits(recipe, args.head_dim)
    except ValueError as exc:
        raise UsageError(f"argument --head-dim: {exc}") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = evaluate(
        recipes, families, n=args.n, n_k=args.n_k, head_dim=args.head_dim, heads_q=args.heads,
        heads_kv=kv_heads, causal=args.causal, seed=args.seed, device=device, batch=args.batch,
        dtype=_DTYPES[args.dtype], progress=not args.no_progress,
    )
    print(format_table(rows))
    if args.json:
        payload = {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
            "rows": [r.as_dict() for r in rows],
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
            fh.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lowbit_attn.tools.accuracy``: the same as ``lowbit-attn accuracy``."""
    parser = argparse.ArgumentParser(prog="python -m lowbit_attn.tools.accuracy",
                                     description="Error of each recipe against exact attention.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cli_main(args)
    except UsageError as exc:
        parser.error(str(exc))  # exits 2, as ``lowbit-attn accuracy`` does


if __name__ == "__main__":
    sys.exit(main())
