"""Hybrid Mamba pretraining with Dynamic Context Parallelism on ``megatron.training``.

    torchrun --standalone --nproc-per-node 8 -m megatron_dcp.pretrain_mamba \\
        --dynamic-context-parallel --max-seqlen-per-dp-cp-rank 4096 \\
        --hybrid-layer-pattern "M*M-M*M-" ... (megatron's flags)

megatron-core's hybrid model (``HybridModel``): layers from ``--hybrid-layer-pattern``
(``M`` Mamba, ``*`` attention, ``-`` MLP). The DCP flags, data sources and ``[DCP]`` log line
are pretrain_gpt's (``integration.training.entry``). Mamba layers under CP constrain the CP sizes a plan
may use; that is checked before the first step. On CPU the model is built from local modules
with the reference attention and the reference Mamba kernels (docs/mamba.md).
"""

from __future__ import annotations

import argparse
from typing import Any, List, Optional, Tuple

import torch

from megatron_dcp.integration.patches import enable_cpu_training

# At import time: the checkpoint writer's worker processes re-import this module.
ON_CPU = enable_cpu_training()

from megatron_dcp.integration.megatron_import import import_megatron_core  # noqa: E402

import_megatron_core()

from megatron.training.argument_utils import hybrid_config_from_args  # noqa: E402

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.cpu.hybrid_stack import reference_hybrid_stack_spec  # noqa: E402
from megatron_dcp.integration.cpu.spec_refusals import check_local_hybrid_spec  # noqa: E402
from megatron_dcp.integration.model_checks import check_mamba_cp  # noqa: E402
from megatron_dcp.integration.training.entry import (  # noqa: E402
    check_args,
    plan_cp_sizes,
    start,
    train,
)

ENTRY = "pretrain_mamba"
MAMBA = "M"


def check_hybrid_args(args: argparse.Namespace) -> DCPConfig:
    """pretrain_gpt's checks, a layer pattern, and the CP sizes the Mamba layers admit."""
    config = check_args(args, entry=ENTRY)
    if not args.hybrid_layer_pattern:
        raise ValueError(
            f"megatron_dcp.{ENTRY} builds the layers from --hybrid-layer-pattern (e.g. 'M*M-': "
            "Mamba, attention, Mamba, MLP); add it, or train a GPT with megatron_dcp.pretrain_gpt."
        )
    if MAMBA in args.hybrid_layer_pattern:
        check_mamba_cp(
            mamba_heads(args),
            args.mamba_num_groups,
            args.tensor_model_parallel_size,
            plan_cp_sizes(args, config),
        )
    return config


def mamba_heads(args: argparse.Namespace) -> int:
    """Mamba heads of the model: ``--mamba-num-heads``, else 2·hidden / head dim (megatron's)."""
    return args.mamba_num_heads or 2 * args.hidden_size // args.mamba_head_dim


def model_config_from_args(args: argparse.Namespace) -> Any:
    """megatron's hybrid model config of ``args``; on CPU (and with ``--transformer-impl local``)
    with the local hybrid stack, after refusing what it cannot build (a ValueError, at start-up).
    A ``--spec`` of the user's stays."""
    model_config = hybrid_config_from_args(args)
    local = ON_CPU or model_config.transformer.transformer_impl == "local"
    if local and getattr(args, "spec", None) is None:
        check_local_hybrid_spec(model_config, on_cpu=ON_CPU)
        model_config.hybrid_stack_spec = reference_hybrid_stack_spec(model_config.transformer)
    return model_config


def prepare(argv: Optional[List[str]] = None) -> Tuple[argparse.Namespace, DCPConfig, Any]:
    """The arguments, the DCP config and the hybrid model config, every start-up check passed."""
    if ON_CPU:
        torch.set_num_threads(1)  # several ranks share the few cores
    return start(argv, check_hybrid_args, model_config_from_args)


def main(argv: Optional[List[str]] = None) -> None:
    train(*prepare(argv))


if __name__ == "__main__":
    main()
