"""Chat: the tokenizer, the chat template and the streaming detokenizer."""

from infernix_jax.chat.detokenizer import IncrementalDetokenizer
from infernix_jax.chat.template import ChatTemplate, ChatTemplateError
from infernix_jax.chat.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
