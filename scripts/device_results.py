"""The results of ``scripts/device_check.sh``: every step's command, exit status, seconds and
output tail, the probe and the check's report, in ``OUT/device_check.json``; and, from the probe,
a ready-made cost profile for ``--dcp-cost-profile`` in ``OUT/profile.json``.

    python scripts/device_results.py --out DIR [--dry-run]

The profile is the cost model of the probe's shape (``scripts/gpu_cost_probe.py``: the default
``ModelShape``, Llama-3-8B-like, on ``h100-eager``, the GPU training default) with its layers'
measured terms: the per-layer micro-batch, linear and quadratic coefficients the probe fitted
replace the profile's per-layer share, times the number of layers (the output head keeps the
profile's figure), and ``cp_efficiency`` is the median of the ring-chunk efficiencies it measured
(at most 1). The K/V exchange and the ring-step latency need two GPUs and keep the profile's
values (its ring step is the one a single H200 measured in eager execution); ``source`` says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_cost_probe, beside this file

from gpu_cost_probe import SHAPE, per_layer_model  # noqa: E402

from megatron_dcp.scheduling.cost import CostModel  # noqa: E402
from megatron_dcp.scheduling.cost_fit import CostProfile, save_profile  # noqa: E402
from megatron_dcp.scheduling.hardware import DEFAULT_GPU_PROFILE, hardware_profile  # noqa: E402

STEPS = ("probe", "check", "gpu_tests")
TAIL_LINES = 30


def read_step(folder: Path, name: str) -> Dict[str, Any]:
    """One step as the shell script left it (absent files: the step did not run)."""
    def text(suffix: str) -> str:
        path = folder / f"{name}.{suffix}"
        return path.read_text().strip() if path.exists() else ""

    rc, seconds = text("rc"), text("s")
    return {
        "command": text("cmd"),
        "ran": bool(rc),
        "exit_status": int(rc) if rc else None,
        "timed_out": rc in ("124", "137"),
        "seconds": int(seconds) if seconds else None,
        "output_tail": text("log").splitlines()[-TAIL_LINES:],
    }


def profile_from_probe(probe: Dict[str, Any]) -> CostProfile:
    """The ready-made profile of the probe's shape (module docstring)."""
    hardware = hardware_profile(DEFAULT_GPU_PROFILE)
    prior, per_layer = CostModel.from_model_shape(SHAPE, hardware), per_layer_model(hardware)
    microbatch, linear, quadratic = probe["fit"]
    layers = SHAPE.num_layers
    efficiencies = [min(1.0, c["whole"] / c["cp"] / c["chunked"]) for c in probe["ring_chunks"]]
    cost = dataclasses.replace(
        prior,
        linear=prior.linear + layers * (linear - per_layer.linear),
        quadratic=prior.quadratic + layers * (quadratic - per_layer.quadratic),
        microbatch=prior.microbatch + layers * (microbatch - per_layer.microbatch),
        cp_efficiency=statistics.median(efficiencies) if efficiencies else prior.cp_efficiency,
        name=f"probe@{probe.get('device', 'gpu')}",
    )
    source = {
        "by": "scripts/device_check.sh (gpu_cost_probe.py)",
        "device": probe.get("device"),
        "measured": "per-layer micro-batch, linear and quadratic terms; cp_efficiency",
        f"kept from {DEFAULT_GPU_PROFILE}": "comm, ring_step (need two GPUs), the head's share",
        "shape": dataclasses.asdict(SHAPE),
    }
    return CostProfile(cost, source)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="device_check.sh's folder")
    parser.add_argument("--dry-run", action="store_true", help="the probe was left out")
    args = parser.parse_args()
    results: Dict[str, Any] = {"dry_run": args.dry_run}
    results["steps"] = {name: read_step(args.out / "steps", name) for name in STEPS}
    for name in ("probe", "check"):
        path = args.out / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    if results["probe"] is not None:
        save_profile(str(args.out / "profile.json"), profile_from_probe(results["probe"]))
        results["profile"] = str(args.out / "profile.json")
    (args.out / "device_check.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"device_check: results in {args.out / 'device_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
