"""Checks that fail ``mkdocs build`` (and ``tests/test_docs.py``) when the documentation falls
behind the code: a public name without an API entry or a docstring, a public function whose
docstring leaves out an argument, its return value or its errors, or whose Returns section reads
as several entries (continuation lines not indented), a public function or class without an
``Examples:`` section (``tests/test_docstring_examples.py`` runs them), an environment variable
read in ``src/`` that ``environment.md`` does not list, and a built page with a multi-row Returns
table. The names come from the source, statically (griffe, as mkdocstrings reads it): nothing is
imported. The hooks also put the package's version in the header and take the repository's
address from ``[project.urls]``.
"""

from __future__ import annotations

import ast
import functools
import logging
import re
import textwrap
from pathlib import Path

import griffe
import yaml

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOCS = ROOT / "docs"
PACKAGE = "lowbit_attn"

# Public modules whose ``__all__`` users are pointed to, besides the package's own.
SUBPACKAGES = ("integrations.transformers", "integrations.diffusers", "compat",
               "compat.sageattention", "compat.flash_attn", "compat.flash_attn_interface",
               "kvcache")
# Public names of modules without an ``__all__``, named by the guides.
EXTRA = ("tiles.to_tile_order", "tiles.from_tile_order", "compat.fastvideo.video_sparse_attn",
         "integrations.sdpa.reset_fallback_warnings", "core.counters.kernel_calls")
# Functions that take arguments and raise nothing of their own (a Raises section is not due).
NO_RAISES = {
    "lowbit_attn.unpatch_sdpa",  # an inactive patch gives False
    "lowbit_attn.Errors",  # a plain record of three floats
}
ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$")
ENV_VAR = re.compile(r"\bLOWBIT_ATTN_[A-Z0-9_]+\b")


def load() -> griffe.Module:
    return griffe.load(PACKAGE, search_paths=[str(SRC)], resolve_aliases=True,
                       resolve_external=False)


def target(obj):
    return obj.final_target if obj.is_alias else obj


def public_names(pkg: griffe.Module) -> list[str]:
    """Every public path: the package's ``__all__``, the ``__all__`` of the modules in it and of
    :data:`SUBPACKAGES`, and :data:`EXTRA`."""
    names = [f"{PACKAGE}.{n}" for n in pkg.exports]
    modules = [n for n in pkg.exports if target(pkg[n]).is_module] + list(SUBPACKAGES)
    for module in modules:
        names += [f"{PACKAGE}.{module}.{n}" for n in target(pkg[module]).exports or ()]
    names += [f"{PACKAGE}.{n}" for n in EXTRA]
    return list(dict.fromkeys(names))


def directives(docs: Path = DOCS) -> dict[str, dict]:
    """``::: path`` → its options, from every page under ``docs/``."""
    found = {}
    for page in sorted(docs.rglob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            match = DIRECTIVE.match(line)
            if not match:
                continue
            block = []
            for more in lines[i + 1:]:
                if more.strip() and not more.startswith("    "):
                    break
                block.append(more)
            options = yaml.safe_load(textwrap.dedent("\n".join(block))) or {}
            found[match.group(1)] = options.get("options", {})
    return found


def lookup(pkg: griffe.Module, path: str):
    return target(pkg[path.removeprefix(PACKAGE + ".")])


def missing_entries(pkg: griffe.Module, documented: dict[str, dict]) -> list[str]:
    """Public names whose object no API directive documents (a name and its re-export count as
    one: ``lowbit_attn.attention`` is ``lowbit_attn.inference.attention``)."""
    shown = {lookup(pkg, path).path for path in documented}
    return [name for name in public_names(pkg) if lookup(pkg, name).path not in shown]


def _returns_value(fn) -> bool:
    """Whether ``fn``'s own body returns a value or yields (nested functions left out)."""
    tree = ast.parse(textwrap.dedent("\n".join(fn.lines)))
    body = tree.body[0]

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                  ast.ClassDef)):
                continue
            if isinstance(child, (ast.Yield, ast.YieldFrom)):
                return True
            if isinstance(child, ast.Return) and child.value is not None and not (
                    isinstance(child.value, ast.Constant) and child.value.value is None):
                return True
            if walk(child):
                return True
        return False

    return walk(body)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _parse(obj) -> tuple[dict, list[str]]:
    """The docstring's sections by kind, and the parser's warnings."""
    handler = _Warnings()
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        sections = obj.docstring.parse("google", warn_missing_types=False) if obj.docstring else []
    finally:
        logger.removeHandler(handler)
    kinds: dict = {}
    for section in sections:
        kinds.setdefault(section.kind.value, []).append(section)
    return kinds, handler.messages


def _parameters(fn) -> list[str]:
    return [p.name for p in fn.parameters if p.name not in ("self", "cls")]


def docstring_problems(obj, name: str) -> list[str]:
    """What the docstring of a public function, method or class leaves out."""
    if not obj.docstring or not obj.docstring.value.strip():
        return [f"{name}: no docstring"]
    if not (obj.is_function or obj.is_class):
        return []
    kinds, warnings = _parse(obj)
    problems = [f"{name}: {w}" for w in warnings]
    fn = obj.members.get("__init__") if obj.is_class else obj
    if fn is None or not fn.is_function:
        return problems
    documented = {p.name.lstrip("*") for s in kinds.get("parameters", [])
                  + kinds.get("attributes", []) + kinds.get("other parameters", [])
                  for p in s.value}
    params = _parameters(fn)
    problems += [f"{name}: argument {p!r} is not documented" for p in params
                 if p not in documented]
    if obj.is_function and _returns_value(obj) and "returns" not in kinds \
            and "yields" not in kinds:
        problems.append(f"{name}: no Returns section")
    if params and "raises" not in kinds and name not in NO_RAISES:
        problems.append(f"{name}: no Raises section")
    for kind in ("returns", "yields"):
        for section in kinds.get(kind, []):
            if len(section.value) > 1:
                problems.append(f"{name}: its {kind.title()} section reads as {len(section.value)} "
                                "entries: indent its continuation lines")
    return problems


def example_problems(obj, name: str) -> list[str]:
    """A public function or class without an ``Examples:`` section of ``>>>`` lines
    (``tests/test_docstring_examples.py`` runs them)."""
    if not (obj.is_function or obj.is_class) or not obj.docstring:
        return []
    kinds, _ = _parse(obj)
    if not any(">>>" in str(section.value) for section in kinds.get("examples", [])):
        return [f"{name}: no Examples section"]
    return []


def all_docstring_problems(pkg: griffe.Module, documented: dict[str, dict]) -> list[str]:
    """Docstring problems of every public name and of the methods the API pages show."""
    problems = []
    for name in public_names(pkg):
        obj = lookup(pkg, name)
        problems += docstring_problems(obj, name) + example_problems(obj, name)
    for path, options in documented.items():
        obj = lookup(pkg, path)
        for member in options.get("members") or ():
            if isinstance(member, str):
                problems += docstring_problems(obj.members[member], f"{path}.{member}")
    return list(dict.fromkeys(problems))


def env_vars_in_src(src: Path = SRC) -> set[str]:
    return {m for f in src.rglob("*.py") for m in ENV_VAR.findall(f.read_text())}


def missing_env_vars(docs: Path = DOCS, src: Path = SRC) -> list[str]:
    page = (docs / "environment.md").read_text()
    return sorted(v for v in env_vars_in_src(src) if not re.search(rf"`{v}`", page))


def problems() -> list[str]:
    pkg = load()
    documented = directives()
    return ([f"no API entry for {n}" for n in missing_entries(pkg, documented)]
            + all_docstring_problems(pkg, documented)
            + [f"environment.md does not list {v}" for v in missing_env_vars()])


@functools.cache
def linkable() -> frozenset[str]:
    """The paths the API pages render: public names, directives and their public members."""
    pkg = load()
    documented = directives()
    paths = set(public_names(pkg)) | set(documented)
    for path in documented:
        obj = lookup(pkg, path)
        paths |= {f"{path}.{m}" for m in obj.members if not m.startswith("_")}
    return frozenset(paths)


def _role(match: re.Match) -> str:
    """One role as Markdown: a link (mkdocs-autorefs) to a name the API pages render, code
    otherwise."""
    tilde, path = match.groups()
    shown = path.rsplit(".", 1)[-1] if tilde else path
    return f"[`{shown}`][{path}]" if path in linkable() else f"`{shown}`"


def plain_markdown(text: str) -> str:
    """A docstring's reStructuredText habits in Markdown: ``:func:`~lowbit_attn.a``` → a link to
    ``lowbit_attn.a`` shown as ```a```, a role naming something else → code, a literal block's
    ``::`` → ``:``."""
    return re.sub(r"::$", ":", ROLE.sub(_role, text), flags=re.MULTILINE)


RETURNS_TABLE = re.compile(r'doc-section-title">(Returns|Yields):</span></p>\s*<table>.*?<tbody>(.*?)'
                           r"</tbody>", re.DOTALL)


def split_returns(html: str) -> list[str]:
    """The Returns/Yields tables of a built page that have more than one row: a docstring whose
    continuation lines were read as entries of their own."""
    return [f"{m.group(1)} table with {n} rows" for m in RETURNS_TABLE.finditer(html)
            if (n := m.group(2).count('class="doc-section-item"')) > 1]


class SphinxRoles(griffe.Extension):
    """Griffe extension (mkdocs.yml: ``extensions``) that renders the docstrings' roles as code."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_markdown(obj.docstring.value)


def on_files(files, config, **kwargs):  # mkdocs hook
    """The charts of ``benchmarks/results/`` as ``results/<name>.png`` of the site, so pages show
    them without a copy in ``docs/``."""
    from mkdocs.structure.files import File

    results = ROOT / "benchmarks" / "results"
    for png in sorted(results.rglob("*.png")):
        files.append(File(f"results/{png.relative_to(results).as_posix()}", str(ROOT / "benchmarks"),
                          config["site_dir"], config["use_directory_urls"]))
    return files


def version(src: Path = SRC) -> str:
    """``lowbit_attn.__version__``, read from the source without importing torch."""
    text = (src / PACKAGE / "__init__.py").read_text()
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    return match.group(1) if match else "unknown"


def project_urls(root: Path = ROOT) -> dict[str, str]:
    """``[project.urls]`` of ``pyproject.toml``."""
    import tomllib

    return tomllib.loads((root / "pyproject.toml").read_text())["project"].get("urls", {})


def on_config(config, **kwargs):  # mkdocs hook
    """The version in the header and the footer; the repository and the site's address from
    ``[project.urls]`` (``Repository``/``Source``, ``Documentation``) when the package names them."""
    v = version()
    config["site_name"] = f"{config['site_name']} {v}"
    config["copyright"] = f"lowbit_attn {v} · Apache-2.0"
    urls = {k.lower(): u for k, u in project_urls().items()}
    repo = urls.get("repository") or urls.get("source")
    if repo and not config.get("repo_url"):
        config["repo_url"] = repo
    if urls.get("documentation") and not config.get("site_url"):
        config["site_url"] = urls["documentation"]
    return config


def on_page_content(html, page, **kwargs):  # mkdocs hook
    from mkdocs.exceptions import PluginError

    found = split_returns(html)
    if found:
        raise PluginError(f"{page.file.src_path}: " + "; ".join(found))
    return html


def on_pre_build(config, **kwargs) -> None:  # mkdocs hook
    from mkdocs.exceptions import PluginError

    found = problems()
    if found:
        raise PluginError("the documentation falls behind the code:\n  " + "\n  ".join(found))

