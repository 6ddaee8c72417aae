"""SFT conversations as DCP samples (``integration/data/{conversations,chat,sft}.py``), offline:
a byte-level BPE trained here on generated text, with a ChatML template. Masks, truncation,
splits, shuffling, resume and every bad-input error (file and line)."""

import json
import logging

import numpy as np
import pytest

from megatron_dcp.integration.data.chat import ChatTokenizer, chat_tokenizer_from_dir, checked
from megatron_dcp.integration.data.datasets import build_varlen_datasets
from megatron_dcp.integration.data.sft import SFTOptions, encode
from megatron_dcp.tools.conversation_corpus import write_sft_corpus

SYSTEM = {"role": "system", "content": "Answer briefly."}
Q1 = {"role": "user", "content": "kaka lomi ne"}
A1 = {"role": "assistant", "content": "ruta vizo"}
Q2 = {"role": "user", "content": "pesu da"}
A2 = {"role": "assistant", "content": "fi kalo mine"}
CONVERSATION = [SYSTEM, Q1, A1, Q2, A2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_sft_corpus(tmp_path_factory.mktemp("sft"), count=300, seed=3)


@pytest.fixture(scope="module")
def chat(corpus) -> ChatTokenizer:
    return chat_tokenizer_from_dir(str(corpus["tokenizer"]))


def write_jsonl(path, records, blank_after=()):
    with open(path, "w") as handle:
        for index, record in enumerate(records):
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
            if index in blank_after:
                handle.write("\n")
    return str(path)


def datasets(chat, path, seq_length=1024, counts=(8, 0, 0), split="1", seed=5, **flags):
    return build_varlen_datasets(
        seq_length=seq_length,
        vocab_size=0,
        seed=seed,
        num_samples=list(counts),
        split=split,
        sft_data=path,
        chat=chat,
        **flags,
    )


def decode(chat, ids) -> str:
    return chat.tokenizer.decode(list(ids))


def test_only_the_assistants_tokens_are_in_the_loss(chat):
    sample = encode(chat, CONVERSATION, SFTOptions(seq_length=1024))
    labels, mask = sample["labels"], sample["loss_mask"]
    in_loss = decode(chat, labels[mask > 0])
    assert in_loss == "ruta vizo<|im_end|>\nfi kalo mine<|im_end|>\n"
    # The prompt (system, user turns and the generation prompt "<|im_start|>assistant\n") is not.
    prompt = decode(chat, labels[mask == 0])
    assert "kaka lomi ne" in prompt and "Answer briefly." in prompt and "ruta" not in prompt
    assert prompt.count("<|im_start|>assistant\n") == 2
    # Every label is the next token, and the last label is the conversation's own last token.
    ids, _ = chat.tokenize(CONVERSATION)
    assert sample["tokens"].tolist() == ids[:-1].tolist()
    assert sample["labels"].tolist() == ids[1:].tolist()
    assert int(sample["length"]) == ids.size - 1


def test_loss_on_prompt_keeps_every_label(chat):
    sample = encode(chat, CONVERSATION, SFTOptions(seq_length=1024, loss_on_prompt=True))
    assert bool((sample["loss_mask"] == 1).all())


def test_packed_labels_never_point_into_the_next_conversation(chat):
    """In a THD micro-batch the last label of a conversation is its own last token (the "\n"
    after <|im_end|>), not the next conversation's first (<|im_start|>)."""
    from megatron_dcp.runtime.packing import pack_samples

    options = SFTOptions(seq_length=1024)
    first, second = encode(chat, [Q1, A1], options), encode(chat, [SYSTEM, Q2, A2], options)
    packed = pack_samples([first, second], 1, 0, 1)
    labels, mask = packed.labels.view(-1).tolist(), packed.loss_mask.view(-1).tolist()
    end = int(first["length"])
    own_last = chat.tokenize([Q1, A1])[0][-1]
    assert labels[end - 1] == own_last != int(second["tokens"][0])
    assert (
        labels[: end + int(second["length"])]
        == first["labels"].tolist() + second["labels"].tolist()
    )
    assert mask[:end] == first["loss_mask"].tolist()


def test_truncation_keeps_the_first_tokens_and_is_logged(chat, tmp_path, caplog):
    long_answer = {"role": "assistant", "content": " ".join(["kalo"] * 200)}
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"messages": [Q1, A1]}, {"messages": [Q1, long_answer]}, {"messages": [SYSTEM, Q1]}],
    )
    ids, _ = chat.tokenize([Q1, long_answer])
    with caplog.at_level(logging.WARNING):
        train, _, _ = datasets(
            chat, path, seq_length=64, counts=(3, 0, 0), split="1", seed=None, loss_on_prompt=True
        )
    long = train[1]
    assert int(long["length"]) == 64 and long["tokens"].tolist() == ids[:64].tolist()
    assert long["labels"].tolist() == ids[1:65].tolist()
    assert "1 of 3 sequences are longer than --seq-length 64" in caplog.text
    assert train.sequence_length(1) == 64


def test_a_conversation_truncated_before_its_answer_is_counted(chat, tmp_path, capsys):
    long_question = {"role": "user", "content": " ".join(["vizo"] * 200)}
    path = write_jsonl(
        tmp_path / "c.jsonl", [{"messages": [long_question, A1]}, {"messages": [Q1, A1]}]
    )
    train, _, _ = datasets(chat, path, seq_length=32, counts=(2, 0, 0), seed=None)
    assert float(train[0]["loss_mask"].sum()) == 0 and float(train[1]["loss_mask"].sum()) > 0
    assert "1 conversations have no loss token left" in capsys.readouterr().out


def test_a_record_with_several_system_messages_holds_several_conversations(chat, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [SYSTEM, Q1, A1, SYSTEM, Q2, A2]}])
    train, _, _ = datasets(chat, path, counts=(2, 0, 0), seed=None)
    first, second = (
        encode(chat, c, SFTOptions(1024)) for c in ([SYSTEM, Q1, A1], [SYSTEM, Q2, A2])
    )
    assert train[0]["tokens"].tolist() == first["tokens"].tolist()
    assert train[1]["tokens"].tolist() == second["tokens"].tolist()


def test_splits_are_disjoint_ranges_and_shuffling_follows_the_seed(chat, corpus):
    path = str(corpus["corpus"])
    train, valid, test = datasets(chat, path, counts=(600, 40, 30), split="80,10,10", seed=11)
    rows = [{ds.conversation_index(i) for i in range(len(ds))} for ds in (train, valid, test)]
    total = len(train.table)
    assert rows[0] == set(range(0, 240)) and rows[1] == set(range(240, 270))
    assert rows[2] == set(range(270, total))
    # Each pass over the split is a permutation; passes differ; the same seed gives the same order.
    first, second = (
        [train.conversation_index(i) for i in range(p * 240, (p + 1) * 240)] for p in (0, 1)
    )
    assert sorted(first) == list(range(240)) and first != second and first != sorted(first)
    again, _, _ = datasets(chat, path, counts=(600, 40, 30), split="80,10,10", seed=11)
    other, _, _ = datasets(chat, path, counts=(600, 40, 30), split="80,10,10", seed=12)
    assert [again.conversation_index(i) for i in range(600)] == first + second + [
        train.conversation_index(i) for i in range(480, 600)
    ]
    assert [other.conversation_index(i) for i in range(240)] != first


def test_resuming_reads_the_next_unseen_conversation(chat, corpus):
    """megatron resumes its sampler at the consumed-sample count; sample i is a pure function of
    (seed, split, i), so a dataset built afresh continues exactly where the first stopped."""
    from megatron_dcp.integration.patches import enable_cpu_training

    enable_cpu_training()  # megatron.training needs the CPU backend's stand-ins on Python 3.11
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    path, gbs, steps = str(corpus["corpus"]), 8, 6
    whole, _, _ = datasets(chat, path, counts=(gbs * steps, 0, 0))
    sampler = MegatronPretrainingSampler(gbs * steps, 0, gbs, 0, 1)
    uninterrupted = [whole[i]["tokens"].tolist() for batch in sampler for i in batch]
    resumed_ds, _, _ = datasets(chat, path, counts=(gbs * steps, 0, 0))
    resumed = [
        resumed_ds[i]["tokens"].tolist()
        for batch in MegatronPretrainingSampler(gbs * steps, gbs * 4, gbs, 0, 1)
        for i in batch
    ]
    assert resumed == uninterrupted[gbs * 4 :]
    assert len({tuple(tokens) for tokens in uninterrupted}) == gbs * steps  # no repeats in a pass


def test_a_json_array_file_is_read_like_jsonl(chat, tmp_path):
    records = [{"messages": [Q1, A1]}, {"messages": [SYSTEM, Q2, A2]}]
    array = tmp_path / "c.json"
    array.write_text(json.dumps(records, indent=2))
    lines = write_jsonl(tmp_path / "c.jsonl", records)
    from_array, _, _ = datasets(chat, str(array), counts=(2, 0, 0), seed=None)
    from_lines, _, _ = datasets(chat, lines, counts=(2, 0, 0), seed=None)
    for i in range(2):
        assert from_array[i]["tokens"].tolist() == from_lines[i]["tokens"].tolist()
    assert [from_array.table.where(i) for i in range(2)] == [f"{array}:2", f"{array}:14"]


BAD = {
    "malformed": ('{"messages": [', "not valid JSON"),
    "missing role": ({"messages": [{"content": "hi"}, A1]}, 'message 1: no "role"'),
    "unknown role": ({"messages": [{"role": "bot", "content": "hi"}, A1]}, "role 'bot'"),
    "content": ({"messages": [Q1, {"role": "assistant", "content": 3}]}, "message 2"),
    "empty": ({"messages": []}, "empty conversation"),
    "no messages": ({"text": "hello"}, '"messages" list'),
    "no assistant": ({"messages": [SYSTEM, Q1]}, "no assistant turn"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_refused_with_file_and_line(chat, tmp_path, case):
    record, reason = BAD[case]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [Q1, A1]}, record], blank_after=(0,))
    with pytest.raises(ValueError) as error:
        datasets(chat, path, counts=(1, 0, 0))
    assert f"--sft-data: {path}:3: " in str(error.value) and reason in str(error.value)
    assert "--sft-skip-invalid" in str(error.value)


def test_skip_invalid_counts_what_it_skips(chat, tmp_path, capsys):
    records = [{"messages": [Q1, A1]}, '{"messages": [', {"messages": []}, {"messages": [Q2, A2]}]
    path = write_jsonl(tmp_path / "c.jsonl", records, blank_after=(1,))
    train, _, _ = datasets(chat, path, counts=(2, 0, 0), seed=None, skip_invalid=True)
    assert len(train.table) == 2 and train.table.where(1) == f"{path}:5"
    out = capsys.readouterr().out
    assert "2 conversations from 4 records (1 blank lines skipped, 2 invalid records skipped" in out
    assert f"the first: {path}:2: not valid JSON" in out


UNFINISHED = '{"messages": [{"role": "user", "content": "hi"}]'  # no closing brace
NO_COMMA = '{"messages": [{"role": "user" "content": "hi"}]}'
CONTENT = NO_COMMA.index('"content"')


@pytest.mark.parametrize(
    "line, place",
    [
        (UNFINISHED, f"column {len(UNFINISHED) + 1} (the end of the line))"),
        (NO_COMMA, f"column {CONTENT + 1})"),
    ],
)
def test_a_json_error_gives_the_column_it_is_at(chat, tmp_path, line, place):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [Q1, A1]}, line])
    with pytest.raises(ValueError) as error:
        datasets(chat, path, counts=(1, 0, 0))
    assert f"{path}:2: not valid JSON (Expecting ',' delimiter, {place}" in str(error.value)


def test_a_json_array_error_gives_the_line_and_column(chat, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(f"[\n  {json.dumps({'messages': [Q1, A1]})},\n  {NO_COMMA}\n]\n")
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON \(.*, column {CONTENT + 3}\)"):
        datasets(chat, str(path), counts=(1, 0, 0))


def test_no_assistant_turn_is_accepted_with_loss_on_prompt(chat, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [SYSTEM, Q1]}])
    train, _, _ = datasets(chat, path, counts=(1, 0, 0), loss_on_prompt=True)
    assert float(train[0]["loss_mask"].sum()) == int(train[0]["length"])


def test_a_json_array_error_names_the_elements_line(chat, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(
        '[\n  {"messages": [{"role": "user", "content": "a"},\n'
        '    {"role": "assistant", "content": "b"}]},\n  {"messages": []}\n]\n'
    )
    with pytest.raises(ValueError, match=rf"{path}:4: empty conversation"):
        datasets(chat, str(path), counts=(1, 0, 0))


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"distribution": "constant:value=8"}, "give at most one data source"),
        ({"split": "1,0,0", "counts": (1, 1, 0)}, "the valid split"),
    ],
)
def test_source_and_split_errors(chat, corpus, flags, message):
    counts = flags.pop("counts", (1, 0, 0))
    with pytest.raises(ValueError, match=message):
        datasets(chat, str(corpus["corpus"]), counts=counts, **flags)


def test_sft_switches_need_sft_data():
    for flag in ("loss_on_prompt", "skip_invalid"):
        with pytest.raises(ValueError, match=f"--sft-{flag.replace('_', '-')} applies"):
            build_varlen_datasets(
                seq_length=8, vocab_size=8, seed=0, num_samples=[1], **{flag: True}
            )


def test_a_missing_file_is_named(chat, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        datasets(chat, f"{tmp_path}/absent.jsonl,{tmp_path}/other.jsonl")


def test_tokenizers_without_a_chat_template_or_offsets_are_refused(chat):
    from megatron_dcp.integration.data.chat import check_tokenizer_type

    with pytest.raises(ValueError, match="--tokenizer-type HuggingFaceTokenizer"):
        check_tokenizer_type("NullTokenizer")
    with pytest.raises(ValueError, match="no chat template"):
        checked(chat.tokenizer, None)
    with pytest.raises(ValueError, match="fast HuggingFace tokenizer"):
        checked(object(), chat.template)


def test_a_template_that_rewrites_earlier_turns_is_refused(chat, tmp_path):
    # Renders the last message first: the first messages' rendering is not a prefix.
    reversed_template = (
        "{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    odd = ChatTokenizer(chat.tokenizer, reversed_template)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [Q1, A1, Q2, A2]}])
    with pytest.raises(ValueError, match=r"c.jsonl:1: the chat template renders the conversation"):
        datasets(odd, path, counts=(1, 0, 0))


def test_the_generated_corpus_is_long_tailed(chat, corpus):
    train, _, _ = datasets(chat, str(corpus["corpus"]), counts=(1, 0, 0))
    tokens = train.table.columns[:, 3]
    assert np.percentile(tokens, 99) > 4 * np.median(tokens) and tokens.min() < 64


@pytest.mark.parametrize("prompt_format", ["nemotron-h-aligned", "nemotron-nano-v2"])
def test_sft_tokenizer_masks_equal_megatrons_own(corpus, prompt_format):
    """megatron's SFTTokenizer masks the prompt itself (``tokenize_conversation``'s targets):
    the tokens and the assistant tokens found here are the same, assistant prefix included."""
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron_dcp.integration.data.chat import chat_tokenizer

    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=str(corpus["tokenizer"]),
        metadata_path={"library": "sft"},
        prompt_format=prompt_format,
    )
    chat = chat_tokenizer(tokenizer, "SFTTokenizer")
    ids, assistant = chat.tokenize(CONVERSATION)
    tokens, targets = tokenizer.tokenize_conversation(
        CONVERSATION, return_target=True, add_generation_prompt=False
    )
    assert ids.tolist() == tokens.tolist()
    assert assistant.tolist() == (targets != -100).tolist() and assistant.any()
