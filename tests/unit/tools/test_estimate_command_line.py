"""What ``megatron-dcp estimate`` takes from a command line (no torch): an unknown flag is
refused before anything is read, naming the closest flag it knows; training flags it ignores on
purpose take their values and are listed in one note; the model is never guessed: its shape
flags are required (named when missing) unless ``--model-preset`` names a model, announced in
the output's first line."""

import json

import pytest

from megatron_dcp.tools.cli.estimate import estimate, estimate_parser
from megatron_dcp.tools.cli.main import main
from megatron_dcp.tools.estimate.command_line import IGNORED_FLAGS, resolve_model

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "4096", "--vocab-size", "1024"]  # fmt: skip
PLAN = ["--cost-model", "cpu", "--batches", "1", "--global-batch-size", "4"]


@pytest.fixture
def lengths(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("100\n300\n120\n9000\n")
    return str(path)


def test_an_unknown_flag_is_refused_first_naming_the_closest_flag(capsys):
    """One line on stderr, exit 2, nothing read (the lengths file does not exist)."""
    argv = ["estimate", "--lengths", "missing.txt", *MODEL, "--hiden-size", "64"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "megatron-dcp estimate: error: --hiden-size: not a flag of estimate; did you mean "
        "--hidden-size? (docs/estimate.md).\n"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-layer", "2"], "--num-layer: not a flag of estimate; did you mean --num-layers?"),
        (["--lr-warmup-iter=5"], "--lr-warmup-iter: not a flag of estimate; did you mean "
                                 "--lr-warmup-iters?"),
        (["--fp8-format", "hybrid"], "--fp8-format: not a flag of estimate; remove it"),
        (["--swiglu", "yes"], "yes: a value after no flag that takes one"),
    ],
)  # fmt: skip
def test_a_flag_neither_read_nor_ignored_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        estimate(["--lengths", "missing.txt", *MODEL, *flags])


def test_ignored_training_flags_take_their_values_and_are_noted_once(lengths, tmp_path, capsys):
    out = tmp_path / "estimate.json"
    ignored = ["--lr=-1e-4", "--init-method-std", "-0.02", "--bf16", "--recompute-modules",
               "core_attn", "mlp", "--micro-batch-size=1", "--use-distributed-optimizer",
               "--log-interval", "1"]  # fmt: skip
    assert estimate(["--lengths", lengths, *ignored, *MODEL, "--nproc", "4", *PLAN,
                     "--json", str(out)]) == 0  # fmt: skip
    note = ("flags estimate does not read: --bf16, --init-method-std, --log-interval, --lr, "
            "--micro-batch-size, --recompute-modules, --use-distributed-optimizer")  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.count("does not read") == 1 and f"   note: {note}\n" in printed
    result = json.loads(out.read_text())
    assert result["notes"].count(note) == 1
    assert result["layout"]["cp_size"] == 4  # the flags after them are read


def test_each_ignored_flag_takes_as_many_values_as_training_gives_it():
    parser = estimate_parser()
    for group in IGNORED_FLAGS:
        for flag in group.switches:
            args, left = parser.parse_known_args([flag, "--nproc", "3"])
            assert (left, args.nproc) == ([], 3), flag
        for flag in group.valued:
            args, left = parser.parse_known_args([flag, "x", "--nproc", "3"])
            assert (left, args.nproc) == ([], 3), flag
        for flag in group.lists:
            args, left = parser.parse_known_args([flag, "x", "y", "--nproc", "3"])
            assert (left, args.nproc) == ([], 3), flag


def test_missing_shape_flags_are_refused_naming_each(lengths):
    with pytest.raises(ValueError) as error:
        estimate(["--lengths", lengths, "--num-layers", "2", "--seq-length", "512"])
    assert str(error.value).startswith(
        "--hidden-size, --num-attention-heads, --vocab-size (or --tokenizer-model DIR): not "
        "given; estimate does not guess the model: give them as training gets them, or "
        "--model-preset bench-train for bench-train's model (4 layers, hidden 256"
    )
    with pytest.raises(ValueError, match="^--seq-length: not given"):
        estimate(["--lengths", lengths, *MODEL[:6], "--tokenizer-model", "DIR"])


def test_on_vision_language_data_the_encoders_shape_is_required_too():
    with pytest.raises(ValueError, match="^--vision-hidden-size, --vision-num-attention-heads, "
                       "--img-h, --img-w, --patch-dim: not given"):  # fmt: skip
        estimate(["--vlm-images-per-sample", "1", "--vision-num-layers", "2", *MODEL])


def test_a_preset_is_announced_in_the_first_line(lengths, tmp_path, capsys):
    """bench-train's model, its sequence length cutting the 9000-token sample (said too)."""
    out = tmp_path / "estimate.json"
    assert estimate(["--lengths", lengths, "--model-preset", "bench-train", *PLAN,
                     "--json", str(out)]) == 0  # fmt: skip
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "model: preset bench-train: 4 layers, hidden 256, 4 heads, FFN 1024, seq-length 4096, "
        "vocabulary 1024"
    )
    result = json.loads(out.read_text())
    assert result["model_preset"] == first and result["lengths"] == [[100, 300, 120, 4096]]
    assert estimate(["--lengths", lengths, "--model-preset", "bench-train", "--num-layers", "2",
                     "--seq-length", "4000", *PLAN]) == 0  # fmt: skip
    assert capsys.readouterr().out.splitlines()[0] == (
        "model: preset bench-train, given --num-layers --seq-length: 2 layers, hidden 256, "
        "4 heads, FFN 1024, seq-length 4000, vocabulary 1024"
    )


@pytest.mark.parametrize(
    "flags, ffn",
    [([], 512), (["--swiglu"], 320), (["--ffn-hidden-size", "200"], 200)],
)
def test_the_mlp_size_not_given_is_megatrons(flags, ffn):
    """4 × hidden, or with --swiglu two thirds of it, down to a multiple of 64."""
    args = estimate_parser().parse_args([*MODEL, *flags])
    assert resolve_model(args, vision=False) is None
    assert args.ffn_hidden_size == ffn
