"""``megatron_dcp.pretrain_vlm``'s flags: ``--help`` lists the vision flags; every vision-language
setting it refuses is one line naming flag, value and fix, exit status 2, before the first step;
the model its flags build (in this process, megatron's parsing and the entry point's start-up,
then its model provider) is megatron-core's LLaVA with a CLIP ViT, an MLP projector and a GPT of
the flags' sizes; the cost model prices the vision encoder."""

import os

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing import run_distributed  # noqa: E402
from megatron_dcp.testing.entry_model import TINY_FLAGS, reset_megatron_arguments  # noqa: E402
from megatron_dcp.tools.launching.training_runs import flag_list  # noqa: E402

# pretrain_gpt's tiny model with a tiny CLIP ViT (tiles of 32 × 32 pixels, 4 patches of 16).
VLM_FLAGS = {
    **TINY_FLAGS,
    "--seq-length": 256,
    "--vision-num-layers": 1,
    "--vision-hidden-size": 32,
    "--vision-num-attention-heads": 2,
    "--vision-ffn-hidden-size": 48,
    "--vision-projection-ffn-hidden-size": 96,
    "--img-h": 32,
    "--img-w": 32,
    "--patch-dim": 16,
    "--vlm-images-per-sample": "0:0.3,1:0.4,2:0.3",
}


@pytest.fixture(scope="module")
def pretrain_vlm():
    from megatron_dcp import pretrain_vlm

    return pretrain_vlm


def start_with(pretrain_vlm, monkeypatch, *flags: str, world_size: int = 2) -> int:
    """The status pretrain_vlm's start-up exits with for ``flags`` (after VLM_FLAGS')."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    reset_megatron_arguments()
    with pytest.raises(SystemExit) as exit_:
        pretrain_vlm.prepare([*flag_list(VLM_FLAGS), *flags])
    return exit_.value.code


def test_help_lists_the_vision_flags(pretrain_vlm, monkeypatch, capsys):
    assert start_with(pretrain_vlm, monkeypatch, "--help") == 0
    out = capsys.readouterr().out
    for flag in (
        "--vision-model-type",
        "--vision-num-layers",
        "--vision-projection-ffn-hidden-size",
        "--disable-vision-class-token",
        "--vlm-images-per-sample",
        "--dynamic-context-parallel",
        "--img-h",
    ):
        assert flag in out


REFUSALS = [
    (
        ["--pipeline-model-parallel-size", "2"],
        "error: --pipeline-model-parallel-size=2: megatron_dcp.pretrain_vlm does not run LLaVA's "
        "encoder and decoder pipeline stages under DCP yet; give --pipeline-model-parallel-size 1",
    ),
    (
        ["--position-embedding-type", "learned_absolute"],
        "error: --position-embedding-type=learned_absolute: LLaVA counts an image as one learned "
        "position",
    ),
    (
        ["--vision-model-type", "siglip"],
        "error: --vision-model-type=siglip: SigLIP has no class token and megatron's LLaVA pairs "
        "it with pixel shuffle, which DCP's vision path does not run; give --vision-model-type "
        "clip (a CLIP ViT).",
    ),
    (["--vision-model-type", "radio"], "error: --vision-model-type=radio: RADIO runs dynamic"),
    (["--vision-model-type", "internvit"], "error: --vision-model-type=internvit: InternViT"),
    (["--vision-model-type", "vit9"], "error: --vision-model-type=vit9: not a known encoder;"),
    (
        ["--img-h", "40"],
        "error: --img-h=40 with --patch-dim=16: the CLIP ViT cuts a tile into whole patches",
    ),
    (
        ["--vision-hidden-size", "30", "--vision-num-attention-heads", "4"],
        "error: --vision-hidden-size=30 with --vision-num-attention-heads=4: the heads must "
        "divide the width",
    ),
    (
        ["--data-path", "corpus"],
        "error: --data-path=['corpus']: a vision-language model reads --vlm-data",
    ),
    (
        ["--vlm-tiles-per-image", "2"],
        "error: --vlm-tiles-per-image='2' draws 2 tiles but --max-num-tiles is 1",
    ),
    (["--sequence-packing-scheduler", "dp_balanced"], "error: --seq-length=256: samples may be"),
]


@pytest.mark.parametrize("flags, line", REFUSALS, ids=[" ".join(f) for f, _ in REFUSALS])
def test_a_refused_setting_is_one_line_and_status_2(pretrain_vlm, monkeypatch, capfd, flags, line):
    assert start_with(pretrain_vlm, monkeypatch, *flags) == 2
    printed = capfd.readouterr()  # megatron's argument dump is held back at the fd, and dropped
    assert printed.out == "" and printed.err.splitlines() == [printed.err.strip()]
    assert printed.err.strip().startswith(line)


def built_vlm(rank: int, world_size: int, flags: dict) -> tuple:
    """On a rank of a ``run_distributed`` job: the model pretrain_vlm's provider builds from
    ``flags`` (its parts, module classes by name, parameter counts, image tokens a tile) and the
    vision coefficient of the cost model its DCPConfig plans with."""
    from megatron_dcp import pretrain_vlm
    from megatron_dcp.integration.model_parallel import init_megatron

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))
    reset_megatron_arguments()
    args, config, model_config = pretrain_vlm.prepare(flag_list(flags))
    init_megatron(cp=args.context_parallel_size, seed=args.seed)
    model = pretrain_vlm.model_provider(model_config)()
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return (
        tuple(type(getattr(model, part)).__name__ for part in PARTS),
        classes,
        shapes,
        model.img_seq_len,
        model_config.spec,
        config.cost_model.vision,
    )


PARTS = ("vision_model", "vision_projection", "language_model")


@pytest.fixture(scope="module")
def built():
    return run_distributed(built_vlm, 2, {**VLM_FLAGS, "--context-parallel-size": 2}, timeout_s=300)


def test_the_flags_build_llava_of_a_clip_vit_a_projector_and_a_gpt(built):
    parts, classes, shapes, img_seq_len, spec, _ = built[0]
    assert parts == ("CLIPViTModel", "MultimodalProjector", "GPTModel")
    # The language model runs the reference THD/CP attention; the ViT megatron's local one.
    attention = "language_model.decoder.layers.0.self_attention.core_attention"
    assert classes[attention] == "ReferenceCoreAttention"
    assert classes["vision_model.decoder.layers.0.self_attention.core_attention"] == (
        "DotProductAttention"
    )
    assert not any(name.startswith("vision_model.decoder.layers.1.") for name in classes)
    assert shapes["vision_model.conv1.weight"] == (32, 3, 16, 16)
    assert shapes["vision_model.decoder.layers.0.mlp.linear_fc1.weight"] == (48, 32)
    assert shapes["vision_projection.encoder.linear_fc1.weight"] == (96, 32)
    assert shapes["vision_projection.encoder.linear_fc2.weight"] == (64, 96)
    assert shapes["language_model.embedding.word_embeddings.weight"] == (128, 64)
    # The class token reaches the language model (no --disable-vision-class-token): 4 + 1.
    assert img_seq_len == spec.tokens_per_tile == 5 and spec.patches_per_tile == 5
    assert spec.tile_shape == (3, 32, 32)


def test_the_cost_model_prices_the_vision_encoder(built):
    assert built[0][5] > 0


def test_disable_vision_class_token_drops_it_before_the_projector():
    flags = {**VLM_FLAGS, "--context-parallel-size": 2, "--disable-vision-class-token": True}
    img_seq_len, spec = run_distributed(built_vlm, 2, flags, timeout_s=300)[0][3:5]
    assert img_seq_len == spec.tokens_per_tile == 4 and spec.patches_per_tile == 5
