"""Variable-length datasets: determinism, length specs, item layout, indexed round trip, errors;
mock data's prompt outside the loss (``--varlen-prompt-fraction``) from the datasets to the entry
point's flag, its start-up refusals and ``estimate``."""

from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from megatron_dcp.integration.data.datasets import DEFAULT_DISTRIBUTION, build_varlen_datasets
from megatron_dcp.integration.data.indexed import IndexedDocumentDataset, split_document_ranges
from megatron_dcp.integration.data.mock import (
    VarlenMockDataset,
    lengths_from_file,
    parse_length_distribution,
)
from megatron_dcp.integration.megatron_import import import_megatron_core

MIXTURE = "mixture:0.9*lognormal:median=64,sigma=1.0,max=512|0.1*uniform:min=1K,max=2K"


def mock(spec: str = "uniform:min=1,max=300", n: int = 40, seed: int = 7, **kw):
    return VarlenMockDataset(n, parse_length_distribution(spec), 1000, seed, **kw)


def assert_same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def check_item(item: Dict[str, torch.Tensor], vocab: int = 1000) -> None:
    length = int(item["length"])
    assert item["length"].dtype == torch.int64 and item["length"].dim() == 0
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64)):
        assert item[key].dtype == dtype and item[key].shape == (length,)
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert item["loss_mask"].dtype == torch.float32
    assert torch.equal(item["loss_mask"], torch.ones(length))
    assert 1 <= int(item["tokens"].min()) and int(item["tokens"].max()) < vocab


def test_mock_is_deterministic_in_any_access_order():
    first, second = mock(), mock()
    forward = [first[i] for i in range(len(first))]
    order = np.random.default_rng(0).permutation(len(second))
    shuffled = {int(i): second[int(i)] for i in order}
    for i, item in enumerate(forward):
        assert_same(item, shuffled[i])
        assert_same(item, first[i])  # re-reading is stable too
        check_item(item)


def test_seed_and_split_change_the_data():
    base = mock()
    for other in (mock(seed=8), mock(split="valid")):
        assert any(not torch.equal(base[i]["tokens"][:1], other[i]["tokens"][:1]) for i in range(5))


@pytest.mark.parametrize(
    "spec, low, high",
    [
        (DEFAULT_DISTRIBUTION, 128, 8192),
        ("uniform:min=5,max=9", 5, 9),
        ("constant:value=33", 33, 33),
        (MIXTURE, 1, 2048),
    ],
)
def test_lengths_follow_the_spec(spec: str, low: int, high: int):
    data = mock(spec, n=300)
    lengths = [data.sequence_length(i) for i in range(len(data))]
    assert low <= min(lengths) and max(lengths) <= high
    assert [int(data[i]["length"]) for i in range(3)] == lengths[:3]
    if low < high:
        assert len(set(lengths)) > 1


def test_lognormal_mean_is_the_mean_of_the_unclipped_distribution():
    data = mock("lognormal:mean=200,sigma=0.5", n=4000)
    mean = sum(data.sequence_length(i) for i in range(len(data))) / len(data)
    assert 185 < mean < 215


def test_max_length_truncates():
    data = mock("uniform:min=50,max=100", n=30, max_length=60)
    lengths = [data.sequence_length(i) for i in range(len(data))]
    assert max(lengths) == 60 and min(lengths) >= 50
    assert all(data[i]["tokens"].numel() <= 60 for i in range(len(data)))


def test_lengths_file_cycles_and_ignores_comments(tmp_path: Path):
    path = tmp_path / "lengths.txt"
    path.write_text("# lengths\n3\n\n5  # five\n70\n")
    data = VarlenMockDataset(7, lengths_from_file(str(path)), 50, 0, max_length=64)
    assert [data.sequence_length(i) for i in range(7)] == [3, 5, 64, 3, 5, 64, 3]
    assert [data[i]["tokens"].numel() for i in range(7)] == [3, 5, 64, 3, 5, 64, 3]
    check_item(data[1], vocab=50)


def test_dataloader_collates_to_one_row(tmp_path: Path):
    data = mock(n=6)
    loader = DataLoader(data, batch_size=1, shuffle=False)
    batches = list(loader)
    assert len(batches) == 6
    for i, batch in enumerate(batches):
        length = data.sequence_length(i)
        assert batch["tokens"].shape == (1, length) and batch["labels"].shape == (1, length)
        assert batch["loss_mask"].shape == (1, length) and batch["length"].tolist() == [length]


def test_resume_and_workers_give_the_same_samples():
    data = mock(n=12)
    direct = [data[i] for i in range(12)]
    resumed = DataLoader(data, batch_size=1, sampler=range(5, 12), num_workers=2)
    for i, batch in zip(range(5, 12), resumed):
        assert torch.equal(batch["tokens"][0], direct[i]["tokens"])


def test_datasets_carry_megatrons_split():
    import_megatron_core()
    from megatron.core.datasets.utils import Split

    train, valid, test = build_varlen_datasets(
        seq_length=64, vocab_size=100, seed=1, num_samples=(4, 2, 0)
    )
    assert (train.split, valid.split, test) == (Split.train, Split.valid, None)


# ---------------------------------------------------------------- indexed dataset


def write_indexed(prefix: Path, documents: Sequence[List[int]]) -> str:
    import_megatron_core()
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for document in documents:
        builder.add_document(np.array(document, dtype=np.int32), [len(document)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


DOCUMENTS = [list(range(10, 10 + n)) for n in (5, 1, 12, 2, 30, 7)]  # doc 1 has no label


def test_indexed_round_trip_truncates_and_skips_short_documents(tmp_path: Path):
    prefix = write_indexed(tmp_path / "docs", DOCUMENTS)
    data = IndexedDocumentDataset(prefix, max_length=8, num_samples=11)
    assert [data.document(i) for i in range(11)] == [0, 2, 3, 4, 5] * 2 + [0]
    for i in range(11):
        item, document = data[i], DOCUMENTS[data.document(i)][:9]
        assert item["tokens"].tolist() == document[:-1]
        assert item["labels"].tolist() == document[1:]
        assert int(item["length"]) == data.sequence_length(i) == len(document) - 1
        check_item(item, vocab=100)


def test_indexed_seeded_order_is_a_fresh_permutation_per_pass(tmp_path: Path):
    prefix = write_indexed(tmp_path / "docs", [[1, 2, 3]] * 2 + DOCUMENTS * 3)
    eligible = IndexedDocumentDataset(prefix, 16, 1).documents.tolist()
    data = IndexedDocumentDataset(prefix, 16, 3 * len(eligible), seed=3)
    again = IndexedDocumentDataset(prefix, 16, 3 * len(eligible), seed=3)
    order = [data.document(i) for i in reversed(range(len(data)))][::-1]
    assert order == [again.document(i) for i in range(len(again))]
    passes = [order[k * len(eligible) : (k + 1) * len(eligible)] for k in range(3)]
    assert all(sorted(p) == eligible for p in passes) and passes[0] != passes[1]
    assert_same(data[4], again[4])


def test_build_indexed_splits_documents(tmp_path: Path):
    prefix = write_indexed(tmp_path / "docs", DOCUMENTS * 5)
    assert split_document_ranges("80,20", 30) == ((0, 24), (24, 30), (30, 30))
    train, valid, test = build_varlen_datasets(
        seq_length=16,
        vocab_size=100,
        seed=0,
        num_samples=(50, 10, 0),
        data_path=[prefix],
        split="80,20",
    )
    assert test is None
    assert all(0 <= train.document(i) < 24 for i in range(50))
    assert all(24 <= valid.document(i) < 30 for i in range(10))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec",
    [
        "lognormal:mean=1024",
        "lognormal:mean=1,median=2",
        "gamma:k=1",
        "uniform:min=9,max=3",
        "mixture:0.99*lognormal:median=8+0.01*uniform:min=1,max=2",
    ],
)
def test_bad_distribution_names_the_flag(spec: str):
    if spec == "lognormal:mean=1024":
        assert parse_length_distribution(spec)  # sigma defaults to 1.0
        return
    with pytest.raises(ValueError, match="--varlen-distribution="):
        build_varlen_datasets(
            seq_length=8, vocab_size=10, seed=0, num_samples=(1, 0, 0), distribution=spec
        )


@pytest.mark.parametrize(
    "text, match",
    [
        ("4\nfour\n", "line 2 reads 'four'"),
        ("4\n0\n", "line 2 reads '0'; write one positive integer"),
        ("4\n-5\n", "line 2 reads '-5'; write one positive integer"),
        ("# x\n", "no lengths"),
    ],
)
def test_bad_lengths_file_names_the_flag_and_line(tmp_path: Path, text: str, match: str):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"--varlen-lengths-file=.*{match}"):
        lengths_from_file(str(path))
    with pytest.raises(ValueError, match="--varlen-lengths-file=.*cannot read"):
        lengths_from_file(str(tmp_path / "missing.txt"))


def test_source_errors_name_the_flags(tmp_path: Path):
    common = dict(seq_length=8, vocab_size=10, seed=0, num_samples=(1, 1, 1))
    with pytest.raises(ValueError, match="--varlen-distribution=.* and --data-path="):
        build_varlen_datasets(**common, distribution="uniform:min=1,max=2", data_path="x")
    with pytest.raises(ValueError, match="--data-path='nowhere'.*not found"):
        build_varlen_datasets(**common, data_path="nowhere")
    with pytest.raises(ValueError, match="--data-path=.*blends are not supported"):
        build_varlen_datasets(**common, data_path=["0.5", "a", "0.5", "b"])
    with pytest.raises(ValueError, match="--seq-length=0"):
        build_varlen_datasets(**{**common, "seq_length": 0})
    prefix = write_indexed(tmp_path / "docs", DOCUMENTS)
    with pytest.raises(ValueError, match="--split='100,0,0'.*valid split"):
        build_varlen_datasets(**common, data_path=prefix, split="100,0,0")
    with pytest.raises(ValueError, match="--split='a,b'"):
        build_varlen_datasets(**common, data_path=prefix, split="a,b")
    short = write_indexed(tmp_path / "short", [[1], [2]])
    with pytest.raises(ValueError, match="--data-path=.*no document of 2 or more tokens"):
        build_varlen_datasets(**{**common, "num_samples": (1, 0, 0)}, data_path=short)


TRUNCATION_LOGGER = "megatron_dcp.integration.data.samples"


def test_truncated_indexed_documents_are_logged_once(tmp_path: Path, caplog):
    """DOCUMENTS make samples of 4, 0, 11, 1, 29, 6 tokens: at --seq-length 8, two are longer
    (11 and 29: 3 + 21 tokens dropped)."""
    prefix = write_indexed(tmp_path / "docs", DOCUMENTS)
    with caplog.at_level("WARNING", logger=TRUNCATION_LOGGER):
        for _ in range(2):  # megatron asks again per VPP chunk: one line per source
            build_varlen_datasets(
                seq_length=8, vocab_size=100, seed=0, num_samples=(6, 0, 0), data_path=prefix
            )
    lines = [r.getMessage() for r in caplog.records if r.name == TRUNCATION_LOGGER]
    assert lines == [
        f"--data-path={prefix}: 2 of 6 sequences are longer than --seq-length 8 and are "
        "truncated to it (24 tokens dropped, longest 29)"
    ]


def test_truncated_lengths_file_is_logged_and_a_fitting_one_is_not(tmp_path: Path, caplog):
    path = tmp_path / "lengths.txt"
    path.write_text("5\n100\n8\n9\n")
    fitting = tmp_path / "short.txt"
    fitting.write_text("5\n8\n")
    with caplog.at_level("WARNING", logger=TRUNCATION_LOGGER):
        for lengths_file in (path, fitting):
            build_varlen_datasets(
                seq_length=8,
                vocab_size=100,
                seed=0,
                num_samples=(4, 0, 0),
                lengths_file=str(lengths_file),
            )
    lines = [r.getMessage() for r in caplog.records if r.name == TRUNCATION_LOGGER]
    assert lines == [
        f"--varlen-lengths-file={path}: 2 of 4 sequences are longer than --seq-length 8 and are "
        "truncated to it (93 tokens dropped, longest 100)"
    ]


def test_mock_tokens_follow_a_seeded_markov_chain():
    """About FOLLOW of the transitions go to the token's successor (fixed by the seed, the same
    in every split): structure a model learns, where uniform tokens leave the loss at ln V."""
    from megatron_dcp.integration.data.mock import FOLLOW, VarlenMockDataset

    lengths = parse_length_distribution("uniform:min=200,max=400")
    train = VarlenMockDataset(40, lengths, 128, seed=5)
    valid = VarlenMockDataset(40, lengths, 128, seed=5, split="valid")
    assert (train.successors == valid.successors).all()
    assert not (train.successors == VarlenMockDataset(1, lengths, 128, seed=6).successors).all()
    followed = total = 0
    for i in range(40):
        tokens = torch.cat([train[i]["tokens"], train[i]["labels"][-1:]])
        check_item(train[i], vocab=128)
        followed += int((torch.from_numpy(train.successors)[tokens[:-1]] == tokens[1:]).sum())
        total += len(tokens) - 1
    assert abs(followed / total - (FOLLOW + (1 - FOLLOW) / 127)) < 0.02


# ---------------------------------------------------------------- --varlen-prompt-fraction

# blake2b digests of build_varlen_datasets' samples below, recorded before --varlen-prompt-fraction
# existed: the flag's default must leave the samples exactly as they were.
OLD_DIGESTS = ("86195a7adff9be10be8cd1881e47031e", "768991e3833d063fd462298ea7bb7a5e")
OLD_SAMPLES = dict(
    seq_length=200,
    vocab_size=128,
    seed=3,
    num_samples=(20, 5, 0),
    distribution="uniform:min=1,max=300",
)


def digest(data, count: int) -> str:
    """One digest of every byte (and dtype and shape) of the first ``count`` samples."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for i in range(count):
        item = data[i]
        for key in ("tokens", "labels", "loss_mask", "length"):
            tensor = item[key]
            h.update(key.encode())
            h.update(str(tensor.dtype).encode())
            h.update(str(tuple(tensor.shape)).encode())
            h.update(tensor.numpy().tobytes())
    return h.hexdigest()


def expected_prompt(length: int, fraction: float) -> int:
    """floor(F × L) on F as written (exact decimal arithmetic)."""
    from decimal import Decimal

    return int(Decimal(repr(fraction)) * length)


def assert_prompt_mask(item: Dict[str, torch.Tensor], prompt: int) -> None:
    """``loss_mask`` is ``prompt`` zeros, then ones (at least one), nothing else."""
    length = int(item["length"])
    assert item["loss_mask"].dtype == torch.float32 and item["loss_mask"].shape == (length,)
    expected = torch.cat([torch.zeros(prompt), torch.ones(length - prompt)])
    assert torch.equal(item["loss_mask"], expected), (length, prompt)
    assert float(item["loss_mask"].sum()) >= 1


def test_prompt_fraction_0_gives_the_old_samples_bit_for_bit():
    """The default, and 0 given explicitly, reproduce the samples recorded before the flag."""
    for extra in ({}, {"prompt_fraction": 0.0}):
        train, valid, _ = build_varlen_datasets(**OLD_SAMPLES, **extra)
        assert (digest(train, 20), digest(valid, 5)) == OLD_DIGESTS
    masked, _, _ = build_varlen_datasets(**OLD_SAMPLES, prompt_fraction=0.5)
    assert digest(masked, 20) != OLD_DIGESTS[0]  # the digest sees the mask


@pytest.mark.parametrize(
    "fraction, prompts",
    [
        (0.3, [3, 30, 0, 1, 38, 0]),  # floor(0.3 × 10) is 3, as written
        (0.29, [2, 29, 0, 1, 37, 0]),  # 0.29 × 100 is 28.999… in float arithmetic: still 29
        (0.5, [5, 50, 0, 2, 64, 1]),
        (0.999, [9, 99, 0, 3, 127, 1]),  # floor(1.998) is 1: one label stays in the loss
    ],
)
def test_the_first_floor_f_l_labels_are_outside_the_loss(tmp_path: Path, fraction, prompts):
    """Through --varlen-lengths-file (lengths 10, 100, 1, 4, 128 (truncated from 200) and 2): the
    mask has exactly floor(F × L) leading zeros, and at least one label in the loss."""
    path = tmp_path / "lengths.txt"
    path.write_text("10\n100\n1\n4\n200\n2\n")
    train, valid, _ = build_varlen_datasets(
        seq_length=128,
        vocab_size=50,
        seed=1,
        num_samples=(6, 6, 0),
        lengths_file=str(path),
        prompt_fraction=fraction,
    )
    for data in (train, valid):
        assert [data.sequence_length(i) for i in range(6)] == [10, 100, 1, 4, 128, 2]
        for i in range(6):
            assert_prompt_mask(data[i], prompts[i])


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9, 0.99])
def test_prompt_fraction_changes_only_the_loss_mask(tmp_path: Path, fraction: float):
    """Tokens, labels and lengths of every split are those of F = 0, from a distribution and from
    a lengths file; only the mask differs."""
    path = tmp_path / "lengths.txt"
    path.write_text("1\n2\n33\n300\n")
    for source in ({"distribution": "uniform:min=1,max=300"}, {"lengths_file": str(path)}):
        common = dict(seq_length=256, vocab_size=100, seed=4, num_samples=(12, 4, 3), **source)
        plain = build_varlen_datasets(**common)
        masked = build_varlen_datasets(**common, prompt_fraction=fraction)
        for before, after in zip(plain, masked):
            for i in range(len(before)):
                old, new = before[i], after[i]
                assert old.keys() == new.keys()
                for key in ("tokens", "labels", "length"):
                    assert torch.equal(old[key], new[key]) and old[key].dtype == new[key].dtype
                length = int(new["length"])
                assert_prompt_mask(new, expected_prompt(length, fraction))
                check_item({**new, "loss_mask": torch.ones(length)}, vocab=100)


@st.composite
def lengths_and_fractions(draw):
    """(L, F): any L and float F in [0, 1), or F = k/d as a user writes it with L a multiple of d,
    where F × L is an integer that float arithmetic often misses (0.29 × 100 = 28.999…)."""
    if draw(st.booleans()):
        return draw(st.integers(1, 3000)), draw(st.floats(0.0, 1.0, exclude_max=True))
    scale = draw(st.sampled_from([10, 100, 1000]))
    return scale * draw(st.integers(1, 3)), draw(st.integers(0, scale - 1)) / scale


@settings(max_examples=max(1, 300 * settings().max_examples // 100), deadline=None)
@given(case=lengths_and_fractions(), seed=st.integers(0, 2**32))
@example(case=(100, 0.29), seed=0)  # float arithmetic: 28.999…
@example(case=(300, 0.57), seed=0)  # 170.99999999999997
@example(case=(1, 0.9999999999999999), seed=0)  # the largest F: the one label stays
def test_property_the_mask_is_a_floor_f_l_prompt_then_the_loss(case, seed):
    """For any L ≥ 1 and F in [0, 1): P leading zeros then ones, P ≤ F·L < P + 1 (exactly, on F
    as written), at least one label in the loss, and tokens and labels as at F = 0."""
    from decimal import Decimal

    from megatron_dcp.integration.data.mock import FileLengths

    length, fraction = case
    lengths = FileLengths((length,), "hypothesis")
    item = VarlenMockDataset(1, lengths, 64, seed, prompt_fraction=fraction)[0]
    plain = VarlenMockDataset(1, lengths, 64, seed)[0]
    mask = item["loss_mask"]
    prompt = int((mask == 0).sum())
    assert torch.equal(mask, torch.cat([torch.zeros(prompt), torch.ones(length - prompt)]))
    exact = Decimal(repr(fraction)) * length
    assert 1 <= length - prompt and prompt <= exact < prompt + 1
    assert torch.equal(item["tokens"], plain["tokens"])
    assert torch.equal(item["labels"], plain["labels"])


@pytest.mark.parametrize(
    "fraction, shown",
    [(-0.1, "-0.1"), (1.0, "1.0"), (1.5, "1.5"), (float("nan"), "nan"), (float("inf"), "inf")],
)
def test_a_prompt_fraction_outside_0_1_is_refused(fraction: float, shown: str):
    with pytest.raises(ValueError) as error:
        build_varlen_datasets(
            seq_length=8, vocab_size=10, seed=0, num_samples=(1, 0, 0), prompt_fraction=fraction
        )
    message = str(error.value)
    assert message.startswith(f"--varlen-prompt-fraction={shown}: ")
    assert "at least 0 and below 1" in message and "e.g. 0.3" in message


def test_a_prompt_fraction_with_real_data_is_refused(tmp_path: Path):
    """--data-path and --sft-data keep their own masks: a non-zero F would be ignored silently;
    F = 0 (the default) is no request and passes."""
    prefix = write_indexed(tmp_path / "docs", DOCUMENTS)
    common = dict(seq_length=8, vocab_size=100, seed=0, num_samples=(2, 0, 0))
    real = (({"data_path": prefix}, "--data-path"), ({"sft_data": "c.jsonl"}, "--sft-data"))
    for source, flag in real:
        with pytest.raises(ValueError) as error:
            build_varlen_datasets(**common, **source, prompt_fraction=0.3)
        assert str(error.value).startswith(
            f"--varlen-prompt-fraction=0.3 applies to mock data only, not to {flag} "
        )
        assert "remove --varlen-prompt-fraction" in str(error.value)
    train, _, _ = build_varlen_datasets(**common, data_path=prefix, prompt_fraction=0.0)
    check_item(train[0], vocab=100)


# ---------------------------------------------------------------- the flag in the entry point


@pytest.fixture(scope="module")
def pretrain_gpt():
    if not import_megatron_core():
        pytest.skip("megatron-core not installed")
    from megatron_dcp import pretrain_gpt

    return pretrain_gpt


@pytest.fixture
def megatron_globals_reset():
    """megatron's start-up sets its global arguments once per process: unset after each run."""
    yield
    from megatron.training.global_vars import unset_global_variables

    unset_global_variables()


def parsed(pretrain_gpt, *flags: str):
    from argparse import ArgumentParser

    from megatron.training.arguments import add_megatron_arguments

    parser = pretrain_gpt.extra_args(["--dynamic-context-parallel", *flags])(
        add_megatron_arguments(ArgumentParser(allow_abbrev=False))
    )
    return parser.parse_args()


def test_the_flag_parses_as_a_float_with_default_0(pretrain_gpt):
    assert parsed(pretrain_gpt).varlen_prompt_fraction == 0.0
    assert parsed(pretrain_gpt, "--varlen-prompt-fraction", "0.25").varlen_prompt_fraction == 0.25


@pytest.mark.parametrize(
    "flags, start",
    [
        (["--varlen-prompt-fraction", "1"], "--varlen-prompt-fraction=1.0: the share"),
        (["--varlen-prompt-fraction", "-0.5"], "--varlen-prompt-fraction=-0.5: the share"),
        (
            ["--varlen-prompt-fraction", "0.2", "--sft-data", "chats.jsonl"],
            "--varlen-prompt-fraction=0.2 applies to mock data only, not to --sft-data",
        ),
        (
            ["--varlen-prompt-fraction", "0.2", "--data-path", "docs"],
            "--varlen-prompt-fraction=0.2 applies to mock data only, not to --data-path",
        ),
    ],
)
def test_the_entry_point_refuses_a_bad_fraction_at_start_up(
    pretrain_gpt, megatron_globals_reset, capsys, flags, start
):
    """Before megatron builds anything: a start-up refusal, its line the last printed, exit 2
    (with --sft-data ahead of the tokenizer's own refusal)."""
    tiny = ["--dynamic-context-parallel", "--max-seqlen-per-dp-cp-rank", "128", "--num-layers",
            "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size",
            "2", "--train-iters", "1", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.start(
            [*tiny, *flags], pretrain_gpt.check_args, pretrain_gpt.gpt_config_from_args
        )
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith(f"error: {start}"), lines[-3:]


def test_the_dataset_provider_passes_the_fraction(pretrain_gpt, monkeypatch):
    """entry.datasets_provider hands megatron's --varlen-prompt-fraction to the mock datasets."""
    from argparse import Namespace

    from megatron_dcp.integration.training import entry

    args = Namespace(seq_length=64, padded_vocab_size=128, vocab_size=128, seed=2,
                     varlen_distribution="constant:value=40", varlen_lengths_file=None,
                     data_path=None, split=None, sft_data=None, tokenizer_type="NullTokenizer",
                     sft_loss_on_prompt=False, sft_skip_invalid=False,
                     varlen_prompt_fraction=0.25)  # fmt: skip
    monkeypatch.setattr(entry, "get_args", lambda: args)
    train, _, _ = entry.datasets_provider([3, 0, 0])
    for i in range(3):
        assert_prompt_mask(train[i], 10)


def test_estimate_reads_the_same_lengths_and_notes_the_flag_it_does_not_read(tmp_path: Path):
    """megatron-dcp estimate plans lengths only: given training's flags with
    --varlen-prompt-fraction it plans the same lengths and says it did not read the flag."""
    import json

    from megatron_dcp.tools.cli.estimate import estimate

    flags = ["--cost-model", "cpu", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", "512",
             "--vocab-size", "1024", "--max-seqlen-per-dp-cp-rank", "256",
             "--global-batch-size", "8", "--batches", "2",
             "--varlen-distribution", "uniform:min=16,max=600"]  # fmt: skip
    results = []
    for extra in ([], ["--varlen-prompt-fraction", "0.3"]):
        out = tmp_path / f"estimate{len(extra)}.json"
        assert estimate([*flags, *extra, "--json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    plain, masked = results
    assert plain["lengths"] == masked["lengths"] and plain["speedups"] == masked["speedups"]
    assert "flags estimate does not read: --varlen-prompt-fraction" in masked["notes"]
