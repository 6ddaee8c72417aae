"""The SFT measure pass shared out over ranks (``integration/data/sft.py``): every rank ends with
the table one process builds alone, and a bad record read by one rank stops every rank with the
same error (no rank waits in a collective for the others)."""

import json

import numpy as np
import pytest

from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir
from megatron_dcp.integration.data.sft import SFTOptions, conversation_table
from megatron_dcp.tools.conversation_corpus import write_sft_corpus
from megatron_dcp.tools.launching.local_ranks import run_distributed


def table_or_error(rank, world_size, corpus, tokenizer):
    chat = chat_tokenizer_from_dir(tokenizer)
    try:
        return conversation_table([corpus], chat, SFTOptions(seq_length=256)).columns
    except ValueError as error:
        return str(error)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_sft_corpus(tmp_path_factory.mktemp("sft"), count=61, seed=1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_holds_the_single_process_table(corpus, world_size):
    args = (str(corpus["corpus"]), str(corpus["tokenizer"]))
    (alone,) = run_distributed(table_or_error, 1, *args)
    tables = run_distributed(table_or_error, world_size, *args)
    assert alone.shape == (61, 5)
    for table in tables:
        np.testing.assert_array_equal(table, alone)


def test_a_bad_record_on_one_rank_stops_every_rank(corpus, tmp_path):
    lines = corpus["corpus"].read_text().splitlines()
    lines[5] = json.dumps({"messages": [{"role": "narrator", "content": "once"}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    errors = run_distributed(table_or_error, 2, str(bad), str(corpus["tokenizer"]))
    assert errors[0] == errors[1]  # record 5 is rank 1's
    assert f"{bad}:6: message 1: role 'narrator'" in errors[0]
