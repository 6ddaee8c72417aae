"""``megatron-dcp estimate`` on vision-language data: the samples of ``pretrain_vlm``'s mock
dataset (combined lengths and encoder patches), planned with their patches under a cost model
whose ``vision`` term comes from the vision flags. An image-heavy batch gets another answer than
the same combined lengths without patches; the vision flags are checked as pretrain_vlm checks
them."""

import argparse
import json

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.tools.cli.estimate import estimate

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
# The flags not given (the sequence length, the vocabulary, the encoder's): bench-train's.
MODEL = ["--cost-model", "cpu", "--model-preset", "bench-train", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--step-rest-ms", "0", "--max-seqlen-per-dp-cp-rank", "1024", "--global-batch-size", "8",
         "--batches", "3"]  # fmt: skip
# Three images of two 128-pixel tiles a sample (65 patches a tile), a 6-layer ViT of width 256.
HEAVY = ["--vlm-images-per-sample", "3", "--vlm-tiles-per-image", "2", "--max-num-tiles", "2",
         "--img-h", "128", "--img-w", "128", "--patch-dim", "16", "--vision-num-layers", "6",
         "--vision-hidden-size", "256",
         "--varlen-distribution", "lognormal:median=150,sigma=0.8,min=16,max=512"]  # fmt: skip


def run(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    assert estimate([*MODEL, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def mock_samples(count):
    """pretrain_vlm's own mock train dataset of HEAVY's flags: (combined lengths, patches)."""
    from megatron_dcp.integration.data.vlm_datasets import VLMDataConfig, build_vlm_datasets

    config = VLMDataConfig(
        seq_length=4096, vocab_size=1024, seed=1234, num_samples=(count, 0, 0),
        image_seq_length=65, img_h=128, img_w=128, max_num_tiles=2, images_per_sample="3",
        tiles_per_image="2", distribution="lognormal:median=150,sigma=0.8,min=16,max=512",
    )  # fmt: skip
    train = build_vlm_datasets(config)[0]
    items = [train[index] for index in range(count)]
    return [int(item["length"]) for item in items], [int(item["tiles"]) * 65 for item in items]


def test_an_image_heavy_batch_is_not_planned_as_its_lengths_alone(tmp_path, capsys):
    vlm = run(tmp_path, "vlm", *HEAVY)
    printed = capsys.readouterr().out
    lengths, patches = mock_samples(24)
    assert [n for batch in vlm["lengths"] for n in batch] == lengths  # training's samples
    assert [p for batch in vlm["vlm"]["patches"] for p in batch] == patches
    assert vlm["vlm"]["samples_with_images"] == vlm["vlm"]["samples"] == 24
    assert "images: 24 of 24 samples have images (144 tiles, 9,360 encoder patches)" in printed
    assert "encoder % of step" in printed
    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("\n".join(map(str, lengths)) + "\n")
    text = run(tmp_path, "text", "--lengths", str(lengths_file), "--seq-length", "4096")
    assert text["lengths"] == vlm["lengths"] and "vlm" not in text
    for arm in ("static", "dcp", "megatron_dev"):
        ours, blind = vlm["arms"][arm], text["arms"][arm]
        assert vlm["arms"][arm]["encoder_share"] > 0.2, arm
        for batch, plain in zip(ours["per_batch"], blind["per_batch"]):
            assert batch["encoder_s"] > 0
            assert batch["critical_path"] > plain["critical_path"] + 0.5 * batch["encoder_s"]
    assert vlm["speedups"]["dcp_over_static"] != pytest.approx(
        text["speedups"]["dcp_over_static"], rel=1e-3
    )


def test_the_vision_term_grows_with_the_vision_flags(tmp_path):
    small = run(tmp_path, "small", *HEAVY)["vlm"]["vision_s_per_patch"]
    deep = run(tmp_path, "deep", *HEAVY, "--vision-num-layers", "12")["vlm"]["vision_s_per_patch"]
    assert small > 0 and deep > 1.8 * small


def test_mock_flags_alone_take_the_presets_vision_model(tmp_path):
    """No vision flag, --model-preset bench-train: bench-train --entry pretrain_vlm's ViT
    (bench_train.run_flags.VLM_DEFAULTS)."""
    from megatron_dcp.integration.model_cost import cost_model_of, model_shape_from_args
    from megatron_dcp.tools.bench_train.run_flags import VLM_DEFAULTS

    result = run(tmp_path, "defaults", "--vlm-images-per-sample", "0:0.5,1:0.5")
    view = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                              ffn_hidden_size=128, vocab_size=1024, seq_length=4096,
                              **{k.lstrip("-").replace("-", "_"): v
                                 for k, v in VLM_DEFAULTS.items()})  # fmt: skip
    expected = cost_model_of(model_shape_from_args(view), "cpu-gloo").vision
    assert result["vlm"]["vision_s_per_patch"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--img-h", "60"], "--img-h=60 with --patch-dim=16: the CLIP ViT cuts a tile"),
        (["--vision-num-attention-heads", "3"], "--vision-hidden-size=128 with --vision-num-"),
        (["--vision-model-type", "siglip"], "--vision-model-type=siglip: SigLIP"),
        (["--vlm-tiles-per-image", "4"], "draws 4 tiles but --max-num-tiles is 1"),
        (["--vlm-data", "x.jsonl"], "--vlm-data=x.jsonl: conversations are measured"),
    ],
)  # fmt: skip
def test_vision_flags_are_checked_as_pretrain_vlm_checks_them(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        estimate([*MODEL, "--vlm-images-per-sample", "1", *flags])
