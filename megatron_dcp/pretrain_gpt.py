"""GPT pretraining with Dynamic Context Parallelism on ``megatron.training``.

    torchrun --standalone --nproc-per-node 8 -m megatron_dcp.pretrain_gpt \\
        --dynamic-context-parallel --max-seqlen-per-dp-cp-rank 4096 ... (megatron's flags)

Everything is megatron's own ``pretrain`` loop (checkpointing, logging, optimizer, schedules);
DCP adds its flags, a variable-length dataset, and replaces the forward-backward function with
the DCP wrapper. Without CUDA the CPU backend is chosen automatically and says so once.
A start-up error (a DCP flag, a model setting DCP refuses) is one line, ``error: ...``, printed
by rank 0 before megatron's argument dump; the run exits with status 2 and no traceback, and
under torchrun the same line is the root cause of torchrun's failure summary.

The scheduler plans with the trained model's cost model (its shape from the flags, on the
backend's hardware profile; ``--dcp-cost-profile`` for a calibrated one), refined after every
step from the measured times unless ``--dcp-cost-adapt off``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from megatron_dcp.integration.patches import enable_cpu_training

# At import time: the checkpoint writer's worker processes re-import this module.
ON_CPU = enable_cpu_training()

from megatron_dcp.integration.megatron_import import import_megatron_core  # noqa: E402

import_megatron_core()

from megatron.training.argument_utils import gpt_config_from_args  # noqa: E402

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.cpu.gpt_layer_spec import local_gpt_layer_spec  # noqa: E402
from megatron_dcp.integration.cpu.spec_refusals import check_local_gpt_spec  # noqa: E402
from megatron_dcp.integration.model_checks import check_gdn_args  # noqa: E402
from megatron_dcp.integration.training.entry import (  # noqa: E402
    CPU_DEFAULTS,
    check_args,
    datasets_provider,
    extra_args,
    parse_args,
    plan_cp_sizes,
    start,
    train,
)

GDN_VARIANT = "gated_delta_net"


def check_gpt_args(args: Any) -> DCPConfig:
    """The DCP flags (``check_args``) and, for a Gated DeltaNet hybrid, its activation and the CP
    sizes its GDN layers admit: every size a plan may use (docs/usage.md)."""
    config = check_args(args)
    if getattr(args, "experimental_attention_variant", None) == GDN_VARIANT:
        check_gdn_args(args, plan_cp_sizes(args, config))
    return config


def uses_local_spec(model_config: Any) -> bool:
    """The model is built from megatron's local modules with the reference attention: on the CPU
    backend, and with ``--transformer-impl local``."""
    return ON_CPU or model_config.transformer.transformer_impl == "local"


def layer_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
    """The local modules with the reference THD/CP attention on CPU (and with
    ``--transformer-impl local``), following the config; megatron's default on GPU."""
    if uses_local_spec(config):
        return local_gpt_layer_spec(config, vp_stage)
    from megatron.training.models.gpt import default_layer_spec

    return default_layer_spec(config, vp_stage)


def model_config_from_args(args: Any) -> Any:
    """megatron's GPT model config of ``args`` with this entry point's layer spec (a ``--spec``
    of the user's stays); a setting the local spec cannot build is a ValueError here, at
    start-up (``integration.cpu.spec_refusals``)."""
    model_config = gpt_config_from_args(args)
    if getattr(args, "spec", None) is not None:
        return model_config
    if uses_local_spec(model_config):
        check_local_gpt_spec(model_config, on_cpu=ON_CPU)
    model_config.transformer_layer_spec = layer_spec
    return model_config


def prepare(argv: Optional[List[str]] = None) -> Tuple[Any, DCPConfig, Any]:
    """The arguments, the DCP config and the GPT model config, every start-up check passed."""
    if ON_CPU:
        torch.set_num_threads(1)  # several ranks share the few cores
    return start(argv, check_gpt_args, model_config_from_args)


def main(argv: Optional[List[str]] = None) -> None:
    train(*prepare(argv))


__all__ = [
    "CPU_DEFAULTS",
    "check_args",
    "check_gpt_args",
    "datasets_provider",
    "extra_args",
    "main",
    "model_config_from_args",
    "parse_args",
    "prepare",
    "start",
]

if __name__ == "__main__":
    main()
