"""scripts/bench_links.sh reports the sweep's progress after each run (``megatron-dcp link-sweep
--progress``): runs done of all the loops make (workloads × rates, the repeats, the two-node
run), their time and an estimate of what is left. The interpreter is a stand-in that does
nothing but hand the progress lines to the real one, so the script's own loops run in a moment
and nothing trains."""

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_links.sh"
STUB = f"""#!/usr/bin/env bash
case " $* " in *" --progress "*) exec "{sys.executable}" "$@" ;; esac
exit 0
"""


def sweep(tmp_path: Path, **variables: str) -> list[str]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {**os.environ, "PY": str(stub), "OUT": str(tmp_path / "links"), **variables}
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if re.match(r"bench_links.sh: \d", line)]


def test_each_run_reports_the_runs_done_of_all(tmp_path):
    lines = sweep(
        tmp_path,
        WORKLOADS="documents sft",
        RATES="unshaped 1gbit",
        REPEAT_WORKLOADS="sft",
        REPEAT_RATES="1gbit",
        NODES_RATE="100mbit",
    )
    total = 2 * 2 + 2 * 1 + 1  # workloads × rates, two repeats per repeat rate, two nodes
    assert [line.split(",")[0] for line in lines] == [
        f"bench_links.sh: {done}/{total} runs" for done in range(1, total + 1)
    ]
    assert all(re.fullmatch(r"[^,]+, 00:0\d elapsed, (\?|00:0\d) left", line) for line in lines)


def test_repeats_of_a_workload_not_swept_are_not_counted(tmp_path):
    lines = sweep(
        tmp_path, WORKLOADS="rl", RATES="unshaped", REPEAT_WORKLOADS="long", NODES_RATE=""
    )
    assert [line.split(",")[0] for line in lines] == ["bench_links.sh: 1/1 runs"]
