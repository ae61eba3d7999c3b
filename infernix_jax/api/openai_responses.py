"""OpenAI Responses: POST /v1/responses (stateless: no stored responses), output items and their events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from quart import Response, jsonify

from infernix_jax.api import fields
from infernix_jax.api.blocks import REASONING, TEXT, TOOL, Block, BlockTracker, Step
from infernix_jax.api.chat_plan import ChatPlan, check_tools, effort_budget, normalize_tool_choice, plan_chat
from infernix_jax.api.chat_support import limit_tool_calls
from infernix_jax.api.errors import bad_request, not_supported
from infernix_jax.api.generation import Generation, new_request_id, start_generation
from infernix_jax.api.openai_chat import text_content
from infernix_jax.api.sse import SSE_HEADERS, sse_event
from infernix_jax.api.state import ServerState
from infernix_jax.engine.protocol import FINISH_ERROR, FINISH_LENGTH
from infernix_jax.structured import ConstraintError, ConstraintSpec

CUSTOM_INPUT = "input"  # the one parameter a freeform tool is given as a function


def chat_messages(body: dict) -> list[dict]:
    """instructions + input (a string or a list of items) as chat-template messages."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items", param="input")
    pending_reasoning: str | None = None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise bad_request(
                    f"input[{i}].role {item.get('role')!r} is not a message role", param="input"
                )
            message = {"role": role, "content": text_content(item.get("content"), f"input[{i}]")}
            if role == "assistant" and pending_reasoning is not None:
                message["reasoning_content"], pending_reasoning = pending_reasoning, None
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments") or "{}"
            if kind == "custom_tool_call":
                arguments = json.dumps({CUSTOM_INPUT: item.get("input") or ""}, ensure_ascii=False)
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if pending_reasoning is not None:
                    last["reasoning_content"], pending_reasoning = pending_reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else text_content(output, f"input[{i}].output")
            messages.append({"role": "tool", "content": text, "tool_call_id": item.get("call_id")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise not_supported(f"input item type {kind!r}", param="input")
    return messages


def custom_tool_names(tools) -> frozenset[str]:
    """Names of the freeform ("custom") tools, whose calls carry one string instead of JSON arguments."""
    if not isinstance(tools, list):
        return frozenset()
    return frozenset(t.get("name") for t in tools if isinstance(t, dict) and t.get("type") == "custom")


def _custom_as_function(tool: dict) -> dict:
    """A freeform tool as a function with one string parameter, the form the chat template knows."""
    description = (tool.get("description") or "").strip()
    note = f"Freeform tool: pass the whole input as the string parameter `{CUSTOM_INPUT}`."
    return {
        "type": "function",
        "function": {
            "name": tool.get("name"),
            "description": f"{description}\n\n{note}" if description else note,
            "parameters": {
                "type": "object",
                "properties": {CUSTOM_INPUT: {"type": "string"}},
                "required": [CUSTOM_INPUT],
            },
        },
    }


def chat_tools(tools) -> list[dict] | None:
    """Responses function and custom tools in chat-template form; hosted tools are skipped."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", param="tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise bad_request("each tool must be an object", param="tools")
        if tool.get("type") == "custom":
            out.append(_custom_as_function(tool))
            continue
        if tool.get("type") != "function":
            continue  # hosted tools (web_search, file_search, ...) cannot run here
        out.append(
            {
                "type": "function",
                "function": {
                    "name": tool.get("name"),
                    "description": tool.get("description", ""),
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
                },
            }
        )
    return check_tools(out)


def _template_kwargs(body: dict) -> dict:
    reasoning = body.get("reasoning") or {}
    if isinstance(reasoning, dict) and reasoning.get("effort") in ("none", "minimal"):
        return {"enable_thinking": False}
    return {}


def plan_from_body(state: ServerState, body: dict) -> ChatPlan:
    model = fields.check_model(state, body)
    if body.get("previous_response_id"):
        raise not_supported(
            "previous_response_id (responses are not stored; send the whole input)",
            param="previous_response_id",
        )
    spec = _text_format(body.get("text"))
    tools = chat_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    tool_choice, forced_name = normalize_tool_choice(choice, tools)
    return plan_chat(
        state,
        model=model,
        messages=chat_messages(body),
        tools=tools,
        tool_choice=tool_choice,
        forced_name=forced_name,
        template_kwargs=_template_kwargs(body),
        max_tokens=fields.get_int(body, "max_output_tokens", minimum=0),
        sampling_options={
            "temperature": fields.get_float(body, "temperature"),
            "top_p": fields.get_float(body, "top_p"),
            "seed": fields.get_int(body, "seed"),
        },
        parallel_tool_calls=fields.get_bool(body, "parallel_tool_calls", default=True),
        thinking_budget=effort_budget((body.get("reasoning") or {}).get("effort")),
        constraint_spec=spec,
        constraint_param="text.format",
    )


def _text_format(text) -> ConstraintSpec | None:
    """Responses' text.format: {"type": "text" | "json_object" | "json_schema", "schema", "strict"}."""
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if form is None:
        return None
    if not isinstance(form, dict):
        raise bad_request("text.format must be an object", param="text.format")
    kind = form.get("type", "text")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return ConstraintSpec.json_object()
        if kind == "json_schema" and form.get("schema") is not None:
            return ConstraintSpec.json_schema(form["schema"], strict=bool(form.get("strict", True)))
    except ConstraintError as exc:
        raise bad_request(str(exc), param="text.format") from None
    raise bad_request(
        f"text.format {kind!r} needs a known type and, for json_schema, a schema", param="text.format"
    )


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class _Items:
    """Output items built from blocks; item ids are fixed when a block opens."""

    def __init__(self, custom_tools: frozenset[str] = frozenset()) -> None:
        self.ids: dict[int, str] = {}
        self.custom_tools = custom_tools

    def is_custom(self, block: Block) -> bool:
        return block.kind == TOOL and block.name in self.custom_tools

    def item(self, block: Block, done: bool) -> dict:
        status = "completed" if done else "in_progress"
        if block.index not in self.ids:
            prefix = {REASONING: "rs", TEXT: "msg", TOOL: "fc"}[block.kind]
            self.ids[block.index] = _item_id(prefix)
        item_id = self.ids[block.index]
        if block.kind == REASONING:
            return {
                "type": "reasoning",
                "id": item_id,
                "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}] if done else [],
                "status": status,
            }
        if self.is_custom(block):
            return {
                "type": "custom_tool_call",
                "id": item_id,
                "call_id": block.call_id,
                "name": block.name,
                "input": custom_input(block.text) if done else "",
                "status": status,
            }
        if block.kind == TOOL:
            return {
                "type": "function_call",
                "id": item_id,
                "call_id": block.call_id,
                "name": block.name,
                "arguments": block.text,
                "status": status,
            }
        return {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": status,
            "content": [_text_part(block.text)] if done else [],
        }


def custom_input(arguments: str) -> str:
    """The freeform input of a custom tool call, from the JSON arguments the model wrote."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _response(
    response_id: str,
    plan: ChatPlan,
    body: dict,
    created: int,
    status: str,
    output: list[dict],
    usage: dict | None,
    incomplete: bool = False,
) -> dict:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": plan.model,
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": plan.parallel_tool_calls,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": plan.sampling.temperature,
        "top_p": plan.sampling.top_p,
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": None,
        "store": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    }


def _reasoning_token_estimate(blocks: list[Block], tokenizer) -> int:
    return sum(len(tokenizer.encode(b.text)) for b in blocks if b.kind == REASONING)


async def handle(state: ServerState, body: dict, arrival: float) -> Response:
    plan = plan_from_body(state, body)
    response_id = new_request_id("resp")
    generation = await start_generation(
        state,
        response_id,
        plan.prompt_ids,
        plan.sampling,
        arrival,
        plan.new_thinking_watch(),
        plan.constraint,
    )
    created = int(time.time())
    if fields.get_bool(body, "stream"):
        return Response(
            _stream(state, plan, body, generation, created),
            content_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    outcome = await generation.collect()
    parser, tracker, items = plan.new_parser(), BlockTracker(), _Items(custom_tool_names(body.get("tools")))
    tracker.feed(limit_tool_calls([*parser.feed(outcome.text), *parser.finish()], plan.parallel_tool_calls))
    incomplete = outcome.finish_reason == FINISH_LENGTH
    usage = _usage(
        outcome.prompt_tokens,
        outcome.cached_tokens,
        outcome.completion_tokens,
        _reasoning_token_estimate(tracker.blocks, state.tokenizer),
    )
    output = [items.item(b, done=True) for b in tracker.blocks]
    return jsonify(
        _response(
            response_id,
            plan,
            body,
            created,
            "incomplete" if incomplete else "completed",
            output,
            usage,
            incomplete,
        )
    )


async def _stream(
    state: ServerState, plan: ChatPlan, body: dict, generation: Generation, created: int
) -> AsyncIterator[bytes]:
    sequence = 0

    def event(kind: str, **payload) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **payload}
        sequence += 1
        return sse_event(kind, data)

    response_id = generation.request_id
    parser, tracker, items = plan.new_parser(), BlockTracker(), _Items(custom_tool_names(body.get("tools")))
    skeleton = _response(response_id, plan, body, created, "in_progress", [], None)
    yield event("response.created", response=skeleton)
    yield event("response.in_progress", response=skeleton)
    async for token_event in generation.events():
        events = parser.feed(token_event.text)
        if token_event.finished:
            events += parser.finish()
        steps = tracker.feed(limit_tool_calls(events, plan.parallel_tool_calls))
        if token_event.finished:
            steps += tracker.close()
        for step in steps:
            for chunk in _step_events(step, items, event):
                yield chunk
        if token_event.finished:
            if token_event.finish_reason == FINISH_ERROR:
                failed = _response(response_id, plan, body, created, "failed", [], None)
                failed["error"] = {
                    "code": "server_error",
                    "message": token_event.error or "generation failed",
                }
                yield event("response.failed", response=failed)
                return
            incomplete = token_event.finish_reason == FINISH_LENGTH
            usage = _usage(
                token_event.prompt_tokens,
                token_event.cached_tokens,
                token_event.completion_tokens,
                _reasoning_token_estimate(tracker.blocks, state.tokenizer),
            )
            final = _response(
                response_id,
                plan,
                body,
                created,
                "incomplete" if incomplete else "completed",
                [items.item(b, done=True) for b in tracker.blocks],
                usage,
                incomplete,
            )
            yield event("response.incomplete" if incomplete else "response.completed", response=final)


def _step_events(step: Step, items: _Items, event) -> list[bytes]:
    block = step.block
    item = items.item(block, done=step.action == "close")
    item_id, index = item["id"], block.index
    if step.action == "open":
        out = [event("response.output_item.added", output_index=index, item=item)]
        if block.kind == TEXT:
            out.append(
                event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        return out
    if step.action == "delta":
        if block.kind == TEXT:
            return [
                event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=step.text,
                    logprobs=[],
                )
            ]
        if block.kind == REASONING:
            return [
                event(
                    "response.reasoning_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=step.text,
                )
            ]
        if items.is_custom(block):
            return []  # a custom call's input is sent whole when the call is complete
        return [
            event(
                "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=step.text
            )
        ]
    out = []
    if block.kind == TEXT:
        out.append(
            event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=block.text,
                logprobs=[],
            )
        )
        out.append(
            event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=_text_part(block.text),
            )
        )
    elif block.kind == REASONING:
        out.append(
            event(
                "response.reasoning_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=block.text,
            )
        )
    elif items.is_custom(block):
        text = item["input"]
        out.append(
            event("response.custom_tool_call_input.delta", item_id=item_id, output_index=index, delta=text)
        )
        out.append(
            event("response.custom_tool_call_input.done", item_id=item_id, output_index=index, input=text)
        )
    else:
        out.append(
            event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=block.name,
                arguments=block.text,
            )
        )
    out.append(event("response.output_item.done", output_index=index, item=item))
    return out
