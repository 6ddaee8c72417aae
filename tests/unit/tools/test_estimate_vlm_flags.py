"""``megatron-dcp estimate``'s vision-language flags, refused before anything is read (no torch):
a typo in a vision or VLM data flag is an error naming the flag it is closest to, not a note
that the flag was not read; a malformed value is argparse's error; a text source next to the
vision flags is refused (a vision-language model reads ``--vlm-data`` or mock images)."""

import pytest

from megatron_dcp.tools.cli.estimate import estimate


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("--vision-num-layer", "--vision-num-layers"),
        ("--vision-hiden-size", "--vision-hidden-size"),
        ("--img-hh", "--img-h"),
        ("--vlm-images-per-sampel", "--vlm-images-per-sample"),
        ("--patch-dims", "--patch-dim"),
    ],
)
def test_a_typo_in_a_vision_flag_is_refused_with_the_flag_meant(typo, meant):
    with pytest.raises(ValueError, match=f"{typo}: not a flag of estimate; did you mean {meant}"):
        estimate(["--lengths", "L", typo, "2"])


def test_an_unknown_vision_looking_flag_lists_the_vision_flags():
    with pytest.raises(ValueError, match="--vision-foo: not a flag of estimate; its flags are"):
        estimate(["--lengths", "L", "--vision-foo", "2"])


def test_pretrain_vlm_flags_estimate_does_not_price_are_only_noted(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("100\n300\n")
    flags = ["--lengths", str(path), "--batches", "1", "--global-batch-size", "2",
             "--model-preset", "bench-train"]  # fmt: skip
    assert estimate([*flags, "--vision-projection-ffn-hidden-size", "64"]) == 0
    assert "flags estimate does not read: --vision-projection-ffn-hidden-size" in (
        capsys.readouterr().out
    )


def test_a_malformed_vision_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        estimate(["--lengths", "L", "--vision-hidden-size", "12x"])
    assert "--vision-hidden-size" in capsys.readouterr().err


def test_a_text_source_next_to_vision_flags_is_refused():
    with pytest.raises(ValueError, match="--lengths='L' with vision-language flags"):
        estimate(["--lengths", "L", "--vision-num-layers", "2", "--model-preset", "bench-train"])
