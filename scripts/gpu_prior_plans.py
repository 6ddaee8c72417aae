"""What the GPU prior's fixed costs change in plans: the reference benchmark matrix planned with
``h100-nvlink`` (a-priori fixed costs) and with ``h100-eager`` (the fixed costs an H200 measured
in eager PyTorch), both plans priced with ``h100-eager``.

    .venv/bin/python scripts/gpu_prior_plans.py

One row per case of the matrix (``megatron-dcp benchmark``'s workloads, budgets and VPP settings,
seed 0, the default Llama-3-8B-like shape): micro-batches and CP sizes of each plan, and the
critical path of the eager prior's plan over the a-priori one's (below 1: the measured fixed
costs plan better, if they are the truth). docs/cost_model.md, "Hardware profiles", has the run.
"""

from __future__ import annotations

from typing import List, Tuple

from megatron_dcp.scheduling import Plan, build_scheduler
from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.hardware import hardware_profile
from megatron_dcp.scheduling.metrics import critical_path
from megatron_dcp.tools.benchmark_matrix import DEFAULT_BUDGETS, DEFAULT_VPP, matrix_lengths
from megatron_dcp.tools.workloads import REFERENCE_WORKLOADS, Workload

SCHEDULER = "default_dynamic_cp"


def cp_sizes(plan: Plan) -> List[int]:
    """The CP sizes of the groups that hold samples."""
    return sorted({len(g.ranks) for mb in plan.microbatches for g in mb.groups if g.sample_ids})


def plans(workload: Workload, budget: int, vpp: int, priors: Tuple[CostModel, ...]) -> List[Plan]:
    """The planner's plan of one matrix case under each prior."""
    lengths = matrix_lengths(workload, budget, 0)
    settings = dict(
        dp_size=workload.dp_size,
        cp_size=workload.cp_size,
        max_seqlen_per_dp_cp_rank=budget,
        microbatch_group_size_per_vp_stage=vpp if vpp > 1 else None,
    )
    return [build_scheduler(SCHEDULER, cost_model=c, **settings).schedule(lengths) for c in priors]


def main() -> None:
    reference = CostModel.from_model_shape(None, hardware_profile("h100-nvlink"))
    eager = CostModel.from_model_shape(None, hardware_profile("h100-eager"))
    print(f"{'case':<26} {'micro-batches':>13}  {'CP sizes (h100-nvlink -> h100-eager)':<44} ratio")
    for workload in REFERENCE_WORKLOADS:
        for budget in DEFAULT_BUDGETS:
            for vpp in DEFAULT_VPP:
                before, after = plans(workload, budget, vpp, (reference, eager))
                ratio = critical_path(after, eager) / critical_path(before, eager)
                counts = f"{len(before.microbatches)} -> {len(after.microbatches)}"
                sizes = f"{cp_sizes(before)} -> {cp_sizes(after)}"
                name = f"{workload.name} b{budget} vpp{vpp}"
                print(f"{name:<26} {counts:>13}  {sizes:<44} {ratio:.4f}")


if __name__ == "__main__":
    main()
