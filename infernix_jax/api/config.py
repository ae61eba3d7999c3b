"""Server settings that are not engine settings: names, auth, parsers, limits."""

from __future__ import annotations

from dataclasses import dataclass

from infernix_jax.api.thinking import DEFAULT_WRAP_UP


@dataclass(frozen=True)
class ServerConfig:
    """What the API layer needs to know besides the engine and the tokenizer."""

    served_model_name: str = "infernix"  # the model id clients send and /v1/models lists
    api_key: str | None = None  # when set, every /v1 route needs `Authorization: Bearer` or `x-api-key`
    tool_call_parser: str = "auto"  # "auto" (from the chat template), "hermes" or "qwen3_coder"
    tolerant_tool_calls: bool = False  # recover tool calls from broken model output
    reasoning_budget: int | None = None  # default thinking budget in tokens (None: unlimited)
    reasoning_loop: bool = False  # wrap up thinking that keeps repeating itself
    reasoning_wrap_up: str = DEFAULT_WRAP_UP  # inserted before closing thinking that ran out of budget
    default_max_tokens: int = 4096  # when the request names no limit (still capped by the context)
    max_waiting: int = 0  # answer 503 + Retry-After when this many requests already wait; 0: no limit
    retry_after_s: int = 1  # the Retry-After value sent with a 503
    model_aliases: tuple[str, ...] = ()  # other model names accepted as this model
    accept_any_model: bool = False  # answer any model name (clients with fixed model names)
