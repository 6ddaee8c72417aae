"""``megatron-dcp sft-corpus`` prints a training command that runs as printed: the test pastes
it into a shell (2 CPU ranks, a tiny model, 4 iterations; about a minute), and it trains the
model its flags ask for (megatron's parameter count against ``testing.model_size``)."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing.model_size import check_model_size, flags_of
from megatron_dcp.tools.launching.training_runs import parse_log

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
CLI = Path(sys.executable).with_name("megatron-dcp")


def printed_lines(tmp_path) -> list:
    command = [str(CLI), "sft-corpus", "--out", "data", "--conversations", "300"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_the_printed_training_command_runs_as_printed(tmp_path):
    lines = printed_lines(tmp_path)
    assert lines[1].startswith("data flags: --sft-data ")
    assert "--tokenizer-type HuggingFaceTokenizer" in lines[1]
    command = lines[-1].strip()
    assert "megatron_dcp.pretrain_gpt" in command
    done = subprocess.run(
        command,
        shell=True,  # pasted into a shell, as a user would
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    log = parse_log(done.stdout)
    iterations = int(shlex.split(command)[shlex.split(command).index("--train-iters") + 1])
    assert sorted(log.losses) == list(range(1, iterations + 1))
    assert sorted(log.dcp) == sorted(log.losses)  # planned by DCP every iteration
    assert "loss on the assistant's tokens" in done.stdout
    words = shlex.split(command)
    flags = flags_of(words[words.index("megatron_dcp.pretrain_gpt") + 1 :])
    from transformers import AutoTokenizer

    vocabulary = len(AutoTokenizer.from_pretrained(str(flags["--tokenizer-model"])))
    check_model_size(flags, log.parameters, vocab_size=vocabulary)
