"""``megatron-dcp sft-corpus``: a generated conversation corpus and a tokenizer trained on it,
for the SFT quick-start and tests (nothing is downloaded, nothing large enters the repository).

    megatron-dcp sft-corpus --out DIR [--conversations 2000] [--seed 0]

writes ``DIR/conversations.jsonl`` (megatron's ``{"messages": [...]}`` records) and
``DIR/tokenizer/`` (a byte-level BPE saved as a HuggingFace fast tokenizer with a ChatML chat
template), usable as ``--sft-data DIR/conversations.jsonl --tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR/tokenizer``, and prints those flags and a short DCP training command on 2
CPU ranks that runs as printed (:func:`training_command`).

The text is learnable: words follow a seeded Markov chain (each word's successor with
probability 0.8), and an answer continues the chain from the question's last word. Lengths are
long-tailed like real chat data: 1 to 6 user turns, message lengths log-normal (median 12
words, σ 1.1, at most 600), so a few conversations run to thousands of tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np

WORDS = 400  # distinct words
FOLLOW = 0.8  # probability that a word is followed by its successor
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "zo", "pe", "su", "da", "fi")
SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer briefly.", "Continue the words.")


def vocabulary() -> List[str]:
    """The corpus's words: two or three syllables each, fixed."""
    words = [a + b for a in SYLLABLES for b in SYLLABLES]
    words += [a + b + c for a in SYLLABLES[:3] for b in SYLLABLES for c in SYLLABLES]
    return words[:WORDS]


class WordChain:
    """Words from a seeded Markov chain over :func:`vocabulary`."""

    def __init__(self, seed: int) -> None:
        self.words = vocabulary()
        self.rng = np.random.default_rng(seed)
        self.successor = np.random.default_rng(seed + 1).permutation(len(self.words))

    def text(self, count: int, after: int) -> tuple:
        """``count`` words continuing the chain after word ``after``; (text, last word)."""
        indices, word = [], after
        for _ in range(count):
            follow = self.rng.random() < FOLLOW
            word = int(self.successor[word]) if follow else int(self.rng.integers(len(self.words)))
            indices.append(word)
        return " ".join(self.words[i] for i in indices), word

    def length(self) -> int:
        return int(min(600, max(1, round(self.rng.lognormal(np.log(12), 1.1)))))


def conversations(count: int, seed: int) -> Iterator[Dict[str, List[Dict[str, str]]]]:
    """``count`` records: an optional system prompt, then user/assistant turns."""
    chain = WordChain(seed)
    for _ in range(count):
        messages = []
        if chain.rng.random() < 0.5:
            prompt = SYSTEM_PROMPTS[int(chain.rng.integers(len(SYSTEM_PROMPTS)))]
            messages.append({"role": "system", "content": prompt})
        word = int(chain.rng.integers(WORDS))
        for _ in range(1 + int(chain.rng.geometric(0.5) - 1) % 6):
            question, word = chain.text(chain.length(), word)
            answer, word = chain.text(chain.length(), word)
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        yield {"messages": messages}


def write_corpus(path: Path, count: int, seed: int) -> Path:
    """Write ``count`` records to ``path`` as JSONL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for record in conversations(count, seed):
            handle.write(json.dumps(record) + "\n")
    return path


def write_tokenizer(directory: Path, corpus: Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on ``corpus``'s text and save it as a HuggingFace fast tokenizer
    with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(_message_texts(corpus), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<|pad|>", eos_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(directory))
    return directory


def _message_texts(corpus: Path) -> Iterator[str]:
    with open(corpus, encoding="utf-8") as handle:
        for line in handle:
            for message in json.loads(line)["messages"]:
                yield f"{message['role']}\n{message['content']}"


def write_sft_corpus(out: Path, count: int = 2000, seed: int = 0) -> Dict[str, Path]:
    """The corpus and its tokenizer under ``out``; returns their paths."""
    corpus = write_corpus(out / "conversations.jsonl", count, seed)
    return {"corpus": corpus, "tokenizer": write_tokenizer(out / "tokenizer", corpus)}


# The tiny model of the training command ``sft-corpus`` prints: DCP over 2 CPU ranks (CP2), a
# few iterations, so that the printed line runs as printed in about a minute.
TRAINING_RANKS = 2
TRAINING_FLAGS: Tuple[Tuple[str, ...], ...] = (
    ("--dynamic-context-parallel",),
    ("--context-parallel-size", "2"),
    ("--max-seqlen-per-dp-cp-rank", "256"),
    ("--seq-length", "512"),
    ("--max-position-embeddings", "512"),
    ("--num-layers", "2"),
    ("--hidden-size", "32"),
    ("--num-attention-heads", "4"),
    ("--micro-batch-size", "1"),
    ("--global-batch-size", "8"),
    ("--train-iters", "4"),
    ("--lr", "1e-2"),
    ("--eval-iters", "0"),
    ("--eval-interval", "1000"),
    ("--log-interval", "1"),
)


def data_flags(paths: Dict[str, Path]) -> List[str]:
    """The flags that train on the corpus with its tokenizer."""
    return [
        "--sft-data",
        str(Path(paths["corpus"]).resolve()),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(Path(paths["tokenizer"]).resolve()),
    ]


def training_command(paths: Dict[str, Path]) -> List[str]:
    """A short DCP training run on the corpus: torchrun (this Python's) on 2 CPU ranks running
    ``megatron_dcp.pretrain_gpt`` with a tiny model."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)]
    if not torchrun.exists():
        launcher = [sys.executable, "-m", "torch.distributed.run"]
    model = [part for flag in TRAINING_FLAGS for part in flag]
    return [
        *launcher,
        f"--nproc-per-node={TRAINING_RANKS}",
        "--standalone",
        "-m",
        "megatron_dcp.pretrain_gpt",
        *model,
        *data_flags(paths),
    ]
