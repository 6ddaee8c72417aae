"""The package's architecture, checked on the source (AST scans; one fresh interpreter):

- **layers**: imports point one way, scheduling → runtime → integration → adapters and entry
  points → tools → testing (function-local imports counted); scheduling imports neither torch,
  nor megatron, nor numpy; the simulator's command line neither torch, megatron nor matplotlib;
  the unit tests' modules neither torch nor megatron;
- **no import cycles** among ``megatron_dcp`` modules, function-local imports counted;
- **the command line is wiring**: no module outside ``tools/cli/`` imports ``tools.cli``
  (function-local imports counted) but the command's entry point ``tools/__main__.py``: what a
  subcommand runs lives in the rest of ``tools``, which the command line imports, never the
  other way round;
- **names**: no two modules of the package share a file name; docs/architecture.md names each;
- **the patch table**: outside ``integration/patches/`` no module assigns to an attribute of an
  imported module or object (``megatron...``, ``torch.cuda``, ``sys.argv``, ...), nor calls
  ``setattr``/``delattr`` on one; no module outside ``scheduling/`` defines a critical path;
- **sizes that follow ideas**: no function over 60 lines, no Python file over 600.

Each rule's scan is also run on a planted break, so a rule that could no longer fail is seen.
"""

import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Set

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_dcp"
PATCH_TABLE = PACKAGE / "integration" / "patches"
SOURCES = ("megatron_dcp", "tests", "functional_tests", "scripts")
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600
# Layer of each top-level part of the package; a module may import its own layer and below.
LAYERS = {
    "scheduling": 0,
    "runtime": 1,
    "integration": 2,
    "adapters": 3,
    "pretrain_gpt": 3,
    "pretrain_mamba": 3,
    "pretrain_vlm": 3,
    "verl_plugin": 3,
    "__init__": 3,
    "tools": 4,
    "testing": 5,
}
TORCH_FREE = ("torch", "megatron", "numpy")
CLI = "megatron_dcp.tools.cli"
# ``python -m megatron_dcp.tools``: the one module outside the command line that runs it.
CLI_ENTRY_POINTS = ("megatron_dcp.tools.__main__",)


def python_files(root: Path = PACKAGE) -> List[Path]:
    return sorted(root.rglob("*.py"))


def relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# --- the import graph ------------------------------------------------------------------------


def imported_modules(tree: ast.AST, package: str) -> Iterator[str]:
    """Every module named by an import anywhere in ``tree`` (functions' imports included);
    ``from a import b`` names ``a`` and ``a.b``; relative imports resolved against ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(sources: Mapping[str, str], packages: Set[str]) -> Dict[str, Set[str]]:
    """Module → the package modules it imports, from each module's source."""
    graph: Dict[str, Set[str]] = {}
    for name, source in sources.items():
        package = name if name in packages else name.rpartition(".")[0]
        targets = {t for t in imported_modules(ast.parse(source), package) if t in sources}
        graph[name] = targets - {name}
    return graph


def package_graph() -> Dict[str, Set[str]]:
    files = {module_name(p): p for p in python_files()}
    packages = {module_name(p) for p in files.values() if p.name == "__init__.py"}
    return import_graph({name: path.read_text() for name, path in files.items()}, packages)


def cycles(graph: Mapping[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def layer_of(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def upward_imports(graph: Mapping[str, Set[str]]) -> List[str]:
    return [
        f"{source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(source)
    ]


def test_no_import_cycles():
    found = cycles(package_graph())
    assert found == [], f"import cycles (function-local imports count): {found}"


def test_the_cycle_scan_finds_a_planted_cycle():
    sources = {
        "p.a": "from p.b import x\n",
        "p.b": "def f():\n    from p.c import y\n",
        "p.c": "import p.a\n",
        "p.d": "from p import a\n",
    }
    assert cycles(import_graph(sources, {"p"})) == [["p.a", "p.b", "p.c"]]


def test_imports_point_down_the_layers():
    assert upward_imports(package_graph()) == []


def test_the_layer_scan_finds_an_upward_import():
    graph = {"megatron_dcp.runtime.x": {"megatron_dcp.tools.y"}, "megatron_dcp.tools.y": set()}
    assert len(upward_imports(graph)) == 1


def test_every_part_of_the_package_has_a_layer():
    tops = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in python_files()}
    assert tops - {"__main__"} <= set(LAYERS), sorted(tops - set(LAYERS))


def in_cli(module: str) -> bool:
    return module == CLI or module.startswith(CLI + ".")


def command_line_imports(graph: Mapping[str, Set[str]]) -> List[str]:
    """Imports of ``tools.cli`` by modules outside it (its entry points aside)."""
    return [
        f"{source} imports {target}"
        for source, targets in sorted(graph.items())
        if not in_cli(source) and source not in CLI_ENTRY_POINTS
        for target in sorted(targets)
        if in_cli(target)
    ]


def test_only_the_command_line_imports_the_command_line():
    offenders = command_line_imports(package_graph())
    assert offenders == [], (
        "move what these modules use out of tools/cli/ (the command line keeps its parsers and "
        f"dispatch): {offenders}"
    )


def test_the_command_line_scan_finds_an_import_of_the_command_line():
    sources = {
        CLI: "",
        f"{CLI}.args": "",
        f"{CLI}.main": f"from {CLI}.args import x\n",
        "megatron_dcp.tools.__main__": f"from {CLI}.main import main\n",
        "megatron_dcp.tools.quick": f"def f():\n    from {CLI} import args\n",
        "megatron_dcp.testing.harness": f"import {CLI}.args\n",
        "megatron_dcp.tools.plot": "from megatron_dcp.tools import quick\n",
    }
    graph = import_graph(sources, {CLI, "megatron_dcp.tools"})
    assert command_line_imports(graph) == [
        f"megatron_dcp.testing.harness imports {CLI}.args",
        f"megatron_dcp.tools.quick imports {CLI}",
        f"megatron_dcp.tools.quick imports {CLI}.args",
    ]


_IMPORT_SCHEDULING = """
import importlib, json, pkgutil, sys
import megatron_dcp.scheduling as package
modules = [package.__name__]
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
    modules.append(info.name)
forbidden = sorted(
    name for name in sys.modules
    if any(name == root or name.startswith(root + ".") for root in %r)
)
print(json.dumps({"modules": modules, "forbidden": forbidden}))
"""


def test_scheduling_imports_neither_torch_nor_megatron_nor_numpy():
    """In a fresh interpreter: this test process may have imported them already."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_SCHEDULING % (TORCH_FREE,)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    report = json.loads(result.stdout)
    assert report["forbidden"] == [], f"imported by the scheduling layer: {report['forbidden']}"
    expected = {module_name(p) for p in python_files(PACKAGE / "scheduling")}
    assert expected <= set(report["modules"]), sorted(expected - set(report["modules"]))


# The simulator's command line and its tools, for a machine with the scheduling extra only.
SIMULATOR_MODULES = (
    "megatron_dcp.tools.cli.main",
    "megatron_dcp.tools.cli.simulate",
    "megatron_dcp.tools.cli.fuzz",
    "megatron_dcp.tools.benchmark_matrix",
    "megatron_dcp.tools.plan_report",
    "megatron_dcp.tools.plot",
    "megatron_dcp.tools.workloads",
    "megatron_dcp.tools.peers.megatron_hybrid_cp",
)


def test_the_simulator_imports_neither_torch_nor_megatron_nor_matplotlib():
    code = (
        f"import sys, {', '.join(SIMULATOR_MODULES)};"
        "bad = [m for m in ('matplotlib', 'megatron.core', 'torch') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


_IMPORT_UNIT_TESTS = """
import importlib.util, json, pathlib, sys
for path in sorted(pathlib.Path("tests/unit").rglob("test_*.py")):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(json.dumps(sorted(m for m in ("torch", "megatron") if m in sys.modules)))
"""


def test_the_unit_layer_imports_neither_torch_nor_megatron():
    """tests/unit is the torch-free layer (tests/README.md): tests that need torch or megatron
    live in tests/integration (or tests/distributed)."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_UNIT_TESTS],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
    )
    assert json.loads(result.stdout) == []


# --- names -----------------------------------------------------------------------------------


def shared_names(paths: List[Path]) -> Dict[str, List[str]]:
    counts = Counter(p.name for p in paths if p.name not in ("__init__.py", "__main__.py"))
    return {
        name: sorted(relative(p) for p in paths if p.name == name)
        for name, count in counts.items()
        if count > 1
    }


def test_no_two_modules_share_a_name():
    assert shared_names(python_files()) == {}


def test_the_architecture_map_names_every_module():
    """docs/architecture.md's map ("What lives where") names every module of the package."""
    text = (REPO / "docs" / "architecture.md").read_text()
    unnamed = [
        relative(path)
        for path in python_files()
        if path.name not in ("__init__.py", "__main__.py") and f"{path.name}`" not in text
    ]
    assert unnamed == [], f"add these to docs/architecture.md's map: {unnamed}"


def test_the_name_scan_finds_a_shared_name():
    planted = [PACKAGE / "runtime" / "x.py", PACKAGE / "tools" / "x.py", PACKAGE / "y.py"]
    assert list(shared_names(planted)) == ["x.py"]


# --- the patch table -------------------------------------------------------------------------


def imported_names(tree: ast.AST) -> Dict[str, str]:
    """Local name -> what it was imported as (functions' local imports included)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def root_name(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def assigned_targets(node: ast.AST) -> List[ast.AST]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat: List[ast.AST] = []
    for target in targets:
        flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
    return flat


def foreign_attribute_writes(source: str) -> List[str]:
    """``x.attr = ...`` and ``setattr(x, ...)`` where ``x`` is (rooted at) an imported name."""
    tree = ast.parse(source)
    names = imported_names(tree)
    found = []
    for node in ast.walk(tree):
        for target in assigned_targets(node):
            if isinstance(target, ast.Attribute) and root_name(target) in names:
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if is_call and node.func.id in ("setattr", "delattr") and node.args:
            if root_name(node.args[0]) in names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_patch_table_changes_foreign_objects():
    offenders = {
        relative(path): writes
        for path in python_files()
        if PATCH_TABLE not in path.parents
        for writes in [foreign_attribute_writes(path.read_text())]
        if writes
    }
    assert offenders == {}, f"patch these through integration/patches/: {offenders}"


def test_the_patch_scan_finds_a_stray_patch():
    stray = (
        "import sys\nimport torch\nfrom megatron.training import training as t\n"
        "def f(x):\n    t.get_forward_backward_func = x\n    torch.cuda.current_device = x\n"
        "    setattr(t, 'a', 1)\n    sys.argv = []\n    x.attr = 1\n"
    )
    writes = foreign_attribute_writes(stray)
    assert len(writes) == 4 and all("x.attr" not in write for write in writes)


def test_only_scheduling_defines_a_critical_path():
    offenders = [
        relative(path)
        for path in python_files()
        if "scheduling" not in path.relative_to(PACKAGE).parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and "critical_path" in node.name
    ]
    assert offenders == []


# --- sizes -----------------------------------------------------------------------------------


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> Dict[str, int]:
    """Functions (methods and nested ones included) longer than ``limit`` lines, decorators and
    docstrings counted."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - first + 1 > limit:
                found[f"{node.name} (line {first})"] = node.end_lineno - first + 1
    return found


def every_source_file() -> List[Path]:
    return [path for folder in SOURCES for path in python_files(REPO / folder)]


def test_no_function_passes_60_lines():
    offenders = {
        relative(path): found
        for path in every_source_file()
        if (found := long_functions(path.read_text()))
    }
    assert offenders == {}, f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"


def test_the_function_scan_finds_a_long_function():
    planted = "class A:\n    @staticmethod\n    def f():\n" + "        x = 1\n" * 59
    assert long_functions(planted) == {"f (line 2)": 61}
    assert long_functions(planted.replace("        x = 1\n", "", 1)) == {}


@pytest.mark.parametrize("folder", SOURCES)
def test_no_python_file_passes_600_lines(folder):
    long = {
        relative(path): lines
        for path in python_files(REPO / folder)
        if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}, f"files over {MAX_FILE_LINES} lines: {long}"
