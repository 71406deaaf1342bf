"""The documentation keeps up with the code: the same checks ``make docs`` runs (``docs/hooks.py``),
without building the site. Every public name has an API entry, every public function's docstring
gives its arguments, what it returns and what it raises, and every ``LOWBIT_ATTN_*`` variable read
in ``src/`` is on the environment page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("griffe", reason="needs griffelib: pip install 'lowbit-attention[test]'")

import lowbit_attn  # noqa: E402
from helpers import docs_hooks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
hooks = docs_hooks()


@pytest.fixture(scope="module")
def package():
    return hooks.load()


def test_the_public_names_are_the_packages_all(package):
    names = hooks.public_names(package)
    assert [f"lowbit_attn.{n}" for n in lowbit_attn.__all__] == names[:len(lowbit_attn.__all__)]
    for module in ("vsa", "parallel", "fp4"):
        for n in getattr(lowbit_attn, module).__all__:
            assert f"lowbit_attn.{module}.{n}" in names


def test_every_public_name_has_an_api_entry(package):
    assert hooks.missing_entries(package, hooks.directives()) == []


def test_every_public_docstring_gives_arguments_returns_and_errors(package):
    assert hooks.all_docstring_problems(package, hooks.directives()) == []


def test_the_environment_page_lists_every_variable_read_in_src():
    found = hooks.env_vars_in_src()
    assert "LOWBIT_ATTN_BACKEND" in found and "LOWBIT_ATTN_LAUNCH" in found
    assert hooks.missing_env_vars() == []


def test_a_public_name_without_an_entry_is_found(package, tmp_path):
    (tmp_path / "api.md").write_text("::: lowbit_attn.attention\n")
    missing = hooks.missing_entries(package, hooks.directives(tmp_path))
    assert "lowbit_attn.trainable_attention" in missing
    assert "lowbit_attn.attention" not in missing


def test_an_incomplete_docstring_is_found():
    import griffe

    with griffe.temporary_visited_module('''
def scale(x, factor):
    """Scale ``x``.

    Args:
        x: a tensor.
    """
    if factor <= 0:
        raise ValueError("factor")
    return x * factor
''') as module:
        problems = hooks.docstring_problems(module["scale"], "m.scale")
    assert any("argument 'factor'" in p for p in problems)
    assert any("no Returns" in p for p in problems)
    assert any("no Raises" in p for p in problems)


def test_an_environment_variable_missing_from_its_page_is_found(tmp_path):
    src, docs = tmp_path / "src", tmp_path / "docs"
    src.mkdir(), docs.mkdir()
    (src / "m.py").write_text('os.environ.get("LOWBIT_ATTN_NEW_SWITCH", "off")\n')
    (docs / "environment.md").write_text("| `LOWBIT_ATTN_OTHER` | … |\n")
    assert hooks.missing_env_vars(docs, src) == ["LOWBIT_ATTN_NEW_SWITCH"]


def test_roles_become_links_or_code():
    text = ("See :func:`~lowbit_attn.attention`, :class:`lowbit_attn.Recipe` and "
            ":func:`torch.compile`::\n")
    assert hooks.plain_markdown(text) == ("See [`attention`][lowbit_attn.attention], "
                                          "[`lowbit_attn.Recipe`][lowbit_attn.Recipe] and "
                                          "`torch.compile`:\n")


def test_a_returns_section_split_into_entries_is_found():
    import griffe

    with griffe.temporary_visited_module('''
def f(x):
    """Do.

    Args:
        x: a tensor.

    Returns:
        The output, or with a flag a tuple of the output and
        the LSE.

    Raises:
        ValueError: never.
    """
    return x
''') as module:
        problems = hooks.docstring_problems(module["f"], "m.f")
    assert any("Returns section reads as 2 entries" in p for p in problems)


def test_a_built_page_with_a_split_returns_table_is_found():
    row = '<tr class="doc-section-item"><td></td><td>x</td></tr>'
    html = ('<p><span class="doc-section-title">Returns:</span></p>\n<table><thead></thead>'
            f"<tbody>{row}{row}</tbody></table>")
    assert hooks.split_returns(html) == ["Returns table with 2 rows"]
    assert hooks.split_returns(html.replace(row + row, row)) == []


def test_a_public_function_without_examples_is_found():
    import griffe

    with griffe.temporary_visited_module('''
def f():
    """Do nothing."""
''') as module:
        assert hooks.example_problems(module["f"], "m.f") == ["m.f: no Examples section"]


def test_the_api_index_links_every_entry():
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    assert [p for p in hooks.directives() if f"][{p}]" not in index] == []


def test_the_site_shows_the_version():
    assert hooks.version() == lowbit_attn.__version__


def test_the_home_pages_snippet_runs():
    text = (ROOT / "docs" / "index.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks, "docs/index.md has a python block"
    for block in blocks:
        exec(compile(block, "docs/index.md", "exec"), {})
