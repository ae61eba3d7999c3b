"""The chat template renders what transformers' apply_chat_template renders (fixtures made by
tests/fixtures/make_chat_fixtures.py), with transformers' Jinja environment and input handling."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json

import pytest

from infernix_jax.chat import ChatTemplate, ChatTemplateError, Tokenizer
from tests.chat.conftest import load_fixture

QWEN3 = load_fixture("qwen3_conversations.json")
CUSTOM = load_fixture("custom_templates.json")


def render_case(template: ChatTemplate, case: dict, **overrides) -> str:
    return template.render(
        overrides.pop("messages", case["messages"]),
        tools=case.get("tools"),
        documents=case.get("documents"),
        add_generation_prompt=case["add_generation_prompt"],
        continue_final_message=case.get("continue_final_message", False),
        **case.get("template_kwargs", {}),
        **overrides,
    )


def with_string_arguments(messages: list[dict]) -> list[dict]:
    """The messages as an OpenAI client sends them: tool-call arguments as compact JSON strings."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], separators=(",", ":"))
    return messages


def test_fixtures_match_installed_qwen3_files(qwen3: Tokenizer, qwen3_dir) -> None:
    import hashlib

    for name, key in (
        ("tokenizer.json", "tokenizer_json_sha256"),
        ("tokenizer_config.json", "tokenizer_config_sha256"),
    ):
        digest = hashlib.sha256((qwen3_dir / name).read_bytes()).hexdigest()
        assert digest == QWEN3["source"][key], f"{name} changed: rerun tests/fixtures/make_chat_fixtures.py"


@pytest.mark.parametrize("case", QWEN3["cases"], ids=[case["name"] for case in QWEN3["cases"]])
def test_qwen3_template_matches_transformers(qwen3: Tokenizer, case: dict) -> None:
    assert render_case(qwen3.chat_template, case) == case["expected_text"]


@pytest.mark.parametrize("case", QWEN3["cases"], ids=[case["name"] for case in QWEN3["cases"]])
def test_qwen3_prompt_ids_match_transformers(qwen3: Tokenizer, case: dict) -> None:
    assert qwen3.encode(render_case(qwen3.chat_template, case)) == case["expected_ids"]


def test_encode_chat_renders_and_encodes(qwen3: Tokenizer) -> None:
    case = next(case for case in QWEN3["cases"] if case["name"] == "tools_with_system")
    ids = qwen3.encode_chat(case["messages"], tools=case["tools"], add_generation_prompt=True)
    assert ids == case["expected_ids"]


@pytest.mark.parametrize("case", CUSTOM["cases"], ids=[case["name"] for case in CUSTOM["cases"]])
def test_custom_template_matches_transformers(qwen3: Tokenizer, case: dict) -> None:
    template = ChatTemplate(CUSTOM["templates"][case["template"]], qwen3.special_tokens)
    assert render_case(template, case) == case["expected_text"]


@pytest.mark.parametrize(
    "source, case_name",
    [
        ("qwen3", "parallel_tool_calls_and_responses"),
        ("qwen3", "multi_step_tools_with_reasoning"),
        ("xml", "xml_tools_and_calls"),
    ],
)
def test_json_string_arguments_render_like_dicts(qwen3: Tokenizer, source: str, case_name: str) -> None:
    if source == "qwen3":
        template, case = qwen3.chat_template, next(c for c in QWEN3["cases"] if c["name"] == case_name)
    else:
        template = ChatTemplate(CUSTOM["templates"][source], qwen3.special_tokens)
        case = next(c for c in CUSTOM["cases"] if c["name"] == case_name)
    assert (
        render_case(template, case, messages=with_string_arguments(case["messages"])) == case["expected_text"]
    )


def test_string_arguments_pass_through_verbatim_when_not_parsed(qwen3: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}],
        },
    ]
    raw = qwen3.chat_template.render(messages, add_generation_prompt=False, parse_tool_arguments=False)
    parsed = qwen3.chat_template.render(messages, add_generation_prompt=False)
    assert '"arguments": {"city":"Paris"}}' in raw
    assert '"arguments": {"city": "Paris"}}' in parsed


def test_arguments_that_are_not_a_json_object_stay_strings(qwen3: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": "not json {"}}],
        },
    ]
    assert '"arguments": not json {}' in qwen3.chat_template.render(messages, add_generation_prompt=False)


def test_render_does_not_modify_the_callers_messages(qwen3: Tokenizer) -> None:
    case = next(case for case in QWEN3["cases"] if case["name"] == "continue_final_message")
    messages = with_string_arguments(
        next(case for case in QWEN3["cases"] if case["name"] == "parallel_tool_calls_and_responses")[
            "messages"
        ]
    )
    before = copy.deepcopy(messages)
    qwen3.chat_template.render(messages)
    assert messages == before
    before = copy.deepcopy(case["messages"])
    render_case(qwen3.chat_template, case)
    assert case["messages"] == before


def test_none_valued_keys_are_dropped_before_rendering() -> None:
    template = ChatTemplate(
        "{% for m in messages %}[{{ m.content is defined }}|{{ m.tool_calls is defined }}]{% endfor %}"
    )
    rendered = template.render(
        [{"role": "assistant", "content": None, "tool_calls": None}], add_generation_prompt=False
    )
    assert rendered == "[False|False]"


def test_dataclass_messages_are_accepted(qwen3: Tokenizer) -> None:
    @dataclasses.dataclass
    class Message:
        role: str
        content: str

    case = next(case for case in QWEN3["cases"] if case["name"] == "system_multi_turn")
    messages = [Message(m["role"], m["content"]) for m in case["messages"]]
    assert qwen3.chat_template.render(messages) == case["expected_text"]


def test_special_tokens_are_variables_and_kwargs_override_them() -> None:
    template = ChatTemplate("{{ eos_token }}|{{ bos_token | default('none') }}", {"eos_token": "<|im_end|>"})
    assert template.render([{"role": "user", "content": ""}]) == "<|im_end|>|none"
    assert template.render([{"role": "user", "content": ""}], eos_token="</s>") == "</s>|none"


def test_documents_and_tools_are_always_defined() -> None:
    template = ChatTemplate(
        "{{ tools is defined }} {{ tools is none }} {{ documents is defined }} {{ add_generation_prompt }}"
    )
    assert template.render([{"role": "user", "content": ""}]) == "True True True True"


@pytest.mark.parametrize(
    "filter_args, dumps_kwargs",
    [
        ("", {}),
        ("indent=2", {"indent": 2}),
        ("sort_keys=True", {"sort_keys": True}),
        ("separators=(',', ':')", {"separators": (",", ":")}),
        ("ensure_ascii=True", {"ensure_ascii": True}),
    ],
)
def test_tojson_is_plain_json_dumps(filter_args: str, dumps_kwargs: dict) -> None:
    value = {"z": "<b>&'\"</b>", "a": ["ü", "😀", 1.5, None, True], "m": {"k": []}}
    template = ChatTemplate("{{ messages[0].content | tojson(" + filter_args + ") }}")
    expected = json.dumps(value, **{"ensure_ascii": False, **dumps_kwargs})
    assert template.render([{"role": "user", "content": value}], add_generation_prompt=False) == expected


def test_trim_and_lstrip_blocks_are_on() -> None:
    template = ChatTemplate("A\n    {% if true %}\nB\n    {% endif %}\nC")
    assert template.render([{"role": "user", "content": ""}]) == "A\nB\nC"


def test_loop_controls_are_available() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% if m.content == '2' %}{% break %}{% endif %}{% endfor %}"
    )
    messages = [
        {"role": r, "content": c} for r, c in [("system", "S"), ("user", "1"), ("user", "2"), ("user", "3")]
    ]
    assert template.render(messages) == "12"


def test_generation_block_renders_its_body() -> None:
    template = ChatTemplate("<{% generation %}{{ messages[0].content }}{% endgeneration %}>")
    assert template.render([{"role": "assistant", "content": "x"}]) == "<x>"


def test_strftime_now_formats_the_current_date() -> None:
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    rendered = template.render([{"role": "user", "content": ""}])
    assert rendered in {before, datetime.datetime.now().strftime("%Y-%m-%d")}


def test_raise_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_none_content_beside_tool_calls_renders_as_empty_content(qwen3: Tokenizer) -> None:
    # OpenAI clients send content=None with tool calls; Qwen3's template reads message.content.
    case = next(case for case in QWEN3["cases"] if case["name"] == "multi_step_tools_with_reasoning")
    messages = copy.deepcopy(case["messages"])
    assert messages[1]["content"] == ""
    messages[1]["content"] = None
    assert render_case(qwen3.chat_template, case, messages=messages) == case["expected_text"]


def test_none_content_is_dropped_where_the_template_allows_it(qwen3: Tokenizer) -> None:
    template = ChatTemplate(CUSTOM["templates"]["xml"], qwen3.special_tokens)
    message = {"role": "assistant", "content": None, "tool_calls": []}
    assert template.render([message], add_generation_prompt=False) == template.render(
        [{"role": "assistant", "tool_calls": []}], add_generation_prompt=False
    )


def test_qwen3_template_missing_content_is_a_chat_template_error(qwen3: Tokenizer) -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}]
    with pytest.raises(ChatTemplateError):
        qwen3.chat_template.render(messages, add_generation_prompt=False)


def test_syntax_error_is_reported_at_construction() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{% set ns = namespace(_secret=1) %}",
        "{% set items = [] %}{{ items.append(1) }}",
    ],
)
def test_sandbox_refuses_unsafe_operations(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": ""}])


def test_dict_global_builds_dicts() -> None:
    template = ChatTemplate("{{ dict(a=1, b=2) | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }}")
    assert template.render([{"role": "user", "content": ""}]) == '{"a": 1, "b": 2} {"x": 0}'


def test_reasoning_field_aliases() -> None:
    template = ChatTemplate("{{ messages[0].reasoning_content }}|{{ messages[0].thinking }}")
    rendered = template.render(
        [{"role": "assistant", "content": "", "reasoning": "why"}], add_generation_prompt=False
    )
    assert rendered == "why|why"


def test_continue_final_message_continues_reasoning(qwen3: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "reasoning_content": "Let me"},
    ]
    rendered = qwen3.chat_template.render(
        messages, add_generation_prompt=False, continue_final_message="reasoning_content"
    )
    assert rendered.endswith("<|im_start|>assistant\n<think>\nLet me")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"messages": []}, "empty"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both"),
        ({"tools": ["not a schema"]}, "tools"),
        ({"messages": ["not a message"]}, "dicts"),
    ],
)
def test_bad_inputs_are_chat_template_errors(qwen3: Tokenizer, kwargs: dict, match: str) -> None:
    arguments = {"messages": [{"role": "user", "content": "x"}], **kwargs}
    with pytest.raises(ChatTemplateError, match=match):
        qwen3.chat_template.render(**arguments)


def test_chat_template_error_is_a_value_error() -> None:
    assert issubclass(ChatTemplateError, ValueError)
