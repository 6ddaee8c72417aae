"""The scheduling layer is pure Python: importing it (every module of it) pulls in neither torch,
nor megatron, nor numpy (docs/architecture.md, "Layers"). Checked in a fresh interpreter, since
this test process may already have imported them."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "megatron", "numpy")

_IMPORT_EVERYTHING = """
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


def test_scheduling_package_imports_neither_torch_nor_megatron_nor_numpy():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERYTHING % (FORBIDDEN,)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    report = json.loads(result.stdout)
    assert report["forbidden"] == [], f"imported by the scheduling layer: {report['forbidden']}"
    expected = {p.stem for p in (REPO / "megatron_dcp" / "scheduling").glob("*.py")} - {"__init__"}
    imported = {name.rsplit(".", 1)[-1] for name in report["modules"][1:]}
    assert expected <= imported, f"modules not imported: {sorted(expected - imported)}"
