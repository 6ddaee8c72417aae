"""``megatron-dcp calibrate --link-rate RATE``: the calibration run again inside a fresh network
namespace whose loopback is shaped to ``RATE`` by tbf (``tools.link``'s wrapper, as
``bench-train --link-rate`` runs training), and what the link did to the fit.

The parent checks the rate and this machine's support, then runs the same ``calibrate`` command
(``--link-rate`` left out) under :func:`~megatron_dcp.tools.link.launch.node_launch`'s prefix:
``unshare`` into new network and PID namespaces, ``lo`` up and shaped, the link probed (a rate
more than 20 % off is refused), then the command. The inner command finds the probe's report
through :data:`LINK_REPORT_VARIABLE` and writes into the profile's ``source`` the requested and
probed rates, each rank's share when every rank sends at once (the one tbf bucket of the
loopback carries both directions: ``link.sharing``), and the per-rank bandwidth the fitted
``comm`` coefficient implies (K/V bytes per token ÷ comm, the CPU backend exposing all of it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.hardware import DEFAULT_CPU_PROFILE, hardware_profile
from megatron_dcp.tools.link.rate import FLAG, megabytes

LINK_REPORT_VARIABLE = "MEGATRON_DCP_CALIBRATE_LINK"
# Seconds the shaped run may take beyond the ranks' own --timeout (namespace, probe, start-up).
SETUP_GRACE_S = 300


def without_link_rate(argv: Sequence[str]) -> List[str]:
    """``argv`` with ``--link-rate RATE`` (or ``--link-rate=RATE``) left out."""
    out: List[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
        elif item == FLAG:
            skip = True
        elif not item.startswith(FLAG + "="):
            out.append(item)
    return out


def shaped_calibration(argv: Sequence[str], options: argparse.Namespace) -> int:
    """Run ``calibrate argv`` (without ``--link-rate``) in a namespace shaped to
    ``options.link_rate``; its exit code. The probe's report lands beside ``--output``."""
    from megatron_dcp.tools.link.launch import LinkSpec, node_launch
    from megatron_dcp.tools.link.preflight import check_link_support
    from megatron_dcp.tools.link.rate import parse_link_rate

    rate = parse_link_rate(options.link_rate)
    check_link_support(options.link_rate, rate, 1)
    out = Path(os.path.abspath(options.output)).parent
    spec = LinkSpec(options.link_rate, rate, 1, options.nproc, out)
    launch = node_launch(spec, None)
    command = [*launch.prefix, sys.executable, "-m", "megatron_dcp.tools", "calibrate"]
    env = {**os.environ, **launch.env, LINK_REPORT_VARIABLE: str(spec.report(None))}
    print(f"calibrate: inside a network namespace, loopback shaped to {options.link_rate} ...")
    sys.stdout.flush()
    try:
        done = subprocess.run(
            [*command, *without_link_rate(argv)],
            env=env,
            preexec_fn=launch.preexec_fn,
            timeout=options.timeout + SETUP_GRACE_S,
        )
    except subprocess.TimeoutExpired:
        reason = f"{FLAG}={options.link_rate}: the shaped run timed out"
        print(f"calibrate: error: {reason}", file=sys.stderr)
        return 1
    return done.returncode


def link_source(cost: CostModel, args: Any, nproc: int) -> Optional[Dict[str, Any]]:
    """The link figures of a shaped calibration (None outside one): requested, probed, each
    rank's share, and the bandwidth the fitted ``comm`` implies."""
    from megatron_dcp.integration.model_cost import model_shape_from_args
    from megatron_dcp.tools.link.sharing import per_rank_bandwidth

    path = os.environ.get(LINK_REPORT_VARIABLE)
    if not path:
        return None
    report = json.loads(Path(path).read_text())
    probed = report["probed_bytes_per_s"]
    cpu = hardware_profile(DEFAULT_CPU_PROFILE)
    kv_bytes = model_shape_from_args(args).kv_bytes(cpu.bytes_per_element) * cpu.exposed_fraction
    return {
        "requested": report["requested"],
        "requested_bytes_per_s": report["requested_bytes_per_s"],
        "probed_bytes_per_s": probed,
        "per_rank_bytes_per_s": per_rank_bandwidth(probed, nproc, 1)["intra"],
        "fitted_bytes_per_s": kv_bytes / cost.comm if cost.comm > 0 else None,
    }


def describe_link(figures: Dict[str, Any]) -> str:
    """One printed line."""
    fitted = figures["fitted_bytes_per_s"]
    implied = megabytes(fitted) if fitted else "nothing (comm fitted to 0)"
    return (
        f"link {figures['requested']}: probed {megabytes(figures['probed_bytes_per_s'])}, "
        f"{megabytes(figures['per_rank_bytes_per_s'])} per rank when all send; the fitted comm "
        f"implies {implied} per rank (--dcp-link-bandwidth for the same model)"
    )
