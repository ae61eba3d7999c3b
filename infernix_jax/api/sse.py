"""Server-sent events framing."""

from __future__ import annotations

import json

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse_data(payload: dict | str) -> bytes:
    """One `data:` event (OpenAI chat and completions streams: no event names)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def sse_event(event: str, payload: dict) -> bytes:
    """One named event (Anthropic Messages and OpenAI Responses streams name every event)."""
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


SSE_DONE = sse_data("[DONE]")


def openai_stream_error(message: str) -> bytes:
    """An error inside an OpenAI stream (after the 200 was sent): the SDKs raise it as an APIError."""
    return sse_data({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
