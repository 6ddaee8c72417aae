"""The RL entry points work as the first megatron-touching call of a fresh interpreter on a
machine without triton: ``megatron_dcp.install_upstream_api()`` and ``import
megatron_dcp.verl_plugin`` import megatron-core through the package's import path, which
registers the CPU stand-in of megatron-core's triton paged-stash module (docs/rl.md, "verl").

Each case runs in a new interpreter (``sys.executable -c``), so nothing the test session imported
before can help it. triton is blocked there (``sys.modules["triton"] = None``), so the case is the
CPU machine's even where triton is installed.
"""

import json
import subprocess
import sys

import pytest

from megatron_dcp.integration.megatron_import import PAGED_STASH_MODULE, import_megatron_core

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

TIMEOUT_S = 120
BLOCK_TRITON = "import sys\nsys.modules['triton'] = None  # as on a machine without triton\n"
# What the entry point is called as, after which the upstream names must exist.
ENTRY_POINTS = {
    "install_upstream_api": (
        "import megatron_dcp\n"
        "before = sorted(m for m in sys.modules if m.split('.')[0] == 'megatron')\n"
        "installed = megatron_dcp.install_upstream_api()\n"
    ),
    "verl_plugin": (
        "before = sorted(m for m in sys.modules if m.split('.')[0] == 'megatron')\n"
        "import megatron_dcp.verl_plugin\n"
        "installed = megatron_dcp.verl_plugin.INSTALLED\n"
    ),
}
REPORT = """
import inspect, json
from megatron.core import parallel_state
from megatron.core.datasets import data_schedule
from megatron_dcp.integration.patches.dev_api import UPSTREAM_NAMES, has_name
print(json.dumps({
    "before": before,
    "installed": installed,
    "names": {name: has_name(name) for name in UPSTREAM_NAMES},
    "scheduler": data_schedule.DefaultDynamicCPScheduler.__module__,
    "stand-in": sys.modules[%r].__doc__,
}))
""" % (
    PAGED_STASH_MODULE,
)


def run_fresh(code: str, tmp_path) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter, started outside the source tree."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_entry_point_is_the_first_megatron_import_without_triton(entry_point, tmp_path):
    done = run_fresh(BLOCK_TRITON + ENTRY_POINTS[entry_point] + REPORT, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == []  # nothing imported megatron before the entry point
    assert {"upstream_scheduler", "upstream_initialize"} <= set(result["installed"])
    assert all(result["names"].values()), result["names"]
    assert result["scheduler"] == "megatron_dcp.integration.megatron_dev_api"
    assert "Stand-in" in result["stand-in"]


def test_without_megatron_core_the_entry_point_names_the_install(tmp_path):
    code = (
        "import sys\nsys.modules['megatron'] = None  # megatron-core not installed\n"
        "import megatron_dcp\nmegatron_dcp.install_upstream_api()\n"
    )
    done = run_fresh(code, tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: megatron_dcp.install_upstream_api() needs megatron-core")
    assert "README.md" in last
