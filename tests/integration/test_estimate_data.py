"""``megatron-dcp estimate`` on the data sources that go through training's own datasets: an
indexed dataset written with megatron's ``IndexedDatasetBuilder`` (its lengths are the
documents' of the ``.idx``, minus the label, truncated, in training's seeded order), a
conversations file with its tokenizer (each conversation's chat-template tokens), a lengths
file read by ``--lengths`` and by training's ``--varlen-lengths-file`` alike, a JSONL file
through Hugging Face ``datasets``; the vocabulary padded as megatron pads it; and the training
flags estimate ignores, each taking as many values as training's parser gives it."""

import argparse
import json
from argparse import ArgumentParser

import numpy as np
import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.tools.cli.estimate import estimate, padded_vocabulary
from megatron_dcp.tools.conversation_corpus import write_sft_corpus

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
# The vocabulary: the tokenizer's where one is given, else the preset's (1024).
PLAN = ["--cost-model", "cpu", "--model-preset", "bench-train", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--max-seqlen-per-dp-cp-rank", "256", "--global-batch-size", "8"]  # fmt: skip


def run(tmp_path, *flags):
    out = tmp_path / "estimate.json"
    assert estimate([*PLAN, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def write_documents(prefix, count, seed=0):
    """``count`` documents of 2–599 tokens through megatron's own builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    lengths = []
    for _ in range(count):
        length = int(rng.integers(2, 600))
        builder.add_document(rng.integers(1, 128, length).astype(np.int32), [length])
        lengths.append(length)
    builder.finalize(f"{prefix}.idx")
    return str(prefix), lengths


def test_an_indexed_dataset_gives_its_documents_as_training_reads_them(tmp_path, capsys):
    prefix, documents = write_documents(tmp_path / "corpus", 64)
    result = run(tmp_path, "--data-path", prefix, "--split", "100,0,0", "--seq-length", "512",
                 "--batches", "8")  # fmt: skip
    lengths = [length for batch in result["lengths"] for length in batch]
    assert sorted(lengths) == sorted(min(n, 513) - 1 for n in documents)  # one pass, shuffled
    assert lengths != [min(n, 513) - 1 for n in documents]  # in training's seeded order
    assert result["source"].startswith(f"--data-path {prefix}")
    assert result["verdict"]["line"] in capsys.readouterr().out


def test_a_conversations_file_is_measured_with_its_chat_template(tmp_path):
    from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir

    corpus = write_sft_corpus(tmp_path / "sft", count=40, seed=3)
    flags = ["--sft-data", str(corpus["corpus"]), "--tokenizer-model", str(corpus["tokenizer"])]
    result = run(tmp_path, *flags, "--split", "1", "--seq-length", "512", "--batches", "5")
    chat = chat_tokenizer_from_dir(str(corpus["tokenizer"]))
    expected = []
    for line in corpus["corpus"].read_text().splitlines():
        ids, _ = chat.tokenize(json.loads(line)["messages"])
        expected.append(min(ids.size, 513) - 1)
    lengths = [length for batch in result["lengths"] for length in batch]
    assert sorted(lengths) == sorted(expected)
    assert set(result["arms"]) == {"static", "dcp", "megatron_dev"}


def test_a_lengths_file_reads_as_training_reads_it(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in [30, 700, 90, 12, 400, 5]) + "\n")
    ours = run(tmp_path, "--lengths", str(path), "--seq-length", "512", "--batches", "2")
    training = run(tmp_path, "--varlen-lengths-file", str(path), "--seq-length", "512",
                   "--batches", "2")  # fmt: skip
    assert ours["lengths"] == training["lengths"]
    assert ours["speedups"] == training["speedups"]


def test_a_jsonl_file_through_hugging_face_datasets(tmp_path):
    corpus = write_sft_corpus(tmp_path / "sft", count=20, seed=1)
    texts = tmp_path / "texts.jsonl"
    rows = [{"text": " ".join(["word"] * n)} for n in (3, 50, 400, 7)]
    texts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = ["--hf-dataset", "json", "--data-files", str(texts), "--text-field", "text"]
    words = run(tmp_path, *source, "--seq-length", "512", "--batches", "1")
    assert sorted(words["lengths"][0]) == sorted([3, 50, 400, 7] * 2)
    assert "whitespace-separated words" in words["source"]
    tokens = run(tmp_path, *source, "--tokenizer-model", str(corpus["tokenizer"]),
                 "--seq-length", "512", "--batches", "1")  # fmt: skip
    assert "tokens of" in tokens["source"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    counts = [len(tokenizer(row["text"], add_special_tokens=False)["input_ids"]) for row in rows]
    assert sorted(tokens["lengths"][0]) == sorted(min(n, 512) for n in counts * 2)
    with pytest.raises(ValueError, match="--text-field=body: no such column .* text"):
        estimate([*PLAN, *source[:-1], "body"])


def test_the_vocabulary_is_padded_as_megatron_pads_it():
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    for vocab, divisible, tp in ((1024, 128, 1), (1000, 128, 2), (50257, 64, 4)):
        args = argparse.Namespace(make_vocab_size_divisible_by=divisible,
                                  tensor_model_parallel_size=tp, rank=1)  # fmt: skip
        assert padded_vocabulary(vocab, divisible, tp) == vocab_size_with_padding(vocab, args)


@pytest.fixture(scope="module")
def training_parser():
    """pretrain_vlm's parser: megatron's flags, DCP's and the vision-language ones."""
    from megatron_dcp import pretrain_gpt  # noqa: F401  (megatron.training importable here)
    from megatron.training.arguments import add_megatron_arguments

    from megatron_dcp.integration.config import add_dcp_args
    from megatron_dcp.integration.training.vlm_entry import add_vision_args

    parser = add_megatron_arguments(ArgumentParser(allow_abbrev=False))
    add_dcp_args(parser)
    add_vision_args(parser)
    return parser


def test_the_ignored_flags_are_trainings_and_take_as_many_values(training_parser):
    from megatron_dcp.tools.estimate.command_line import IGNORED_FLAGS

    actions = training_parser._option_string_actions
    for group in IGNORED_FLAGS:
        for flags, takes in ((group.switches, (0,)), (group.valued, (None,)),
                             (group.lists, ("+", "*"))):  # fmt: skip
            for flag in flags:
                assert flag in actions, f"{flag}: not a training flag"
                assert actions[flag].nargs in takes, f"{flag}: nargs {actions[flag].nargs}"
