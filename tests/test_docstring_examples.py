"""Every public function and class (``lowbit_attn.__all__`` and the public names the API pages
document, ``docs/hooks.py``'s ``public_names``) has an ``Examples:`` section in its docstring, and
each runs as written: ``doctest`` on CPU tensors (the reference path, or the kernels under Triton's
interpreter where ``LOWBIT_ATTN_BACKEND=triton``), tiny shapes."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect

import pytest

pytest.importorskip("griffe", reason="needs griffelib: pip install 'lowbit-attention[test]'")

from helpers import docs_hooks  # noqa: E402

hooks = docs_hooks()
PACKAGE = hooks.load()


def _callables() -> list[str]:
    """Public functions and classes, one name per object (a re-export counts once)."""
    names, seen = [], set()
    for name in hooks.public_names(PACKAGE):
        obj = hooks.lookup(PACKAGE, name)
        if (obj.is_function or obj.is_class) and obj.path not in seen:
            seen.add(obj.path)
            names.append(name)
    return names


CALLABLES = _callables()


# Public modules that need an optional dependency, and that dependency: their examples run where
# it is installed (make test's venv) and skip elsewhere (test-newest's and test-oldest's).
OPTIONAL = {"lowbit_attn.integrations.transformers": "transformers",
            "lowbit_attn.integrations.diffusers": "diffusers"}


def _resolve(name: str):
    module, attr = name.rsplit(".", 1)
    needs = OPTIONAL.get(module)
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{name} needs {needs}: pip install 'lowbit-attention[{needs}]'")
    return getattr(importlib.import_module(module), attr)


def test_the_collection_covers_the_package():
    assert "lowbit_attn.attention" in CALLABLES and "lowbit_attn.Recipe" in CALLABLES
    assert len(CALLABLES) >= 40


@pytest.mark.parametrize("name", CALLABLES)
def test_every_public_callable_has_examples(name):
    doc = inspect.getdoc(_resolve(name)) or ""
    assert "\nExamples:\n" in doc and ">>> " in doc, f"{name}: no Examples section with >>> lines"


@pytest.mark.parametrize("name", CALLABLES)
def test_the_examples_run(name, monkeypatch):
    obj = _resolve(name)
    module = importlib.import_module(name.rsplit(".", 1)[0])
    finder = doctest.DocTestFinder(recurse=False)
    tests = [t for t in finder.find(obj, name, module=module, globs={}) if t.examples]
    assert tests, f"{name}: no examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
