"""Anthropic Messages: POST /v1/messages (and /v1/messages/count_tokens), with its own stream events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from quart import Response, jsonify

from infernix_jax.api import fields
from infernix_jax.api.blocks import REASONING, TOOL, Block, BlockTracker, Step
from infernix_jax.api.chat_plan import ChatPlan, plan_chat
from infernix_jax.api.chat_support import limit_tool_calls
from infernix_jax.api.errors import bad_request, not_supported
from infernix_jax.api.generation import Generation, new_request_id, start_generation
from infernix_jax.api.sse import SSE_HEADERS, sse_event
from infernix_jax.api.state import ServerState
from infernix_jax.engine.protocol import FINISH_ERROR, FINISH_LENGTH


def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind in ("image", "document"):
            raise not_supported(f"{kind} content (this server is text-only for now)", param=where)
        else:
            raise not_supported(f"content block type {kind!r} here", param=where)
    return "".join(texts)


def _system_text(system) -> str | None:
    if system is None:
        return None
    return _text_of(system, "system")


def chat_messages(body: dict) -> list[dict]:
    """Anthropic messages (+ system) as chat-template messages.

    tool_use blocks become assistant tool_calls, tool_result blocks become tool messages (before any
    text of the same user turn), thinking blocks become the assistant's reasoning_content.
    """
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", param="messages")
    messages: list[dict] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant", param="messages")
        role, content = message["role"], message.get("content")
        if isinstance(content, str) or content is None:
            messages.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of blocks", param="messages")
        if role == "assistant":
            messages.append(_assistant_message(content, where))
        else:
            messages.extend(_user_messages(content, where))
    return messages


def _assistant_message(content: list, where: str) -> dict:
    out: dict = {"role": "assistant", "content": ""}
    texts, calls, thinking = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                    },
                }
            )
        else:
            raise not_supported(f"assistant content block type {kind!r}", param=f"{where}.content")
    out["content"] = "".join(texts)
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _user_messages(content: list, where: str) -> list[dict]:
    tool_messages, texts = [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            text = _text_of(block.get("content"), f"{where}.content.tool_result")
            if block.get("is_error"):
                text = f"Error: {text}"
            tool_messages.append({"role": "tool", "content": text, "tool_call_id": block.get("tool_use_id")})
        else:
            texts.append(_text_of([block], f"{where}.content"))
    out = tool_messages
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_tools(tools) -> list[dict] | None:
    """Anthropic tools ({name, description, input_schema}) in chat-template form; server tools are skipped."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", param="tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request("each tool needs a name", param="tools")
        if "input_schema" not in tool:
            continue  # Anthropic-hosted tools (web search, ...) have no schema and cannot run here
        out.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description", ""),
                    "parameters": tool["input_schema"],
                },
            }
        )
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None, bool]:
    """(auto/none/required, forced name, parallel allowed) from Anthropic's tool_choice."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", None, True
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be an object", param="tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "auto":
        return "auto", None, parallel
    if kind == "none":
        return "none", None, parallel
    if kind in ("any", "tool") and not tools:
        raise bad_request(f'tool_choice "{kind}" needs tools', param="tool_choice")
    if kind == "any":
        return "required", None, parallel
    if kind == "tool":
        name = choice.get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        return "required", name, parallel
    raise bad_request(f"tool_choice type {kind!r} is unknown", param="tool_choice")


def _thinking(body: dict) -> tuple[dict, int | None | str]:
    """(template kwargs, thinking budget) from Anthropic's `thinking` option."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}, "default"
    if not isinstance(thinking, dict):
        raise bad_request("thinking must be an object", param="thinking")
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}, "default"
    if kind in ("enabled", "adaptive"):
        budget = fields.get_int(thinking, "budget_tokens", minimum=0)
        return {"enable_thinking": True}, "default" if budget is None else budget
    raise bad_request(f"thinking.type {kind!r} is unknown", param="thinking")


def plan_from_body(state: ServerState, body: dict) -> ChatPlan:
    model = fields.check_model(state, body)
    tools = chat_tools(body.get("tools"))
    tool_choice, forced_name, parallel = _tool_choice(body, tools)
    template_kwargs, budget = _thinking(body)
    return plan_chat(
        state,
        model=model,
        messages=chat_messages(body),
        tools=tools,
        tool_choice=tool_choice,
        forced_name=forced_name,
        template_kwargs=template_kwargs,
        thinking_budget=budget,
        max_tokens=fields.get_int(body, "max_tokens", minimum=0),
        sampling_options={
            "temperature": fields.get_float(body, "temperature"),
            "top_p": fields.get_float(body, "top_p"),
            "top_k": fields.get_int(body, "top_k", minimum=0),
            "stop": fields.get_stop(body, "stop_sequences") or None,
        },
        parallel_tool_calls=parallel,
    )


def count_tokens(state: ServerState, body: dict) -> int:
    return len(plan_from_body(state, body).prompt_ids)


def stop_reason(
    engine_reason: str, stop: str | int | None, plan: ChatPlan, has_tool_use: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if has_tool_use:
        return "tool_use", None
    if engine_reason == FINISH_LENGTH:
        return "max_tokens", None
    if isinstance(stop, str) and stop in plan.stop_sequences:
        return "stop_sequence", stop
    return "end_turn", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens that were not cached."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_id(call_id: str | None) -> str:
    suffix = (call_id or "").removeprefix("call_")
    return f"toolu_{suffix}"


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_block(block: Block) -> dict:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == TOOL:
        return {
            "type": "tool_use",
            "id": tool_use_id(block.call_id),
            "name": block.name,
            "input": _tool_input(block.text),
        }
    return {"type": "text", "text": block.text}


def _allowed(plan: ChatPlan, events: list) -> list:
    return limit_tool_calls(events, plan.parallel_tool_calls)


async def handle(state: ServerState, body: dict, arrival: float) -> Response:
    plan = plan_from_body(state, body)
    request_id = new_request_id("msg")
    generation = await start_generation(
        state, request_id, plan.prompt_ids, plan.sampling, arrival, plan.new_thinking_watch(), plan.constraint
    )
    if fields.get_bool(body, "stream"):
        return Response(_stream(plan, generation), content_type="text/event-stream", headers=SSE_HEADERS)
    outcome = await generation.collect()
    parser, tracker = plan.new_parser(), BlockTracker()
    tracker.feed(_allowed(plan, [*parser.feed(outcome.text), *parser.finish()]))
    tracker.close()
    blocks = tracker.blocks
    has_tool_use = any(b.kind == TOOL for b in blocks)
    reason, sequence = stop_reason(outcome.finish_reason, outcome.stop_reason, plan, has_tool_use)
    return jsonify(
        {
            "id": request_id,
            "type": "message",
            "role": "assistant",
            "model": plan.model,
            "content": [content_block(b) for b in blocks],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens),
        }
    )


async def _stream(plan: ChatPlan, generation: Generation) -> AsyncIterator[bytes]:
    parser, tracker = plan.new_parser(), BlockTracker()
    first = True
    has_tool_use = False
    async for event in generation.events():
        if first:
            first = False
            yield sse_event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": generation.request_id,
                        "type": "message",
                        "role": "assistant",
                        "model": plan.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": usage(event.prompt_tokens, event.cached_tokens, 0),
                    },
                },
            )
        events = parser.feed(event.text)
        if event.finished:
            events += parser.finish()
        steps = tracker.feed(_allowed(plan, events))
        if event.finished:
            steps += tracker.close()
        for step in steps:
            has_tool_use = has_tool_use or step.block.kind == TOOL
            yield _step_event(step)
        if event.finished:
            if event.finish_reason == FINISH_ERROR:
                yield sse_event(
                    "error",
                    {
                        "type": "error",
                        "error": {"type": "api_error", "message": event.error or "generation failed"},
                    },
                )
                return
            reason, sequence = stop_reason(event.finish_reason, event.stop_reason, plan, has_tool_use)
            yield sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(event.prompt_tokens, event.cached_tokens, event.completion_tokens),
                },
            )
            yield sse_event("message_stop", {"type": "message_stop"})


def _step_event(step: Step) -> bytes:
    block = step.block
    if step.action == "open":
        start = content_block(Block(block.index, block.kind, "", block.call_id, block.name))
        return sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": block.index, "content_block": start},
        )
    if step.action == "close":
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": block.index})
    if block.kind == REASONING:
        delta = {"type": "thinking_delta", "thinking": step.text}
    elif block.kind == TOOL:
        delta = {"type": "input_json_delta", "partial_json": step.text}
    else:
        delta = {"type": "text_delta", "text": step.text}
    return sse_event(
        "content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta}
    )
