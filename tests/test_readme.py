"""The README stays short, its links resolve, and every figure it or a page of ``docs/`` gives
comes from a results file it names.

A *measured block* of a page (a paragraph, a list item run or a table, fenced code left out) is one
that speaks of speed or accuracy: TOP/s, µs, ms, TB/s, a ratio (``1.07×``, not ``2×32``), cosine
or relative L1. Such a block
must name at least one existing results file, under ``benchmarks/results/`` or ``experiments/`` (a
table may name them in a row, or in the paragraph just before or after it), and every number in it
(outside code spans, link targets and section signs, and not part of a name such as ``fp16`` or
``H200``) must be in one of those files: the same text, or a number there that rounds to it at the
precision the page shows. ``benchmarks/NOTES.md`` is a notebook, not a results file. On the pages
of ``docs/`` the check is for speed figures (TOP/s, µs, ms, TB/s, ratios); a block that defines a
unit or a threshold instead carries ``<!-- no figures -->``.

The H200 summary those pages cite is written by ``benchmarks/summarize_h200.py`` from the raw files
beside it; a test checks that it is what the script writes.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

from helpers import script_module

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 120

SPEED = r"TOP/s|µs|\bms\b|TB/s|\d\s?×(?!\s?\d)"
MEASURED = re.compile(SPEED + r"|cosine|rel(?:ative)? L1", re.IGNORECASE)
# The docs pages: speed figures (their accuracy tables cite tests and experiments of their own).
MEASURED_SPEED = re.compile(SPEED)
# A block that defines a unit or a threshold rather than reporting a measurement says so.
NO_FIGURES = "<!-- no figures -->"
# The changelog records what each change's notes said on its day; it is not checked.
UNCHECKED_PAGES = {"changelog.md"}
NUMBER = re.compile(r"(?<![A-Za-z_\d.])\d+(?:\.\d+)?")
SOURCE = re.compile(r"`((?:benchmarks/results|experiments)/[^`\s]+)`")
CODE_SPAN = re.compile(r"`[^`]*`")
SECTION = re.compile(r"§\s*\d+[a-z]?")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
LINK_TARGET = re.compile(r"\]\(([^)]*)\)")


def blocks(text: str) -> list[list[str]]:
    """The README's paragraphs and tables (runs of non-blank lines), fenced code left out."""
    out, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.strip():
            current.append(line)
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def is_table(block: list[str]) -> bool:
    return all(line.startswith("|") for line in block)


def sources(text: str) -> list[Path]:
    return [ROOT / path for path in SOURCE.findall(text)]


def figures(text: str) -> list[str]:
    """The numbers of ``text`` outside code spans, link targets, section signs and dates."""
    text = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", text))
    return NUMBER.findall(DATE.sub(" ", SECTION.sub(" ", text)))


def _file_numbers(path: Path) -> tuple[str, list[Decimal]]:
    text = path.read_text()
    values = [Decimal(m) for m in NUMBER.findall(text)]
    if path.suffix == ".json":  # full-precision floats, as json writes them
        values += [Decimal(repr(x)) for x in _json_numbers(json.loads(text))]
    return text, values


def _json_numbers(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _json_numbers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _json_numbers(value)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield node


def found_in(figure: str, files: list[Path], cache: dict) -> bool:
    """``figure`` as text in one of ``files``, or a number there that rounds to it."""
    want = Decimal(figure)
    step = Decimal(1).scaleb(want.as_tuple().exponent)
    for path in files:
        if path not in cache:
            cache[path] = _file_numbers(path)
        text, values = cache[path]
        if re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", text):
            return True
        if any(abs(v - want) <= step / 2 for v in values):
            return True
    return False


def unsourced_figures(page: str, measured: re.Pattern = MEASURED) -> list[str]:
    """What a measured block of ``page`` says without a named file that holds it."""
    problems, cache = [], {}
    parts = blocks(page)
    for i, block in enumerate(parts):
        text = "\n".join(block)
        if not measured.search(text) or NO_FIGURES in text:
            continue
        block_sources = sources(text)
        if is_table(block):
            for j in (i - 1, i + 1):
                if 0 <= j < len(parts) and not is_table(parts[j]):
                    block_sources += sources("\n".join(parts[j]))
        rows = block if is_table(block) else [text]
        for row in rows:
            files = sources(row) or block_sources
            missing = [f for f in files if not f.is_file()]
            if missing:
                problems.append(f"{row[:60]!r}: no such file {missing[0].relative_to(ROOT)}")
                continue
            if not files:
                if figures(row):
                    problems.append(f"{row[:60]!r}: measured figures without a named file")
                continue
            for figure in figures(row):
                if not found_in(figure, files, cache):
                    names = ", ".join(str(f.relative_to(ROOT)) for f in files)
                    problems.append(f"{row[:60]!r}: {figure} is not in {names}")
    return problems


def test_the_readme_fits_its_line_budget():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_every_figure_of_the_readme_is_in_the_results_file_it_names():
    assert unsourced_figures(README.read_text()) == []


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
                                        if p.name not in UNCHECKED_PAGES))
def test_every_speed_figure_of_a_docs_page_is_in_the_results_file_it_names(page):
    assert unsourced_figures((DOCS / page).read_text(), MEASURED_SPEED) == []


def test_the_h200_summary_is_what_its_script_writes():
    module = script_module("benchmarks/summarize_h200.py")
    assert module.main(["--check"]) == 0, "run python benchmarks/summarize_h200.py"


def test_the_readme_links_resolve():
    text = README.read_text()
    targets = [t.split("#")[0] for t in LINK_TARGET.findall(text) if "://" not in t]
    assert targets, "the README links to its documentation"
    assert [t for t in targets if t and not (ROOT / t).exists()] == []


@pytest.mark.parametrize("text, problem", [
    pytest.param("| a | b |\n|---|---|\n| x | 512 TOP/s |\n", "without a named file",
                 id="no-source"),
    pytest.param("It runs at 513 TOP/s (`benchmarks/results/h200-2026-11-27/summary.md`).\n",
                 "513 is not in", id="figure-not-in-file"),
    pytest.param("Cosine 0.999 (`benchmarks/results/missing.md`).\n", "no such file",
                 id="missing-file"),
    pytest.param("17.0 µs per call (`benchmarks/NOTES.md` §16b).\n", "without a named file",
                 id="notebook-is-no-source"),
])
def test_the_check_catches_a_figure_without_its_source(text, problem):
    found = unsourced_figures(text)
    assert found and problem in found[0]


def test_a_figure_rounds_from_its_file():
    text = "dQ cosine 0.99890 (`experiments/sagebwd/grad_accuracy.json`).\n"
    assert unsourced_figures(text) == []
    assert unsourced_figures(text.replace("0.99890", "0.91234"))
