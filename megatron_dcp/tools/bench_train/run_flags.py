"""The training flags of a ``bench-train`` run: the model and data it trains when the user's flags
do not say (:data:`DEFAULTS`, :data:`VLM_DEFAULTS` for ``pretrain_vlm``, :data:`CPU_DEFAULTS`
where the ranks compute on the CPU), the flags the benchmark sets itself, and the user's flags
over them (:func:`training_flags`)."""

from __future__ import annotations

from typing import Dict, List, Sequence

from megatron_dcp.tools.argument_types import given_flags

DEFAULTS: Dict[str, object] = {
    "--num-layers": 4,
    "--hidden-size": 256,
    "--num-attention-heads": 4,
    "--ffn-hidden-size": 1024,
    "--seq-length": 4096,
    "--max-position-embeddings": 4096,
    "--position-embedding-type": "rope",
    "--micro-batch-size": 1,
    "--global-batch-size": 32,
    "--hidden-dropout": 0.0,
    "--attention-dropout": 0.0,
    "--lr": 1e-4,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 1024,
    "--varlen-distribution": "lognormal:median=500,sigma=0.8,min=32,max=4096",
    "--max-seqlen-per-dp-cp-rank": 2048,
    "--seed": 1234,
    "--eval-iters": 0,
    "--eval-interval": 1000000,
}
# Added for ``--entry pretrain_vlm`` (megatron-core's LLaVA) where not given: a tiny CLIP ViT on
# 64-pixel tiles of 16-pixel patches (16 patches and the class token a tile), so that a CPU step
# encodes its tiles in a share of the step like the language model's. ``estimate`` takes the same
# defaults for vision-language data: the same flags mean the same model in both commands.
VLM_DEFAULTS: Dict[str, object] = {
    "--vision-num-layers": 2,
    "--vision-hidden-size": 128,
    "--vision-num-attention-heads": 4,
    "--img-h": 64,
    "--img-w": 64,
    "--patch-dim": 16,
}
# Added where the ranks compute on the CPU (``cuda_ranks``): the next batch prepared between the
# steps, not in a background thread; samples read in the rank's process, not by data-loader
# worker processes (whose samples cross to the rank one shared-memory handle per tensor).
CPU_DEFAULTS: Dict[str, object] = {"--dcp-prefetch": "off", "--num-workers": 0}
# The data sources of the training entry point besides the default mock lengths.
DATA_SOURCES = ("--sft-data", "--varlen-lengths-file", "--data-path")
# pretrain_vlm's conversations with images: they replace the mock lengths too (pretrain_vlm
# refuses --varlen-distribution beside them).
VLM_DATA_SOURCES = ("--vlm-data",)
# Set by the command whatever the user passes: the run is a benchmark of these arms.
FORCED_FLAGS = ("--dynamic-context-parallel", "--log-interval", "--train-iters")


def training_flags(
    extra: Sequence[str], nproc: int, iterations: int, entry: str = "pretrain_gpt"
) -> List[str]:
    """:data:`DEFAULTS` (and :data:`VLM_DEFAULTS` for ``pretrain_vlm``) under the user's flags,
    DP 1 × CP ``nproc`` unless given, and the flags the benchmark needs."""
    from megatron_dcp.tools.launching.training_runs import flag_list

    given = given_flags(extra)
    forced = sorted(given.intersection(FORCED_FLAGS))
    if forced:
        raise ValueError(f"{', '.join(forced)}: bench-train sets these itself; leave them out.")
    entry_defaults = {**DEFAULTS, **(VLM_DEFAULTS if entry == "pretrain_vlm" else {})}
    defaults = {flag: value for flag, value in entry_defaults.items() if flag not in given}
    if "--context-parallel-size" not in given:
        defaults["--context-parallel-size"] = nproc
    if "--varlen-distribution" in defaults and given.intersection(
        DATA_SOURCES + VLM_DATA_SOURCES
    ):
        del defaults["--varlen-distribution"]  # the user's data replaces the mock lengths
    if not cuda_ranks():  # no idle core for background work: see cuda_ranks
        defaults.update({f: v for f, v in CPU_DEFAULTS.items() if f not in given})
    bench = {"--dynamic-context-parallel": True, "--log-interval": 1, "--train-iters": iterations}
    return [*flag_list({**defaults, **bench}), *extra]


def cuda_ranks() -> bool:
    """Whether the ranks will compute on GPUs. Where they compute on the CPU, bench-train
    adds :data:`CPU_DEFAULTS` unless the user gives those flags: with one rank per core no
    core is idle for background work, which then takes its time from the step it overlaps,
    and the arms' busy times would carry it (docs/performance.md, "The missing term: a cost
    per sequence"). On a GPU the host is idle while kernels run, and training's defaults are
    what is measured."""
    import torch

    return torch.cuda.is_available()
