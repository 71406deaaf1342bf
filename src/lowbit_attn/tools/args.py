"""Command-line argument types shared by the ``lowbit-attn`` subcommands: a bad value is a usage
error (exit 2, one line naming the option) before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Callable

from lowbit_attn.core.checks import MAX_HEAD_DIM
from lowbit_attn.core.recipes import RECIPES, Recipe, get_recipe



class UsageError(Exception):
    """A bad combination of options, found by a subcommand's ``cli_main`` after parsing (before
    any work); ``lowbit-attn`` reports it as argparse reports a bad option."""


def ranged(kind: type, low: float, high: float | None = None) -> Callable[[str], float]:
    """argparse type: ``kind(text)`` (``int`` or ``float``), finite, in ``[low, high]``."""
    bounds = f">= {low}" if high is None else f"between {low} and {high}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {kind.__name__} {bounds}, got {text!r}") from None
        finite = not isinstance(value, float) or math.isfinite(value)
        if not finite or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


# Sizes (counts, tokens): at most 2**31 - 1, what torch's shapes and the kernels' int32 take
positive_int = ranged(int, 1, 2**31 - 1)
head_dim_arg = ranged(int, 1, MAX_HEAD_DIM)


def device_arg(text: str) -> str:
    """argparse type for ``--device``: ``cpu``, or ``cuda``/``cuda:N`` of a GPU that is there."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here; use cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} GPU(s)")
    return text


def output_file(text: str) -> str:
    """argparse type for a file to write at the end: its directory must exist now."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory" if os.path.isdir(text) else f"no directory {folder!r}"
        )
    return text


def output_dir(text: str) -> str:
    """argparse type for a folder to write into: made now if missing (so that a path that
    cannot be one fails before any work), and writable."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the directory {text!r}: "
                                         f"{exc.strerror}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}")
    return text


def parse_recipe(spec: str | Recipe) -> Recipe:
    """``"qk_int8_pv_fp8"`` or ``"qk_int8_pv_fp8:granularity=per_token,smooth_q=1"`` → Recipe."""
    if isinstance(spec, Recipe):
        return spec
    name, _, opts = spec.partition(":")
    if name.strip() not in RECIPES:  # get_recipe's message offers "auto", which names no recipe
        raise ValueError(f"unknown recipe {name.strip()!r}; expected one of {sorted(RECIPES)}")
    recipe = get_recipe(name.strip())
    if not opts.strip():
        return recipe
    fields = {f.name: f for f in dataclasses.fields(Recipe)}
    changes = {}
    for item in opts.split(","):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in fields or key == "name":
            raise ValueError(
                f"recipe option {item!r} in {spec!r} must be KEY=VALUE with KEY one of "
                f"{sorted(k for k in fields if k != 'name')}"
            )
        current = getattr(recipe, key)
        if isinstance(current, bool):
            if raw.lower() not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                raise ValueError(f"recipe option {key} needs a boolean (1/0, on/off), got {raw!r}")
            changes[key] = raw.lower() in ("1", "true", "on", "yes")
        elif isinstance(current, int):
            try:
                changes[key] = int(raw)
            except ValueError:
                raise ValueError(f"recipe option {key} needs an int, got {raw!r}") from None
        else:
            changes[key] = raw
    return recipe.replace(**changes)


def recipe_spec(text: str) -> str:
    """argparse type for ``--recipes``: the spec unchanged, once :func:`parse_recipe` accepts it."""
    try:
        parse_recipe(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
