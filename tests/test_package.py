"""The package's shape: imports flow one way (no import circles), nothing queries a GPU or
needs TileLang at import, the public surface is what users import, files stay small."""

import ast
import pathlib
import subprocess
import sys

import flash_qla_cp

PACKAGE = pathlib.Path(flash_qla_cp.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """{module: modules of the package it imports}, at any depth of its code (function-level
    imports count: they are circles all the same, only deferred)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
                for alias in node.names:  # `from . import x` may name a submodule
                    edges.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict):
    """One import circle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_circles():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_layers_import_downward_only():
    """ops never imports the CP layer; the kernels and references never import the op layers."""
    graph = import_graph()
    upper = {"flash_qla_cp.api", "flash_qla_cp.modules", "flash_qla_cp.parallel"}
    for name, edges in graph.items():
        ups = {e for e in edges if any(e == u or e.startswith(u + ".") for u in upper)}
        if name == "flash_qla_cp.ops" or name.startswith(("flash_qla_cp.kernels", "flash_qla_cp.reference")):
            assert not ups, (name, ups)
        if name.startswith(("flash_qla_cp.kernels", "flash_qla_cp.reference")):
            assert "flash_qla_cp.ops" not in edges, name
        if name.startswith("flash_qla_cp.reference"):
            assert not any(e.startswith("flash_qla_cp.kernels") for e in edges), name


def test_import_needs_no_gpu_and_no_tilelang():
    code = ("import sys, torch; torch.cuda.is_available = None; torch.cuda.get_device_properties = None; "
            "import flash_qla_cp, flash_qla_cp.kernels.lowering, flash_qla_cp.kernels.backward; "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_surface():
    assert set(flash_qla_cp.__all__) == {
        "CPContext", "CPError", "GatedDeltaNet", "KernelOptions", "chunk_gated_delta_rule",
        "chunk_gated_delta_rule_bwd", "chunk_gated_delta_rule_fwd", "replace_qwen3_next_gdn", "__version__"}


def test_package_files_stay_small():
    big = {p.name: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not big, big


def test_scripts_import_what_the_package_has():
    """Every `from flash_qla_cp... import name` in the benchmarks, tools and examples names a
    module and attribute that exist (imports inside GPU-only functions run nowhere else on CPU)."""
    import importlib

    root = pathlib.Path(flash_qla_cp.__file__).parent.parent
    missing = []
    for path in sorted(p for d in ("benchmarks", "tools", "examples") for p in (root / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("flash_qla_cp"):
                try:
                    module = importlib.import_module(node.module)
                except ImportError as exc:
                    missing.append(f"{path.name}: {node.module} ({exc})")
                    continue
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.name}: {node.module}.{alias.name}")
    assert not missing, missing
