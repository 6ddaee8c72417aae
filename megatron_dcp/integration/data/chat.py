"""Conversations to tokens with the model's chat template, and which tokens the assistant wrote.

:class:`ChatTokenizer` wraps a HuggingFace fast tokenizer and a Jinja chat template, taken from
megatron's tokenizer (``--tokenizer-type HuggingFaceTokenizer`` or ``SFTTokenizer``, see
:func:`chat_tokenizer`). :meth:`ChatTokenizer.tokenize` renders a conversation once and marks the
assistant's tokens without any knowledge of the template's markup:

* the text of assistant turn k ends where the rendering of the first k+1 messages ends, and
  starts where the rendering of the first k messages *with the generation prompt* ends (the
  prompt, e.g. ``<|im_start|>assistant\\n``, belongs to the prompt, not to the answer);
* the whole conversation is tokenized once with character offsets, and a token is the
  assistant's when it starts inside one of those spans. End-of-turn markers the template puts
  after the answer (``<|im_end|>``) are therefore the assistant's: the model learns to stop.

This needs a template whose rendering of a conversation's first messages is a prefix of the
whole rendering (true of ordinary chat templates); one that rewrites earlier turns is refused
with the conversation's position. megatron's SFTTokenizer prompt formats put the assistant
prefix inside the assistant turn; ``assistant_prefix_len`` tokens at the start of each answer
are then taken out of it, as megatron's own masking does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import numpy as np

from megatron_dcp.integration.data.conversations import SFT_DATA_FLAG, Conversation

CHAT_TOKENIZERS = ("HuggingFaceTokenizer", "SFTTokenizer")


@dataclass(frozen=True)
class ChatTokenizer:
    """A fast HuggingFace tokenizer, the chat template it renders with, and how many tokens of an
    assistant turn are its role prefix (masked like the prompt)."""

    tokenizer: Any
    template: str
    assistant_prefix_len: int = 0

    def render(self, messages: Conversation, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def tokenize(self, conversation: Conversation) -> Tuple[np.ndarray, np.ndarray]:
        """``(ids, assistant)``: the token ids of the rendered conversation (int64) and whether
        each token is the assistant's (bool). ValueError when the template is not prefix-stable."""
        text = self.render(conversation)
        spans = self.assistant_spans(conversation, text)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int64)
        starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
        assistant = np.zeros(ids.size, dtype=bool)
        for begin, end in spans:
            inside = np.flatnonzero((starts >= begin) & (starts < end))
            assistant[inside[self.assistant_prefix_len :]] = True
        return ids, assistant

    def assistant_spans(self, conversation: Conversation, text: str) -> List[Tuple[int, int]]:
        """Character ``[begin, end)`` of each assistant turn in ``text``, the full rendering."""
        spans = []
        for turn, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            prompt = self.render(conversation[:turn], generation_prompt=True) if turn else ""
            answered = self.render(conversation[: turn + 1])
            if not (text.startswith(prompt) and text.startswith(answered)):
                raise ValueError(
                    f"the chat template renders the conversation up to message {turn + 1} "
                    "differently from the start of the whole conversation, so the assistant's "
                    "tokens cannot be located; use a template that only appends turns "
                    "(--chat-template)"
                )
            spans.append((len(prompt), len(answered)))
        return spans


def chat_tokenizer(tokenizer: Any, tokenizer_type: str) -> ChatTokenizer:
    """The :class:`ChatTokenizer` of megatron's built tokenizer (``get_tokenizer()``).

    ``HuggingFaceTokenizer``: its AutoTokenizer and its chat template (``--chat-template``
    overrides the one saved with the tokenizer). ``SFTTokenizer``: its AutoTokenizer with the
    template and assistant prefix of ``--sft-tokenizer-prompt-format``."""
    check_tokenizer_type(tokenizer_type)
    library = tokenizer._tokenizer  # megatron's library wrapper (HuggingFace or SFT)
    if tokenizer_type == "SFTTokenizer":
        prompt = library._prompt_config
        return checked(library._tokenizer, prompt.custom_chat_template, prompt.assistant_prefix_len)
    return checked(library.tokenizer, tokenizer.chat_template)


def check_tokenizer_type(tokenizer_type: str) -> None:
    """ValueError unless ``--tokenizer-type`` names a tokenizer with a chat template."""
    if tokenizer_type not in CHAT_TOKENIZERS:
        raise ValueError(
            f"{SFT_DATA_FLAG} needs a tokenizer with a chat template, not --tokenizer-type="
            f"{tokenizer_type}; pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR "
            "(a saved HuggingFace tokenizer) or --tokenizer-type SFTTokenizer."
        )


def checked(hf_tokenizer: Any, template: Any, assistant_prefix_len: int = 0) -> ChatTokenizer:
    """A :class:`ChatTokenizer`, refusing a slow tokenizer or a missing template."""
    if not getattr(hf_tokenizer, "is_fast", False):
        raise ValueError(
            f"{SFT_DATA_FLAG} needs a fast HuggingFace tokenizer (tokenizer.json) to map tokens "
            "to characters; drop --tokenizer-hf-no-use-fast or convert the tokenizer."
        )
    if not template:
        raise ValueError(
            f"{SFT_DATA_FLAG}: the tokenizer has no chat template; save one with it "
            "(tokenizer.chat_template) or pass --chat-template."
        )
    return ChatTokenizer(hf_tokenizer, str(template), int(assistant_prefix_len))


def chat_tokenizer_from_dir(path: str, template: Any = None) -> ChatTokenizer:
    """The :class:`ChatTokenizer` of a saved HuggingFace tokenizer directory, as megatron's
    ``HuggingFaceTokenizer`` loads it (tools and tests that run without megatron's globals)."""
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    return checked(hf_tokenizer, template or hf_tokenizer.chat_template)
