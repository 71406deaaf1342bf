"""The documentation keeps up with the code: the same checks ``make docs`` runs (``docs/hooks.py``),
without building the site. Every public name has an API entry, every public function's docstring
gives its arguments, what it returns and what it raises, and every ``LOWBIT_ATTN_*`` variable read
in ``src/`` is on the environment page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("griffe", reason="needs griffelib: pip install 'lowbit-attention[test]'")

import lowbit_attn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


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


def test_roles_become_code():
    text = "See :func:`~lowbit_attn.attention` and :class:`lowbit_attn.Recipe`::\n"
    assert hooks.plain_markdown(text) == "See `attention` and `lowbit_attn.Recipe`:\n"
