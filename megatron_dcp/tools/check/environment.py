"""The environment report of ``megatron-dcp check``: versions (torch, CUDA and NCCL or gloo,
Transformer Engine, megatron-core and whether this package supports it, the Gated DeltaNet and
Mamba kernels), the patch-table entries that apply here, the devices, and the node layout the
launcher's environment describes. Read in the command's own process; nothing is started."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any, Dict, List, Mapping, Optional

import torch

# Optional packages the report looks for: distribution name -> what it provides.
KERNELS = {
    "transformer-engine": "Transformer Engine",
    "flash-linear-attention": "Gated DeltaNet kernels (fla)",
    "mamba-ssm": "Mamba kernels",
    "causal-conv1d": "Mamba conv kernels",
}
NODE_VARIABLES = (
    "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"
)  # fmt: skip


def version_of(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def transformer_engine_version() -> Optional[str]:
    """TE's version; its wheels are named ``transformer-engine`` or ``transformer_engine``
    (with a ``-cu12`` core beside them)."""
    return version_of("transformer-engine") or version_of("transformer_engine")


def megatron_report() -> Dict[str, Any]:
    """megatron-core's version and whether the patch table supports it."""
    from megatron_dcp.integration.megatron_import import import_megatron_core
    from megatron_dcp.integration.patches.table import SUPPORTED_VERSIONS, megatron_version

    if not import_megatron_core():
        return {"version": None, "supported": False}
    version = megatron_version()
    return {
        "version": ".".join(map(str, version)),
        "supported": version[:2] in SUPPORTED_VERSIONS,
        "supports": [f"{major}.{minor}.x" for major, minor in SUPPORTED_VERSIONS],
    }


def patch_report() -> List[Dict[str, Any]]:
    """Every patch-table entry, its group, its condition and whether that holds here."""
    from megatron_dcp.integration.patches import entries

    return [
        {"name": e.name, "group": e.group, "when": e.when.name, "applies": bool(e.when.holds())}
        for e in entries()
    ]


def device_report() -> Dict[str, Any]:
    from megatron_dcp.tools.launching.training_runs import available_cores

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nccl = None
    if gpus and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "gpus": gpus,
        "cores": available_cores(),
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "gloo": torch.distributed.is_gloo_available(),
        "backend": "nccl" if gpus else "gloo",
    }


def node_report(environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """The launcher variables that describe nodes, as this process sees them."""
    return {name: environ[name] for name in NODE_VARIABLES if name in environ}


def environment() -> Dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron_report(),
        "kernels": {name: version_of(name) for name in KERNELS if name != "transformer-engine"},
        "transformer_engine": transformer_engine_version(),
        "devices": device_report(),
        "nodes": node_report(),
        "patches": patch_report(),
    }


def describe(env: Mapping[str, Any]) -> List[str]:
    """The report's lines."""
    devices, megatron = env["devices"], env["megatron_core"]
    backend = f"CUDA {devices['cuda']}, NCCL {devices['nccl']}" if devices["gpus"] else "gloo"
    supported = "supported" if megatron["supported"] else "NOT supported by this package"
    kernels = ", ".join(f"{KERNELS[n]} {v or 'absent'}" for n, v in env["kernels"].items())
    gpus = f"{len(devices['gpus'])} GPU(s): {', '.join(sorted(set(devices['gpus'])))}"
    nodes = ", ".join(f"{k}={v}" for k, v in env["nodes"].items()) or "no launcher variables"
    return [
        f"python {env['python']}, torch {env['torch']} ({backend})",
        f"megatron-core {megatron['version']} ({supported}); Transformer Engine "
        f"{env['transformer_engine'] or 'absent'}",
        kernels,
        f"devices: {gpus if devices['gpus'] else 'no GPU'}; {devices['cores']} cores",
        f"node layout: {nodes} (one node unless a launcher says otherwise)",
        describe_patches(env["patches"]),
    ]


def describe_patches(patches: List[Mapping[str, Any]]) -> str:
    groups: Dict[str, List[int]] = {}
    for patch in patches:
        counts = groups.setdefault(patch["group"], [0, 0])
        counts[0] += patch["applies"]
        counts[1] += 1
    applied = sum(p["applies"] for p in patches)
    parts = ", ".join(f"{group} {a}/{n}" for group, (a, n) in groups.items())
    return f"patch table: {applied} of {len(patches)} entries apply here ({parts})"
