"""``testing.model_size``, the parameter count the functional cases and end-to-end runs check
megatron's log against: computed from the flags alone, it must equal the count of the model the
entry point builds, on every rank, in tensor / pipeline / virtual-pipeline / expert layouts, with
experts, MTP, q/k norms, multi-latent attention, Mamba and Gated DeltaNet layers; and megatron's
log line must be read."""

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing.entry_model import TINY_FLAGS, built_model  # noqa: E402
from megatron_dcp.testing.functional import case_names, load_case  # noqa: E402
from megatron_dcp.testing.model_size import check_model_size, expected_parameters  # noqa: E402
from megatron_dcp.tools.launching.local_ranks import run_distributed  # noqa: E402
from megatron_dcp.tools.launching.training_runs import parse_log  # noqa: E402

EXPERTS = {"--num-experts": 4, "--moe-token-dispatcher-type": "alltoall"}
LAYOUTS = {
    "tp2·pp2, ep2, MoE layers 2 and 3, q/k norm": (
        4,
        {
            **EXPERTS,
            "--tensor-model-parallel-size": 2,
            "--pipeline-model-parallel-size": 2,
            "--expert-model-parallel-size": 2,
            "--expert-tensor-parallel-size": 1,
            "--moe-layer-freq": "[0,1,1,0]",
            "--num-layers": 4,
            "--qk-layernorm": True,
        },
    ),
    "pp2·vpp2, MoE layers 1 and 4, MTP on the last stage": (
        2,
        {
            **EXPERTS,
            "--pipeline-model-parallel-size": 2,
            "--num-layers-per-virtual-pipeline-stage": 1,
            "--moe-layer-freq": "[1,0,0,1]",
            "--num-layers": 4,
            "--mtp-num-layers": 1,
        },
    ),
    "tp2, MLA with low-rank queries and q/kv norms, MoE, MTP": (
        2,
        {
            **EXPERTS,
            "--tensor-model-parallel-size": 2,
            "--multi-latent-attention": True,
            "--q-lora-rank": 48,
            "--kv-lora-rank": 32,
            "--qk-head-dim": 16,
            "--qk-pos-emb-head-dim": 8,
            "--v-head-dim": 12,
            "--qk-layernorm": True,
            "--normalization": "RMSNorm",
            "--mtp-num-layers": 1,
        },
    ),
    "tp2, swiglu, RMSNorm, GQA, learned positions, untied, biases, shared experts": (
        2,
        {
            **EXPERTS,
            "--tensor-model-parallel-size": 2,
            "--swiglu": True,
            "--normalization": "RMSNorm",
            "--group-query-attention": True,
            "--num-query-groups": 2,
            "--position-embedding-type": "learned_absolute",
            "--untie-embeddings-and-output-weights": True,
            "--moe-shared-expert-intermediate-size": 32,
            "--moe-ffn-hidden-size": 48,
        },
    ),
    "tp2 with SP, Gated DeltaNet layers 1-3, MoE layers 2 and 3, RMSNorm, swiglu": (
        2,
        {
            **EXPERTS,
            "--tensor-model-parallel-size": 2,
            "--sequence-parallel": True,
            "--moe-layer-freq": "[0,1,1,0]",
            "--num-layers": 4,
            "--experimental-attention-variant": "gated_delta_net",
            "--linear-attention-freq": 4,
            "--swiglu": True,
            "--normalization": "RMSNorm",
            "--linear-conv-kernel-dim": 3,
            "--linear-key-head-dim": 8,
            "--linear-value-head-dim": 16,
            "--linear-num-key-heads": 2,
            "--linear-num-value-heads": 4,
        },
    ),
}


def built_counts(entry: str, flags: dict, world_size: int) -> dict:
    """(tensor rank, pipeline rank) -> the parameters every such rank built."""
    counts = {}
    for ranks, count, _ in run_distributed(built_model, world_size, entry, flags, timeout_s=600):
        counts.setdefault(ranks, set()).add(count)
    return counts


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_formula_counts_the_built_model(layout):
    world_size, flags = LAYOUTS[layout]
    flags = {**TINY_FLAGS, **flags}
    expected = expected_parameters(flags)
    assert built_counts("pretrain_gpt", flags, world_size) == {
        ranks: {count} for ranks, count in expected.items()
    }


@pytest.mark.parametrize("name", case_names())
def test_the_formula_counts_each_functional_case(name):
    """Each case's own flags and rank count (8: the forked ranks only build the model)."""
    case = load_case(name)
    expected = expected_parameters(case.model_args)
    assert built_counts(case.entry, case.model_args, case.nproc) == {
        ranks: {count} for ranks, count in expected.items()
    }


def test_an_unknown_flag_is_refused_by_name():
    with pytest.raises(ValueError, match="--kv-channels: testing.model_size does not know"):
        expected_parameters({**TINY_FLAGS, "--kv-channels": 32})


def test_megatrons_log_line_is_read_and_compared():
    flags = dict(TINY_FLAGS)
    count = expected_parameters(flags)[0, 0]
    line = " > number of parameters on (tensor, gtp_remat, pipeline) model parallel rank"
    log = parse_log(f"{line} (0, 0, 0): {count}\n")
    assert log.parameters == {(0, 0): count}
    check_model_size(flags, log.parameters)
    with pytest.raises(AssertionError, match="not the one the flags ask for"):
        check_model_size({**flags, "--num-experts": 4}, log.parameters)
    with pytest.raises(AssertionError, match="logged no parameter count"):
        check_model_size(flags, parse_log("").parameters)
