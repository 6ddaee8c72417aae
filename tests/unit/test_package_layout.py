"""The package layout, checked on the source (AST scans, no imports):

- dependencies point one way: the core (scheduling, runtime, integration, adapters) never
  imports ``megatron_dcp.tools``; scheduling imports no other megatron_dcp package;
- every change to an object the plugin does not own goes through the patch table: outside
  ``integration/patches/`` no module assigns to an attribute of an imported module or object
  (``megatron...``, ``torch.cuda``, ``sys.argv``, ...), nor calls ``setattr``/``delattr`` on one;
- no module outside ``scheduling/`` defines a critical path;
- no Python file passes 400 lines.
"""

import ast
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_dcp"
CORE = ("scheduling", "runtime", "integration", "adapters")
PATCH_TABLE = PACKAGE / "integration" / "patches"
MAX_LINES = 400


def modules(root: Path = PACKAGE) -> List[Path]:
    return sorted(root.rglob("*.py"))


def imported_modules(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


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


def relative(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("layer", CORE)
def test_the_core_never_imports_tools(layer):
    offenders = {
        relative(path): name
        for path in modules(PACKAGE / layer)
        for name in imported_modules(ast.parse(path.read_text()))
        if name == "megatron_dcp.tools" or name.startswith("megatron_dcp.tools.")
    }
    assert offenders == {}, f"the core imports tools: {offenders}"


def test_scheduling_imports_no_other_layer():
    offenders = {
        relative(path): name
        for path in modules(PACKAGE / "scheduling")
        for name in imported_modules(ast.parse(path.read_text()))
        if name.startswith("megatron_dcp.") and not name.startswith("megatron_dcp.scheduling")
    }
    assert offenders == {}


def test_only_the_patch_table_changes_foreign_objects():
    offenders = {
        relative(path): writes
        for path in modules()
        if PATCH_TABLE not in path.parents
        for writes in [foreign_attribute_writes(path.read_text())]
        if writes
    }
    assert offenders == {}, f"patch these through integration/patches/: {offenders}"


def test_the_scan_sees_a_stray_patch():
    """The scan itself can fail: each form of a foreign write is found."""
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
        for path in modules()
        if "scheduling" not in path.relative_to(PACKAGE).parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and "critical_path" in node.name
    ]
    assert offenders == []


def test_no_python_file_passes_400_lines():
    files = [
        path
        for folder in ("megatron_dcp", "tests", "functional_tests", "scripts")
        for path in modules(REPO / folder)
    ]
    long = {relative(p): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
