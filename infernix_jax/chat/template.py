"""Chat templates rendered exactly as Hugging Face transformers renders them.

A model's chat template is a Jinja2 program shipped with its tokenizer. Rendering it the same way
transformers' ``apply_chat_template`` does matters: the model was trained on that exact text, and a
stray newline or a differently serialised tool schema costs accuracy and prefix-cache hits.

What transformers does, and this module mirrors (see docs/chat_template.md):

* an ``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
  extension and a ``{% generation %}`` block tag;
* a ``tojson`` filter that is plain ``json.dumps`` (``ensure_ascii=False``, no HTML escaping) with
  ``indent``, ``separators`` and ``sort_keys`` options; ``raise_exception``, ``strftime_now``, a
  restricted ``dict`` and a ``namespace`` that refuses underscore attributes as globals;
* the messages are normalised first: keys whose value is ``None`` are dropped, objects become plain
  dicts, and a message's reasoning given as ``thinking`` or ``reasoning`` is aliased to
  ``reasoning_content`` (and ``thinking``);
* the tokenizer's special tokens (``eos_token``, ``bos_token``, ...) are template variables, and
  ``documents`` is always defined (``None`` unless given).

One deliberate, switchable difference: assistant tool-call ``arguments`` given as a JSON string (as
the OpenAI API sends them) are parsed into a dict before rendering, because templates are written for
dict arguments (Qwen3's serialises them with ``tojson``; Qwen3.5's iterates ``arguments|items``).
Pass ``parse_tool_arguments=False`` to hand strings through untouched, as transformers does.
And where transformers would fail because it dropped a ``content=None`` that a template reads, the
conversation is rendered again with ``""`` for those contents.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may be given under; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the message being continued so that its end can be found in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (including the template's own ``raise_exception``)."""


class _GenerationBlock(jinja2.ext.Extension):
    """Parses ``{% generation %}...{% endgeneration %}`` and renders its body unchanged.

    transformers uses the tag to find assistant spans for training masks; for inference only the
    text matters, but templates containing the tag must still compile.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: ``json.dumps`` without Jinja's HTML escaping, non-ASCII kept as is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """The ``dict`` global: builds plain dicts without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The ``namespace`` global, refusing underscore-prefixed attribute names as transformers does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named ``self``, as in Jinja's Namespace, so that ``namespace(self=...)`` still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def make_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja2 environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain_data(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON-like types, so the sandbox only ever sees data.

    Dataclasses and pydantic models become dicts, str/int/float subclasses (enums, numpy scalars)
    their base types, and any other object an inert ``"<TypeName>"`` placeholder (transformers' rule).
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain_data(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_data(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain_data(value.item())
    return f"<{type(value).__name__}>"


def _as_message_dict(message: Any, none_content_as_empty: bool = False) -> dict:
    """One message as a dict, without its ``None``-valued keys (APIs send ``content=None``).

    With ``none_content_as_empty`` a ``None`` content becomes ``""`` instead of being dropped.
    """
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {field.name: getattr(message, field.name) for field in dataclasses.fields(message)}
    elif callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, got {message!r}")
    if none_content_as_empty and "content" in message and message["content"] is None:
        message = {**message, "content": ""}
    return {key: value for key, value in message.items() if value is not None}


def _has_none_content(messages: Sequence[Any]) -> bool:
    """Whether any message carries ``content=None``."""
    for message in messages:
        content = (
            message.get("content", "") if isinstance(message, Mapping) else getattr(message, "content", "")
        )
        if content is None:
            return True
    return False


def _alias_reasoning(message: dict) -> dict:
    """Fill ``reasoning_content`` (and ``thinking``) from whichever reasoning field the message has."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _parse_arguments_in_place(message: dict) -> None:
    """Turn JSON-object strings in an assistant message's tool-call arguments into dicts."""
    tool_calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(tool_calls, list):
        return
    for call in tool_calls:
        if not isinstance(call, dict):
            continue
        holder = call.get("function") if isinstance(call.get("function"), dict) else call
        arguments = holder.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue  # not JSON: the template gets the raw string
            if isinstance(parsed, dict):
                holder["arguments"] = parsed


def prepare_messages(
    messages: Sequence[Any], parse_tool_arguments: bool = True, none_content_as_empty: bool = False
) -> list[dict]:
    """The messages as the template sees them (a fresh copy; the caller's objects are not modified)."""
    prepared = []
    for message in messages:
        plain = _plain_data(_as_message_dict(message, none_content_as_empty))
        if parse_tool_arguments:
            _parse_arguments_in_place(plain)
        prepared.append(_alias_reasoning(plain))
    return prepared


class ChatTemplate:
    """A compiled chat template.

    ``special_tokens`` maps template variable names (``bos_token``, ``eos_token``, ...) to token
    strings; they are visible to the template as transformers makes them, and explicit template
    keyword arguments override them.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._compiled = make_environment().from_string(source)
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"chat template does not compile: {error}") from error

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool | str = False,
        parse_tool_arguments: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text.

        Args:
            messages: dicts (or dataclasses / pydantic models) with ``role``, ``content`` and
                optionally ``tool_calls``, ``reasoning_content`` (or ``thinking`` / ``reasoning``), ...
            tools: JSON-schema tool definitions (``{"type": "function", "function": {...}}``).
            add_generation_prompt: end with the header that starts an assistant turn.
            documents: retrieval documents for templates that read them.
            continue_final_message: leave the last message open so that the model continues it (an
                assistant prefill). A string names the field to continue (e.g. ``"reasoning_content"``).
            parse_tool_arguments: parse JSON-string tool-call arguments into dicts first.
            **template_kwargs: further template variables (``enable_thinking``, ...).

        Raises:
            ChatTemplateError: the template raised, or the inputs do not fit it.
        """
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        if tools is not None and any(not isinstance(tool, Mapping) for tool in tools):
            raise ChatTemplateError("tools must be JSON-schema dicts")
        if documents is not None and any(not isinstance(doc, Mapping) for doc in documents):
            raise ChatTemplateError("documents must be dicts")
        try:
            chat = prepare_messages(messages, parse_tool_arguments)
        except TypeError as error:
            raise ChatTemplateError(str(error)) from error
        variables = _plain_data({**self.special_tokens, **template_kwargs})
        tools = _plain_data(list(tools)) if tools is not None else None
        documents = _plain_data(list(documents)) if documents is not None else None

        context = {
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
            **variables,
        }
        try:
            return self._render_chat(chat, context, continue_final_message)
        except ChatTemplateError:
            # transformers drops ``content=None`` (as OpenAI clients send it beside tool calls), and
            # templates that read ``message.content`` (Qwen3's) then fail. Only in that case, render
            # again with empty contents: wherever transformers succeeds, the output is its output.
            if not _has_none_content(messages):
                raise
        chat = prepare_messages(messages, parse_tool_arguments, none_content_as_empty=True)
        return self._render_chat(chat, context, continue_final_message)

    def _render_chat(
        self, chat: list[dict], context: dict[str, Any], continue_final_message: bool | str
    ) -> str:
        continued = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            continued = self._tag_final_message(chat, field)
        try:
            rendered = self._compiled.render(messages=chat, **context)
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"chat template error: {error}") from error
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as error:
            raise ChatTemplateError(f"chat template failed on these inputs: {error!r}") from error
        if continued is not None:
            rendered = self._cut_at_tag(rendered, continued)
        return rendered

    def _tag_final_message(self, chat: list[dict], field: str) -> str:
        """Append the continue tag to the final message's ``field``; returns the original text."""
        final = chat[-1].get(field)
        if final is None:
            raise ChatTemplateError(f'continue_final_message: the final message has no "{field}" to continue')
        fields = [field]
        if field in REASONING_FIELDS:
            fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final]
        if not any(name in self.source for name in fields):
            raise ChatTemplateError(f'continue_final_message: the chat template never reads "{field}"')
        if isinstance(final, (list, tuple)):
            blocks = [copy.copy(block) for block in final]
            for block in reversed(blocks):
                if isinstance(block, dict) and "text" in block:
                    text = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    chat[-1][field] = blocks
                    return text
            raise ChatTemplateError("continue_final_message: the final message has no text block")
        for name in fields:
            chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_at_tag(rendered: str, final_text: str) -> str:
        """Cut the rendered text right after the continued message's text (transformers' rule)."""
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError(
                "continue_final_message: the template dropped part of the final message, "
                "so it cannot be continued"
            )
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()
