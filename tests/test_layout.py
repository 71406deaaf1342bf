"""The package's layout rules, read from the source: calls go one way, the runtime never imports
the tooling, no import loop, no private name crosses a module, and the package root holds only the
public entry points; and, from a recorded call, the walk of ``q`` down to the INT8 kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lowbit_attn"
# Lower layers first; the families sit side by side and may use each other's public names.
LAYERS = {"core": 0, "quant": 1, "inference": 2, "training": 2, "vsa": 2, "kvcache": 2,
          "integrations": 3, "compat": 3, "tools": 4}
ROOT_MODULES = {"__init__.py"}
PUBLIC_PATHS = {"lowbit_attn.fp4": "lowbit_attn.quant.fp4_interface",
                "lowbit_attn.parallel": "lowbit_attn.integrations.parallel",
                "lowbit_attn.tiles": "lowbit_attn.vsa.tiles"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import of a lowbit_attn module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            if node.module and node.module.split(".")[0] == "lowbit_attn":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.append((sub, None, node.lineno) if sub in MODULES
                                 else (node.module, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names
                      if a.name.split(".")[0] == "lowbit_attn"]
    return found


GRAPH = {m: {d for d, _, _ in _imports(p) if d != m} for m, p in MODULES.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_root_holds_only_folders_and_the_public_entry_points():
    files = {p.name for p in PACKAGE.glob("*.py")}
    assert files == ROOT_MODULES


@pytest.mark.parametrize("path", sorted(PUBLIC_PATHS))
def test_the_public_module_paths_name_the_family_modules(path):
    import importlib

    module = importlib.import_module(path)
    assert module is importlib.import_module(PUBLIC_PATHS[path])
    assert module is getattr(importlib.import_module("lowbit_attn"), path.split(".")[-1])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m)))
def test_imports_go_down_and_the_runtime_never_imports_tools(module):
    here = LAYERS[_layer(module)]
    for dep in GRAPH[module]:
        layer = _layer(dep)
        if layer is None:  # the package root: only the tools (on top of everything) use it
            assert _layer(module) == "tools", f"{module} imports the package root {dep}"
            continue
        assert LAYERS[layer] <= here, f"{module} imports {dep}, a higher layer"
        assert layer != "tools" or _layer(module) == "tools", f"{module} imports tooling {dep}"


def test_no_private_name_crosses_a_module():
    crossings = [f"{m}: {name} from {dep}" for m, p in MODULES.items()
                 for dep, name, _ in _imports(p) if name is not None and name.startswith("_")
                 and not name.startswith("__")]
    assert not crossings


def test_no_import_loop():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(GRAPH.get(module, ())):
            if dep not in GRAPH:
                continue
            assert state.get(dep) != 1, "import loop: " + " -> ".join(path + [module, dep])
            if dep not in state:
                visit(dep, path + [module])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])


def test_the_walk_of_q_from_attention_to_the_int8_kernel(monkeypatch):
    """``q`` goes down one chain of calls: the files on the stack at each launch that reads ``q``
    (statistics, its quantization) or its INT8 values (the attention kernel) are at most seven,
    interface → op → planned (an eager call's launch plans) → core.plans (their table) → prepare
    → quantizer | kernel.
    Validation (``core.checks``) is a side call that returns before the chain starts. Nothing
    runs: the launches are recorded."""
    import traceback

    import torch
    from triton.runtime.jit import KernelInterface

    import lowbit_attn
    from lowbit_attn.inference import kernel_int8
    from lowbit_attn.tools.aot import Launch, kernel_modules

    int8_attention = kernel_int8._attn_fwd_int8
    launches: list[tuple[set[str], list[torch.Tensor], object]] = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                files = {str(Path(f.filename).relative_to(PACKAGE)) for f in traceback.extract_stack()
                         if Path(f.filename).is_relative_to(PACKAGE)}
                launches.append((files, Launch(self.kernel, args, kwargs, grid).tensors(),
                                 self.kernel))
            return launch

    # every module imported before any is patched: a later import would bind a recorder
    for module in kernel_modules(("core", "quant", "inference")):
        for name, obj in list(vars(module).items()):
            if isinstance(obj, KernelInterface):
                monkeypatch.setattr(module, name, Recorder(obj))
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    q, k, v = torch.randn(3, 1, 2, 128, 64, dtype=torch.float16).unbind(0)
    lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")

    storage = q.untyped_storage().data_ptr()
    attention = [files for files, _, kernel in launches if kernel is int8_attention]
    reads_q = [files for files, tensors, _ in launches
               if any(t.untyped_storage().data_ptr() == storage for t in tensors)]
    assert len(attention) == 1 and reads_q
    walk = set().union(*attention, *reads_q)
    assert walk == {"inference/interface.py", "inference/op.py", "inference/planned.py",
                    "core/plans.py", "inference/prepare.py", "quant/int8.py", "inference/kernel_int8.py"}, sorted(walk)
