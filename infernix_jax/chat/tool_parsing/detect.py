"""Choosing the tool-call format a model was trained on, from its chat template."""

from __future__ import annotations

from infernix_jax.chat.tool_parsing.blocks import HERMES, QWEN3_CODER


def detect_tool_parser(chat_template_text: str) -> str:
    """ "qwen3_coder" or "hermes", read from the chat template's own tool instructions.

    Qwen3-Coder / Qwen3.5 templates teach the XML form and so contain `<function=`; Qwen3 and
    Qwen3-Next-Instruct templates teach `<tool_call>` with a JSON `"arguments"` object.
    Raises ValueError for a template that teaches neither (the server then needs
    `--tool-call-parser`).
    """
    if "<function=" in chat_template_text:
        return QWEN3_CODER
    if "<tool_call>" in chat_template_text and "arguments" in chat_template_text:
        return HERMES
    raise ValueError(
        "the chat template shows no known tool-call format (neither `<function=` nor "
        "`<tool_call>` with JSON arguments); choose one with --tool-call-parser"
    )
