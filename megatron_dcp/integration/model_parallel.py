"""Megatron's model-parallel state in a process that ``megatron.training`` does not start (the
calibration ranks, the tests' workers): CPU stand-ins on where CUDA is missing, groups, RNG."""

from __future__ import annotations

from typing import Optional

from megatron_dcp.integration.patches import enable_cpu_backend


def init_megatron(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    ep: int = 1,
    etp: Optional[int] = None,
) -> None:
    """Megatron model-parallel state on an initialised (gloo) default group, CPU shims on, RNG
    seeded; ``etp``: the expert tensor-parallel size (None: ``tp``, megatron's default).
    ``parallel_state.destroy_model_parallel()`` afterwards (``run_distributed`` does)."""
    from megatron.core import parallel_state, tensor_parallel

    enable_cpu_backend()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
