"""A model's tokenizer: HF ``tokenizers`` for tokenizer.json plus what tokenizer_config.json adds.

A Hugging Face model folder describes its tokenizer in several files, and transformers combines them:

* ``tokenizer.json``: the full tokenizer (normaliser, pre-tokeniser, BPE model, added tokens, decoder);
* ``tokenizer_config.json``: which added tokens are *special* (``eos_token``, ``pad_token``,
  ``additional_special_tokens``, ``added_tokens_decoder``), decode clean-up, and often the chat template;
* ``chat_template.jinja`` / ``additional_chat_templates/*.jinja`` (newer) or ``chat_template.json``
  (older processors): the chat template, when it is not in the config;
* ``generation_config.json``: the ids that end generation (``eos_token_id``, an int or a list).

:class:`Tokenizer` reads them the same way, so that ``encode`` and ``decode`` agree with transformers'
fast tokenizer and the chat template sees the same special-token variables.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers

from infernix_jax.chat.template import ChatTemplate

# tokenizer_config.json fields naming one special token each; they are also chat-template variables.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Tokens that end a turn in ChatML-style models, added to the stop ids whenever the vocabulary has them.
CHATML_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _token_content(value: Any) -> str | None:
    """A special token from a config: a string, a serialised AddedToken ``{"content": ...}``, or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: pathlib.Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop the space before punctuation and contractions."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


def read_chat_templates(model_dir: pathlib.Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The model's chat templates by name (``"default"`` for the main one), as transformers finds them.

    Template files (``chat_template.jinja`` and ``additional_chat_templates/*.jinja``) take priority
    over ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}``),
    which takes priority over a processor's ``chat_template.json``.
    """
    templates: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    source: Any = tokenizer_config.get("chat_template")
    json_file = model_dir / "chat_template.json"
    if source is None and json_file.is_file():
        source = _read_json(json_file).get("chat_template")
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list):
        return {entry["name"]: entry["template"] for entry in source}
    return {}


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat templates.

    Build it with :meth:`from_dir`. ``vocab_size`` counts added tokens too (it is the number of ids
    the tokenizer can produce, usually less than the model's embedding rows).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        generation_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.config = dict(tokenizer_config or {})
        self._register_config_special_tokens()
        self.special_tokens: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(self.config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.clean_up_tokenization_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
        self.model_max_length: int | None = self.config.get("model_max_length")
        self.chat_templates = dict(chat_templates or {})
        self._compiled_templates: dict[str, ChatTemplate] = {}
        self.eos_token_ids = self._collect_eos_ids(generation_eos_token_ids)

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and, when present, the chat template files and
        generation_config.json from a model folder."""
        model_dir = pathlib.Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config_file = model_dir / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        generation_eos: list[int] = []
        generation_file = model_dir / "generation_config.json"
        if generation_file.is_file():
            eos = _read_json(generation_file).get("eos_token_id")
            generation_eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(backend, config, read_chat_templates(model_dir, config), generation_eos)

    # --- special tokens -------------------------------------------------------------------------

    def _register_config_special_tokens(self) -> None:
        """Make the backend treat every token the config calls special as special (and known).

        tokenizer.json usually agrees with tokenizer_config.json already; when the config names a
        special token the backend lacks or holds as an ordinary added token, transformers adds or
        re-flags it, and so do we, so that ``skip_special_tokens`` skips the same tokens.
        """
        wanted: list[str] = []
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(self.config.get(name))
            if content is not None:
                wanted.append(content)
        extra = self.config.get("additional_special_tokens") or self.config.get("extra_special_tokens") or []
        if isinstance(extra, Mapping):
            extra = list(extra.values())
        wanted.extend(content for content in map(_token_content, extra) if content is not None)
        decoder = self.config.get("added_tokens_decoder") or {}
        for entry in decoder.values():
            if entry.get("special") and isinstance(entry.get("content"), str):
                wanted.append(entry["content"])
        already_special = {
            token.content for token in self.backend.get_added_tokens_decoder().values() if token.special
        }
        missing = [content for content in dict.fromkeys(wanted) if content not in already_special]
        if missing:
            self.backend.add_special_tokens(
                [tokenizers.AddedToken(content, special=True) for content in missing]
            )

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    def _collect_eos_ids(self, generation_eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        ids: list[int | None] = [self._special_id("eos_token"), *generation_eos_token_ids]
        ids.extend(self.backend.token_to_id(token) for token in CHATML_STOP_TOKENS)
        return tuple(dict.fromkeys(token_id for token_id in ids if token_id is not None))

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens: the ones ``decode(..., skip_special_tokens=True)`` drops."""
        return frozenset(
            token_id for token_id, token in self.backend.get_added_tokens_decoder().items() if token.special
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (in the vocabulary's own spelling, e.g. ``"Ġthe"``), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id, or None for an id the tokenizer does not have."""
        return self.backend.id_to_token(token_id)

    # --- text -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids.

        ``add_special_tokens`` applies tokenizer.json's post-processor (e.g. a BOS); chat prompts
        are encoded without it, as transformers' ``apply_chat_template`` does.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """Text of ``ids``. Incomplete UTF-8 at the end becomes U+FFFD; ids outside the vocabulary
        are ignored. Clean-up defaults to the config's ``clean_up_tokenization_spaces``."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    # --- chat -----------------------------------------------------------------------------------

    def get_chat_template(self, name: str | None = None, has_tools: bool = False) -> ChatTemplate | None:
        """The compiled chat template ``name``, or the one transformers would pick (``tool_use`` when
        tools are given and the model has it, else ``default``); None when the model has none."""
        if not self.chat_templates:
            if name is not None:
                raise ValueError(f"no chat template named {name!r}: this tokenizer has none")
            return None
        if name is None:
            name = "tool_use" if has_tools and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            raise ValueError(f"no chat template named {name!r}; have {sorted(self.chat_templates)}")
        if name not in self._compiled_templates:
            self._compiled_templates[name] = ChatTemplate(self.chat_templates[name], self.special_tokens)
        return self._compiled_templates[name]

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The default chat template, or None when the model folder has none."""
        if "default" not in self.chat_templates:
            return None
        return self.get_chat_template("default")

    def encode_chat(
        self,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render a conversation with the model's chat template and encode it (no added BOS/EOS)."""
        template = self.get_chat_template(has_tools=tools is not None)
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        text = template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text)
