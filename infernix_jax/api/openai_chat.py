"""OpenAI Chat Completions: POST /v1/chat/completions, non-streaming and streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from quart import Response, jsonify

from infernix_jax.api import chat_support, fields, structured_fields
from infernix_jax.api.chat_plan import ChatPlan, check_tools, effort_budget, normalize_tool_choice, plan_chat
from infernix_jax.api.chat_support import ContentDelta, ReasoningDelta, ToolCallDelta, collect_events
from infernix_jax.api.errors import bad_request, not_supported
from infernix_jax.api.generation import (
    Generation,
    GenerationOutcome,
    collect_all,
    combined_usage,
    merge_events,
    new_request_id,
    start_generations,
)
from infernix_jax.api.sse import SSE_DONE, SSE_HEADERS, openai_stream_error, sse_data
from infernix_jax.api.state import ServerState
from infernix_jax.engine.protocol import FINISH_ERROR, FINISH_LENGTH, TokenEvent, TokenLogprob

_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def text_content(content, where: str) -> str:
    """Message content as text: a string, or a list of text parts; other part types are a clear 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PART_TYPES:
            texts.append(str(part.get("text", "")))
        elif kind in ("image_url", "input_image", "image"):
            raise not_supported("image input (this server is text-only for now)", param=f"{where}.content")
        else:
            raise not_supported(f"content part type {kind!r}", param=f"{where}.content")
    return "".join(texts)


def chat_messages(raw) -> list[dict]:
    """OpenAI messages as chat-template messages (string content; developer -> system)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", param="messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or "role" not in message:
            raise bad_request(f"messages[{i}] must be an object with a role", param="messages")
        role = message["role"]
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role {role!r} is not a chat role", param="messages")
        out = {"role": role, "content": text_content(message.get("content"), f"messages[{i}]")}
        if role == "assistant":
            if message.get("tool_calls"):
                out["tool_calls"] = message["tool_calls"]
            for name in ("reasoning_content", "reasoning"):
                if isinstance(message.get(name), str):
                    out["reasoning_content"] = message[name]
        if role == "tool" and message.get("tool_call_id"):
            out["tool_call_id"] = message["tool_call_id"]
        if message.get("name"):
            out["name"] = message["name"]
        messages.append(out)
    return messages


def template_kwargs_for(body: dict) -> dict:
    """chat_template_kwargs, plus thinking switched off by reasoning_effort "none"/"minimal"."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None and effort in ("none", "minimal"):
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def sampling_options(body: dict) -> dict:
    """The SamplingParams fields an OpenAI request sets (None means the default)."""
    logprobs = None
    if fields.get_bool(body, "logprobs"):
        logprobs = fields.get_int(body, "top_logprobs", minimum=0) or 0
    return {
        "temperature": fields.get_float(body, "temperature"),
        "top_p": fields.get_float(body, "top_p"),
        "top_k": fields.get_int(body, "top_k", minimum=0),
        "min_p": fields.get_float(body, "min_p"),
        "seed": fields.get_int(body, "seed"),
        "presence_penalty": fields.get_float(body, "presence_penalty"),
        "frequency_penalty": fields.get_float(body, "frequency_penalty"),
        "repetition_penalty": fields.get_float(body, "repetition_penalty"),
        "logit_bias": fields.get_logit_bias(body) or None,
        "stop": fields.get_stop(body, "stop") or None,
        "stop_token_ids": tuple(body["stop_token_ids"]) if body.get("stop_token_ids") else None,
        "ignore_eos": body.get("ignore_eos") if isinstance(body.get("ignore_eos"), bool) else None,
        "min_tokens": fields.get_int(body, "min_tokens", minimum=0),
        "logprobs": logprobs,
    }


def plan_from_body(state: ServerState, body: dict) -> ChatPlan:
    model = fields.check_model(state, body)
    spec, spec_param = structured_fields.spec_from_body(body)
    tools = check_tools(body.get("tools"))
    tool_choice, forced_name = normalize_tool_choice(body.get("tool_choice"), tools)
    max_tokens = fields.get_int(body, "max_completion_tokens", minimum=0)
    if max_tokens is None:
        max_tokens = fields.get_int(body, "max_tokens", minimum=0)
    return plan_chat(
        state,
        model=model,
        messages=chat_messages(body.get("messages")),
        tools=tools,
        tool_choice=tool_choice,
        forced_name=forced_name,
        template_kwargs=template_kwargs_for(body),
        max_tokens=max_tokens,
        sampling_options=sampling_options(body),
        parallel_tool_calls=fields.get_bool(body, "parallel_tool_calls", default=True),
        thinking_budget=effort_budget(body.get("reasoning_effort")),
        constraint_spec=spec,
        constraint_param=spec_param,
    )


def finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    if has_tool_calls:
        return "tool_calls"
    return "length" if engine_reason == FINISH_LENGTH else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _token_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = chat_support.decode(tokenizer, [token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """OpenAI chat `logprobs.content`: each sampled token with its top alternatives."""
    content = []
    for entry in entries:
        item = _token_entry(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_token_entry(tokenizer, tid, lp) for tid, lp in entry.top]
        content.append(item)
    return {"content": content}


def _limit_calls(plan: ChatPlan, events: list) -> list:
    return chat_support.limit_tool_calls(events, plan.parallel_tool_calls)


def message_from_events(events: list) -> tuple[dict, bool]:
    parsed = collect_events(events)
    message: dict = {
        "role": "assistant",
        "content": parsed.content if parsed.content or not parsed.tool_calls else None,
    }
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return message, bool(parsed.tool_calls)


async def handle(state: ServerState, body: dict, arrival: float) -> Response:
    plan = plan_from_body(state, body)
    n = fields.get_int(body, "n", minimum=1) or 1
    stream_options = body.get("stream_options") or {}
    include_usage = bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
    request_id = new_request_id("chatcmpl")
    generations = await start_generations(
        state,
        request_id,
        plan.prompt_ids,
        plan.sampling,
        arrival,
        n,
        plan.new_thinking_watch,
        plan.constraint,
    )
    if fields.get_bool(body, "stream"):
        body_iter = _stream(state, plan, request_id, generations, include_usage)
        return Response(body_iter, content_type="text/event-stream", headers=SSE_HEADERS)
    outcomes = await collect_all(generations)
    choices = [_choice(state, plan, index, outcome) for index, outcome in enumerate(outcomes)]
    return jsonify(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": plan.model,
            "choices": choices,
            "usage": usage(*combined_usage(outcomes)),
        }
    )


def _choice(state: ServerState, plan: ChatPlan, index: int, outcome: GenerationOutcome) -> dict:
    parser = plan.new_parser()
    events = _limit_calls(plan, [*parser.feed(outcome.text), *parser.finish()])
    message, has_calls = message_from_events(events)
    choice = {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(state.tokenizer, outcome.logprobs)
        if plan.sampling.logprobs is not None
        else None,
        "finish_reason": finish_reason(outcome.finish_reason, has_calls),
    }
    if isinstance(outcome.stop_reason, str):
        choice["stop_reason"] = outcome.stop_reason
    return choice


async def _stream(
    state: ServerState, plan: ChatPlan, request_id: str, generations: list[Generation], include_usage: bool
) -> AsyncIterator[bytes]:
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": plan.model,
    }

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        payload = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return sse_data(payload)

    parsers = [plan.new_parser() for _ in generations]
    has_calls = [False] * len(generations)
    finals: list[TokenEvent] = []
    for index in range(len(generations)):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, event in merge_events(generations):
        deltas = _limit_calls(plan, parsers[index].feed(event.text))
        if event.finished:
            deltas += _limit_calls(plan, parsers[index].finish())
        logprobs = None
        if plan.sampling.logprobs is not None and event.logprobs:
            logprobs = chat_logprobs(state.tokenizer, event.logprobs)
        for delta in _delta_dicts(deltas):
            has_calls[index] = has_calls[index] or "tool_calls" in delta
            yield chunk(index, delta, logprobs=logprobs)
            logprobs = None
        if logprobs is not None:
            yield chunk(index, {}, logprobs=logprobs)
        if event.finished:
            if event.finish_reason == FINISH_ERROR:
                yield openai_stream_error(event.error or "generation failed")
                yield SSE_DONE  # the others (n > 1) are aborted as the stream ends
                return
            finals.append(event)
            yield chunk(index, {}, finish=finish_reason(event.finish_reason, has_calls[index]))
    if include_usage:
        yield sse_data({**base, "choices": [], "usage": usage(*combined_usage(finals))})
    yield SSE_DONE


def _delta_dicts(events: list) -> list[dict]:
    """Parser events as OpenAI chunk deltas."""
    out = []
    for event in events:
        if isinstance(event, ContentDelta):
            out.append({"content": event.text})
        elif isinstance(event, ReasoningDelta):
            out.append({"reasoning_content": event.text})
        elif isinstance(event, ToolCallDelta):
            call: dict = {"index": event.index}
            if event.id is not None:
                call["id"] = event.id
                call["type"] = "function"
            function: dict = {"arguments": event.arguments}
            if event.name is not None:
                function["name"] = event.name
            call["function"] = function
            out.append({"tool_calls": [call]})
    return out
