"""Qwen's added tokens, in Qwen's order, for the demo tokenizer.

The demo tokenizer appends these after its byte-level BPE vocabulary, exactly as Qwen3 appends them
after its own (ids 151643... there, ``BPE_VOCAB_SIZE``... here), so that chat templates, tool-call and
reasoning parsers written for Qwen work on the demo model unchanged. ``special`` follows Qwen3's
``tokenizer_config.json``: the ChatML and vision markers are special (dropped by
``decode(skip_special_tokens=True)``), the tool, FIM and think markers are not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AddedTokenSpec:
    """One added token: its text and whether Qwen marks it special."""

    content: str
    special: bool


QWEN_ADDED_TOKENS: tuple[AddedTokenSpec, ...] = (
    AddedTokenSpec("<|endoftext|>", True),
    AddedTokenSpec("<|im_start|>", True),
    AddedTokenSpec("<|im_end|>", True),
    AddedTokenSpec("<|object_ref_start|>", True),
    AddedTokenSpec("<|object_ref_end|>", True),
    AddedTokenSpec("<|box_start|>", True),
    AddedTokenSpec("<|box_end|>", True),
    AddedTokenSpec("<|quad_start|>", True),
    AddedTokenSpec("<|quad_end|>", True),
    AddedTokenSpec("<|vision_start|>", True),
    AddedTokenSpec("<|vision_end|>", True),
    AddedTokenSpec("<|vision_pad|>", True),
    AddedTokenSpec("<|image_pad|>", True),
    AddedTokenSpec("<|video_pad|>", True),
    AddedTokenSpec("<tool_call>", False),
    AddedTokenSpec("</tool_call>", False),
    AddedTokenSpec("<|fim_prefix|>", False),
    AddedTokenSpec("<|fim_middle|>", False),
    AddedTokenSpec("<|fim_suffix|>", False),
    AddedTokenSpec("<|fim_pad|>", False),
    AddedTokenSpec("<|repo_name|>", False),
    AddedTokenSpec("<|file_sep|>", False),
    AddedTokenSpec("<tool_response>", False),
    AddedTokenSpec("</tool_response>", False),
    AddedTokenSpec("<think>", False),
    AddedTokenSpec("</think>", False),
)

ENDOFTEXT = "<|endoftext|>"  # document separator and pad token
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn; the eos token of the chat model

VOCAB_SIZE = 16384  # total, added tokens included: a multiple of 128 for tidy embedding shards
BPE_VOCAB_SIZE = VOCAB_SIZE - len(QWEN_ADDED_TOKENS)  # learned byte-level BPE entries, ids 0..16357


def added_token_id(content: str, bpe_vocab_size: int = BPE_VOCAB_SIZE) -> int:
    """The id an added token gets after a BPE vocabulary of ``bpe_vocab_size`` (the demo's by default)."""
    for index, spec in enumerate(QWEN_ADDED_TOKENS):
        if spec.content == content:
            return bpe_vocab_size + index
    raise KeyError(f"{content!r} is not one of Qwen's added tokens")


def contains_added_token(text: str) -> bool:
    """Whether ``text`` holds an added token's literal text (it would tokenize as the marker)."""
    return any(spec.content in text for spec in QWEN_ADDED_TOKENS)
