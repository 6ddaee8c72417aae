"""The part of a training step no plan changes (the *step rest*): what ``link-sweep`` adds to
every arm's critical path before it compares them (``link_sweep.runs.predicted_speedups``).

Measured, it is megatron's step time less the forward-backward
(:func:`~megatron_dcp.tools.link_sweep.runs.step_remainder_s` of a ``bench-train`` run). Before
any run it is predicted from the model and the hardware profile (docs/performance.md, "The missing
term at low link rates"): the gradient all-reduce, 2 × (R − 1) / R × the gradient bytes over one
rank's link, R the DP×CP ranks that reduce them; the optimizer, one memory-bound pass of Adam
over the parameters, their gradients and its two moments; and on the CPU backend the host's work
between the steps (:data:`HOST_STEP_S`). Only weights that do matmul work are counted (from
:class:`ModelShape`'s linear FLOPs: 2 per weight and token, three passes), so biases and norms
are left out, and of a MoE layer only the experts a token runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_dcp.scheduling.hardware import HardwareProfile
from megatron_dcp.scheduling.model_shape import TRAIN_FACTOR, ModelShape
from megatron_dcp.tools.link_sweep.runs import step_remainder_s

# Adam's step reads the weight, its gradient and both moments and writes the weight and the
# moments: 7 fp32 values per parameter.
OPTIMIZER_BYTES_PER_PARAMETER = 7 * 4
# Memory bandwidth one rank's optimizer streams at, by hardware profile (bytes/s): an H100 SXM's
# HBM3 (3.35 TB/s, datasheet); on the CPU backend torch's Adam on one core of the project's 2-core
# AMD EPYC, which moved 9–15 GB/s at 28 bytes per parameter (0.8 and 6.3 M parameters).
MEMORY_BANDWIDTH = {"h100-nvlink": 3.35e12, "h100-eager": 3.35e12, "cpu-gloo": 10e9}
# The host's work inside a step beyond the two terms above, by hardware profile: (seconds per
# step, seconds per sample of the global batch). On the CPU backend bench-train prepares the next
# batch between the steps (--dcp-prefetch off, --num-workers 0: reading, planning, routing its
# samples) besides megatron's own bookkeeping; fitted to the step rest four bench-train runs
# measured on the project's 2-core AMD EPYC (global batches of 8, 16 and 32 samples: 35–57 ms,
# docs/estimate.md). On a GPU training's prefetch thread and data-loader workers do it while
# the step runs: nothing is added.
HOST_STEP_S = {"cpu-gloo": (18.9e-3, 0.67e-3)}


@dataclass(frozen=True)
class StepRest:
    """Seconds of a step outside the forward-backward, and where the figure comes from."""

    seconds: float
    source: str  # "predicted", "measured" or "given"
    all_reduce_s: float = 0.0
    optimizer_s: float = 0.0
    parameters: int = 0  # weights per model-parallel rank that the all-reduce carries
    host_s: float = 0.0  # the host's work between the steps (CPU backend)

    def describe(self) -> str:
        if self.source != "predicted":
            return f"step rest {self.seconds * 1e3:.1f} ms ({self.source})"
        return (
            f"step rest {self.seconds * 1e3:.1f} ms (predicted: gradient all-reduce "
            f"{self.all_reduce_s * 1e3:.1f} ms of {self.parameters / 1e6:.2f} M parameters, "
            f"optimizer {self.optimizer_s * 1e3:.1f} ms"
            + (f", host {self.host_s * 1e3:.1f} ms)" if self.host_s else ")")
        )

    def as_dict(self) -> dict:
        return asdict(self)


def matmul_parameters(shape: ModelShape) -> int:
    """Weights per tensor-parallel rank that do matmul work: a token's linear forward FLOPs over
    2 (one multiply-accumulate per weight), the output head (tied to the embedding) included,
    and a vision encoder's likewise (a patch's; 0 without one; its projector is left out)."""
    flops = shape.linear_flops() + shape.vision_linear_flops()
    return int(round(flops / TRAIN_FACTOR / 2))


def predicted_step_rest(
    shape: ModelShape,
    hardware: HardwareProfile,
    ranks: int,
    pipeline_stages: int = 1,
    global_batch_size: int = 0,
) -> StepRest:
    """The step rest of training ``shape`` on ``hardware`` with ``ranks`` DP×CP ranks reducing
    each gradient, ``pipeline_stages`` stages sharing the layers out and global batches of
    ``global_batch_size`` samples."""
    parameters = matmul_parameters(shape) // max(1, pipeline_stages)
    gradient_bytes = parameters * hardware.bytes_per_element
    all_reduce = 2 * (ranks - 1) / ranks * gradient_bytes / hardware.link_bandwidth
    bandwidth = MEMORY_BANDWIDTH.get(hardware.name, MEMORY_BANDWIDTH["h100-nvlink"])
    optimizer = parameters * OPTIMIZER_BYTES_PER_PARAMETER / bandwidth
    per_step, per_sample = HOST_STEP_S.get(hardware.name, (0.0, 0.0))
    host = per_step + per_sample * global_batch_size
    total = all_reduce + optimizer + host
    return StepRest(total, "predicted", all_reduce, optimizer, parameters, host)


def measured_step_rest(path: str) -> StepRest:
    """The step rest a ``bench-train`` run measured (its ``bench_train.json``), as link-sweep
    reads it."""
    file = Path(path)
    try:
        bench = json.loads(file.read_text())
        seconds = step_remainder_s(bench)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"--step-rest-from={path}: not a bench-train result ({error}); give the "
            "bench_train.json that `megatron-dcp bench-train` wrote."
        ) from None
    return StepRest(seconds, f"measured by bench-train, {path}")
