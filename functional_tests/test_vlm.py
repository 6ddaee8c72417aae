"""End-to-end training of ``megatron_dcp.pretrain_vlm`` on 4 CPU ranks (one case,
``vlm_cases/llava_clip_tp1_cp2_dcp``: a tiny LLaVA, mock samples with 0-2 images), two runs:

1. DCP: its plans mix CP sizes (``testing.plan_coverage``), the loss falls, and the model it
   trained is LLaVA with a CLIP ViT, an MLP projector and a GPT (the entry point's ``VLM model:``
   line): the three parts' parameters add up to megatron's own count, and the GPT's is the one
   ``testing.model_size`` computes from the language flags;
2. the same job with ``--sequence-packing-scheduler dp_balanced`` (static CP, its plans of the
   static CP size alone): the same losses (``STATIC_RTOL``) — DCP changes speed, never math.

About 40 s on 2 cores (each run ~20 s, most of it start-up).
"""

import re

import pytest

from megatron_dcp.testing.functional import VLM_CASES_DIR, load_case, run_case
from megatron_dcp.testing.model_size import check_model_size
from megatron_dcp.testing.plan_coverage import assert_covers, training_run_plan

CASE = "llava_clip_tp1_cp2_dcp"
# As test_functional.py's: static CP and DCP reduce in different orders (measured here: 2e-7).
STATIC_RTOL = 1e-5
LEARNED = 0.95  # the loss falls by ~9 % over the six iterations
PARTS = re.compile(
    r"VLM model: vision encoder (\w+) \((\d+) parameters\), projector (\w+) \((\d+) "
    r"parameters\), language model (\w+) \((\d+) parameters\)"
)
# The flags that make the language model (testing.model_size knows GPT flags only).
VISION_FLAGS = ("--vision-", "--vlm-", "--img-", "--patch-dim")


@pytest.fixture(scope="module")
def case():
    return load_case(CASE, VLM_CASES_DIR)


@pytest.fixture(scope="module")
def dcp_run(case, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(case.name)
    return workdir, run_case(case, workdir, "dcp")


def test_dcp_trains_llava_with_a_clip_vit_a_projector_and_a_gpt(case, dcp_run):
    _, log = dcp_run
    assert_covers(training_run_plan(log), case.layout)  # a mix of CP sizes
    assert sorted(log.losses) == list(range(1, case.train_iters + 1))
    assert log.losses[case.train_iters] < LEARNED * log.losses[1], "the loss did not fall"
    (parts,) = set(PARTS.findall(log.output))  # printed once, by rank 0
    vision, vision_count, projector, projector_count, language, language_count = parts
    assert (vision, projector, language) == ("CLIPViTModel", "MultimodalProjector", "GPTModel")
    assert int(vision_count) > 0 and int(projector_count) > 0
    total = int(vision_count) + int(projector_count) + int(language_count)
    assert log.parameters == {(0, 0): total}
    language_flags = {
        flag: value for flag, value in case.model_args.items() if not flag.startswith(VISION_FLAGS)
    }
    check_model_size(language_flags, {(0, 0): int(language_count)})


def test_static_cp_gives_the_same_losses(case, dcp_run):
    workdir, log = dcp_run
    static = run_case(case, workdir, "static", scheduler="dp_balanced")
    assert_covers(training_run_plan(static), case.layout, cp_sizes={case.layout.cp})
    assert sorted(static.losses) == sorted(log.losses)
    for iteration, loss in log.losses.items():
        assert static.losses[iteration] == pytest.approx(loss, rel=STATIC_RTOL), iteration
    assert static.parameters == log.parameters
