"""Vision-language pretraining with Dynamic Context Parallelism on ``megatron.training``.

    torchrun --standalone --nproc-per-node 8 -m megatron_dcp.pretrain_vlm \\
        --dynamic-context-parallel --max-seqlen-per-dp-cp-rank 4096 \\
        --img-h 336 --img-w 336 --patch-dim 14 --vision-num-layers 24 ... (megatron's flags)

megatron-core's LLaVA (a CLIP ViT, an MLP projector, a GPT) with the DCP forward
(``integration.vlm_model.DCPLLaVAModel``): each sample's image tokens sit in its sequence
(combined coordinates), its tiles are encoded once per CP group, split over the group's ranks.
The DCP flags, start-up refusals and ``[DCP]`` log line are pretrain_gpt's
(``integration.training.entry``); the vision flags, their refusals and the model are
``integration.training.vlm_entry``'s; the data is ``--vlm-data`` or mock samples with images.
On CPU the language model is built from local modules with the reference attention, the ViT and
the projector from megatron's local modules. See docs/vlm.md, "Training".
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

from megatron.training import get_args  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args  # noqa: E402
from megatron.training.utils import print_rank_0  # noqa: E402
from megatron.training.vocab_utils import calculate_padded_vocab_size  # noqa: E402

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.cpu.spec_refusals import check_local_gpt_spec  # noqa: E402
from megatron_dcp.integration.training.entry import (  # noqa: E402
    EntryModel,
    check_args,
    start,
    train,
)
from megatron_dcp.integration.training.forward_step import vlm_forward_step  # noqa: E402
from megatron_dcp.integration.training.vlm_entry import (  # noqa: E402
    ENTRY,
    VLMModelConfig,
    add_vision_args,
    build_vlm_model,
    check_vision_args,
    describe_parts,
    vlm_datasets_provider,
    vlm_model_config,
)


def check_vlm_args(args: argparse.Namespace) -> DCPConfig:
    """The vision-language settings (``vlm_entry.check_vision_args``: what LLaVA cannot run
    under DCP comes first), then pretrain_gpt's checks of the DCP flags."""
    check_vision_args(args)
    return check_args(args, entry=ENTRY)


def model_config_from_args(args: argparse.Namespace) -> VLMModelConfig:
    """The LLaVA ``args`` ask for: the language model's config as pretrain_gpt builds it (a
    setting the local spec cannot build is a ValueError here, at start-up), the vision encoder's
    and the projector's from the vision flags."""
    language = gpt_config_from_args(args)
    local = ON_CPU or language.transformer.transformer_impl == "local"
    if local:
        check_local_gpt_spec(language, on_cpu=ON_CPU)
    return vlm_model_config(args, language, local)


def vocab_size(args: argparse.Namespace) -> int:
    """megatron's padded vocabulary (set once the tokenizer is built), else ``--vocab-size``
    padded as megatron pads it."""
    if getattr(args, "padded_vocab_size", None):
        return args.padded_vocab_size
    return calculate_padded_vocab_size(
        args.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )


def model_provider(model_config: VLMModelConfig) -> Any:
    """megatron's model provider of ``model_config``: this rank's LLaVA, its parts logged."""

    def provide(
        pre_process: bool = True,
        post_process: bool = True,
        config: Any = None,
        pg_collection: Any = None,
        vp_stage: Optional[int] = None,
    ) -> Any:
        model = build_vlm_model(
            model_config, vocab_size(get_args()), pre_process, post_process, pg_collection, vp_stage
        )
        print_rank_0(describe_parts(model))
        return model

    return provide


def prepare(argv: Optional[List[str]] = None) -> Tuple[argparse.Namespace, DCPConfig, Any]:
    """The arguments, the DCP config and the LLaVA config, every start-up check passed."""
    if ON_CPU:
        torch.set_num_threads(1)  # several ranks share the few cores
    return start(argv, check_vlm_args, model_config_from_args, add_vision_args)


def main(argv: Optional[List[str]] = None) -> None:
    args, config, model_config = prepare(argv)
    entry = EntryModel(model_provider(model_config), vlm_forward_step, model_config.spec)
    train(
        args,
        config,
        model_config,
        datasets=vlm_datasets_provider(model_config.spec.tokens_per_tile),
        entry=entry,
    )


if __name__ == "__main__":
    main()
