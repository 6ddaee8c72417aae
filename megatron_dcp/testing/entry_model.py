"""The model an entry point (``pretrain_gpt``, ``pretrain_mamba``) builds from its flags, built in
this process on a rank of a ``run_distributed`` job: megatron's argument parsing and the entry
point's start-up checks and model config, then megatron's model builder for every virtual
pipeline stage of this rank (no training loop, no DDP wrapper). Fast enough to check in a test
what a flag changes in the model, in any tensor / pipeline / expert layout."""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, List, Mapping, Tuple

from megatron_dcp.integration.patches import enable_cpu_training
from megatron_dcp.tools.launching.training_runs import flag_list

# As the entry points do when imported, before megatron.training is (and in the parent process:
# forked ranks inherit it).
enable_cpu_training()

# A tiny model of the entry points; a test adds or overrides flags.
TINY_FLAGS: Dict[str, object] = {
    "--dynamic-context-parallel": True,
    "--max-seqlen-per-dp-cp-rank": 128,
    "--num-layers": 2,
    "--hidden-size": 64,
    "--num-attention-heads": 4,
    "--ffn-hidden-size": 128,
    "--seq-length": 128,
    "--max-position-embeddings": 256,
    "--position-embedding-type": "rope",
    "--micro-batch-size": 1,
    "--global-batch-size": 8,
    "--train-iters": 1,
    "--lr": 1e-3,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 128,
    "--disable-bias-linear": True,
}


def reset_megatron_arguments() -> None:
    """Forget megatron's parsed arguments and micro-batch calculator, so that the next
    ``parse_and_validate_args`` in this process may run (megatron sets both once per process)."""
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training.global_vars import unset_global_variables

    unset_global_variables()
    destroy_num_microbatches_calculator()


def prepare_entry(entry: str, flags: Mapping[str, object]) -> Tuple[Any, Any]:
    """megatron's arguments and the model config ``megatron_dcp.<entry>`` makes of ``flags``,
    through its start-up checks (a refusal is a ``SystemExit`` with status 2)."""
    module = importlib.import_module(f"megatron_dcp.{entry}")
    check = getattr(module, "check_hybrid_args", None) or module.check_gpt_args
    reset_megatron_arguments()
    argv = flag_list(dict(flags))
    args, _, model_config = module.start(argv, check, module.model_config_from_args)
    return args, model_config


def build_entry_model(
    rank: int, world_size: int, entry: str, flags: Mapping[str, object]
) -> List[Any]:
    """This rank's model chunks (one per virtual pipeline stage) as ``megatron_dcp.<entry>``
    builds them from ``flags``; ``run_distributed``'s ``fn`` signature."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_dcp.integration.model_parallel import init_megatron

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))
    args, model_config = prepare_entry(entry, flags)
    init_megatron(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
        seed=args.seed,
    )
    model_config.finalize()
    module_name, class_name = model_config.builder.rsplit(".", 1)  # megatron's model builder
    builder = getattr(importlib.import_module(module_name), class_name)(model_config)
    stages = args.virtual_pipeline_model_parallel_size
    groups = ProcessGroupCollection.use_mpu_process_groups()
    vp_stages = [None] if stages is None else list(range(stages))
    return [builder.build_model(groups, vp_stage=stage) for stage in vp_stages]


def built_model(rank: int, world_size: int, entry: str, flags: Mapping[str, object]) -> Tuple:
    """(tensor rank, pipeline rank), this rank's parameter count, and the class name of every
    module of its model by name (chunk ``i``'s modules under ``"i."`` with virtual pipeline
    stages), for ``run_distributed``."""
    from megatron.core import parallel_state

    chunks = build_entry_model(rank, world_size, entry, flags)
    count = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    classes = {}
    for index, chunk in enumerate(chunks):
        prefix = f"{index}." if len(chunks) > 1 else ""
        for name, module in chunk.named_modules():
            classes[prefix + name] = type(module).__name__
    ranks = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    return ranks, count, classes
