"""``megatron_dcp.pretrain_gpt --sft-data`` end to end (4 CPU ranks, CP2·DP2, a tokenizer and
conversations generated here): static CP and DCP train alike with the loss on the assistant's
tokens only, the loss falls, and a run resumed from a checkpoint continues with the next unseen
conversations (the same losses as the uninterrupted run); each run trained the model its flags
and tokenizer ask for (megatron's parameter count against ``testing.model_size``)."""

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing.force_static_plan import launch_entry
from megatron_dcp.testing.functional import forked
from megatron_dcp.testing.model_size import check_model_size
from megatron_dcp.testing.plan_coverage import Layout, assert_covers, training_run_plan
from megatron_dcp.tools.conversation_corpus import write_sft_corpus
from megatron_dcp.tools.launching.training_runs import RunLog, flag_list, run_pretrain

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")


def sft_options(tmp_path, **overrides) -> dict:
    paths = write_sft_corpus(tmp_path / "data", count=400, seed=2)
    options = {
        "--dynamic-context-parallel": True,
        "--context-parallel-size": 2,
        "--max-seqlen-per-dp-cp-rank": 256,
        "--num-layers": 2,
        "--hidden-size": 32,
        "--num-attention-heads": 4,
        "--seq-length": 512,
        "--max-position-embeddings": 512,
        "--micro-batch-size": 1,
        "--global-batch-size": 8,
        "--train-iters": 4,
        "--hidden-dropout": 0.0,
        "--lr": 1e-2,
        "--tokenizer-type": "HuggingFaceTokenizer",
        "--tokenizer-model": str(paths["tokenizer"]),
        "--sft-data": str(paths["corpus"]),
        "--split": "80,10,10",
        "--eval-iters": 1,
        "--eval-interval": 4,
        "--dcp-cost-adapt": "off",  # the same plans in every run, so resumed losses are exact
        "--log-interval": 1,
    }
    return {**options, **overrides}


def pretrain(options: dict, log_path) -> RunLog:
    """``megatron_dcp.pretrain_gpt`` on 4 ranks (CP2·DP2) forked from one process
    (``testing.forked_launch``), through the coverage check's switch
    (``testing.force_static_plan``) when it is on."""
    entry, args = launch_entry("pretrain_gpt", flag_list(options))
    return run_pretrain(args, 4, log_path, timeout_s=300, entry=entry, launcher=forked(entry))


def tokenizer_vocabulary(path) -> int:
    """The vocabulary megatron's HuggingFace tokenizer reports (every token, special ones too)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(path)))


def test_sft_static_and_dynamic_cp_agree_learn_and_resume(tmp_path):
    options = sft_options(tmp_path)
    vocabulary = tokenizer_vocabulary(options["--tokenizer-model"])
    static_cp = {**options, "--sequence-packing-scheduler": "dp_balanced"}
    static = pretrain(static_cp, tmp_path / "static.log")
    checkpoint = {"--save": tmp_path / "ckpt", "--save-interval": 2}
    dcp = pretrain({**options, **checkpoint}, tmp_path / "dcp.log")
    assert_covers(training_run_plan(static), Layout(dp=2, cp=2), cp_sizes={2})
    assert_covers(training_run_plan(dcp), Layout(dp=2, cp=2), mix_of={1})
    for run in (static, dcp):
        check_model_size(options, run.parameters, vocab_size=vocabulary)
    assert sorted(dcp.losses) == [1, 2, 3, 4] and static.losses.keys() == dcp.losses.keys()
    for iteration, loss in dcp.losses.items():
        assert loss == pytest.approx(static.losses[iteration], rel=1e-5)
    assert dcp.losses[4] < 0.95 * dcp.losses[1]
    assert "400 conversations from 400 records" in dcp.output
    assert "loss on the assistant's tokens" in dcp.output

    resume = {"--load": tmp_path / "ckpt", "--ckpt-step": 2}
    resumed = pretrain({**options, **resume}, tmp_path / "resumed.log")
    check_model_size(options, resumed.parameters, vocab_size=vocabulary)
    assert sorted(resumed.losses) == [3, 4]
    # megatron does not reset its loss accumulator after the first iteration a run logs: the
    # second reports the mean of both (as in the uninterrupted run's iteration 2).
    expected = {3: dcp.losses[3], 4: (dcp.losses[3] + dcp.losses[4]) / 2}
    for iteration, loss in expected.items():
        assert resumed.losses[iteration] == pytest.approx(loss, rel=1e-6)
