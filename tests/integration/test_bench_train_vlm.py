"""``megatron-dcp bench-train --entry pretrain_vlm`` on 2 CPU ranks: one shared tiny LLaVA run
(a 1-layer ViT on 32-pixel tiles, mock samples with 0–2 images) in which every arm (static CP,
DCP, Megatron dev's planner) trains every global batch; the arms planned the same samples with
the same encoder patches, and the sample digest covers the images (two samples that differ in a
pixel only have different digests)."""

import json

import pytest
import torch

from megatron_dcp.tools.bench_train.run_flags import training_flags
from megatron_dcp.tools.bench_train.worker import DigestingIterator
from megatron_dcp.tools.cli.bench_train import bench_train

TINY_VLM = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--global-batch-size", "8", "--max-seqlen-per-dp-cp-rank", "512",
    "--varlen-distribution", "lognormal:median=100,sigma=0.8,min=16,max=512",
    "--vision-num-layers", "1", "--vision-hidden-size", "64", "--vision-num-attention-heads", "2",
    "--img-h", "32", "--img-w", "32", "--patch-dim", "16",
    "--vlm-images-per-sample", "0:0.4,1:0.3,2:0.3",
]  # fmt: skip
ARMS = ("static", "dcp", "megatron_dev")


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_vlm")
    bench = ["--entry", "pretrain_vlm", "--nproc", "2", "--arms", ",".join(ARMS),
             "--batches", "2", "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert bench_train([*bench, *TINY_VLM]) == 0  # the digests agreed: same samples per batch
    return out


def test_every_arm_trains_the_vlm_batches(vlm_run):
    result = json.loads((vlm_run / "bench_train.json").read_text())
    assert sorted({step["arm"] for step in result["steps"]}) == sorted(ARMS)
    assert all(step["step_ms"] > 0 for step in result["steps"])
    assert set(result["summaries"]) == set(ARMS)
    log = (vlm_run / "train.log").read_text()
    assert "VLM model: vision encoder CLIPViTModel" in log


def test_the_arms_plan_the_same_samples_and_patches(vlm_run):
    plans = [json.loads(line) for line in (vlm_run / "plans.jsonl").read_text().splitlines()]
    assert [record["batch"] for record in plans] == [0, 1]
    for record in plans:
        arms = record["arms"]
        assert set(arms) == set(ARMS)
        assert len({(a["tokens"], a["patches"]) for a in arms.values()}) == 1
        assert arms["static"]["patches"] > 0 and arms["static"]["patches"] % 5 == 0  # 4 + class


def test_pretrain_vlm_gets_the_tiny_vit_defaults_unless_given():
    flags = training_flags([], nproc=2, iterations=3, entry="pretrain_vlm")
    assert flags[flags.index("--vision-num-layers") + 1] == "2"
    given = training_flags(["--img-h", "32"], nproc=2, iterations=3, entry="pretrain_vlm")
    assert given.count("--img-h") == 1 and given[given.index("--img-h") + 1] == "32"
    assert "--vision-num-layers" not in training_flags([], nproc=2, iterations=3)
    assert "--varlen-distribution" not in training_flags(["--vlm-data", "x.jsonl"], 2, 3)


def test_the_digest_covers_the_images(tmp_path):
    def sample(pixel):
        images = torch.zeros(1, 1, 3, 4, 4)
        images[0, 0, 0, 0, 0] = pixel
        fields = {key: torch.arange(5).reshape(1, 5) for key in ("tokens", "labels")}
        return {**fields, "loss_mask": torch.ones(1, 5), "vision_slot": torch.zeros(1, 5),
                "images": images}  # fmt: skip

    for name, pixel in (("a", 0.0), ("b", 1.0)):
        digests = DigestingIterator(iter([sample(pixel)]), 1, tmp_path / f"{name}.txt")
        next(digests)
    first, second = ((tmp_path / f"{n}.txt").read_text().split()[1] for n in "ab")
    assert first != second
