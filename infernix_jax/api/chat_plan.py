"""A chat request made ready for the engine (`ChatPlan`): render, encode, pick parser, force calls.

Every chat-style protocol (OpenAI chat, Responses, Anthropic Messages) first turns its own request
shape into chat-template messages and OpenAI-style tools, then calls `plan_chat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infernix_jax.api import chat_support
from infernix_jax.api.chat_support import OutputParser
from infernix_jax.api.errors import bad_request
from infernix_jax.api.generation import clamp_max_tokens, make_sampling
from infernix_jax.api.state import ServerState
from infernix_jax.api.structured_fields import build_constraint, tool_call_constraint
from infernix_jax.api.thinking import EFFORT_BUDGETS, ThinkingPolicy, ThinkingWatch
from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.structured import ConstraintSpec, RequestConstraint


@dataclass
class ChatPlan:
    """A chat-style request made ready for the engine."""

    model: str  # the model name echoed back
    prompt_text: str
    prompt_ids: list[int]
    sampling: SamplingParams
    tools: list[dict] | None  # chat-template form: [{"type": "function", "function": {...}}]
    parser_name: str  # tool-call format
    tolerant: bool
    starts_in_reasoning: bool  # the prompt ended inside an open thinking block
    forced_prefix: str = ""  # assistant text appended to the prompt to force a tool call
    parallel_tool_calls: bool = True
    stop_sequences: tuple[str, ...] = field(default_factory=tuple)
    thinking: ThinkingPolicy = field(default_factory=ThinkingPolicy)
    constraint: RequestConstraint | None = None  # structured output, or the forced tool call's grammar

    def new_parser(self) -> OutputParser:
        return OutputParser(
            self.tools,
            self.parser_name,
            self.tolerant,
            starts_in_reasoning=self.starts_in_reasoning,
            forced_prefix=self.forced_prefix,
        )

    def new_thinking_watch(self) -> ThinkingWatch | None:
        """A watch over the thinking of one generation, or None when nothing limits it."""
        if not self.thinking.active or self.forced_prefix:
            return None
        return ThinkingWatch(self.thinking, self.starts_in_reasoning)


def effort_budget(effort: str | None) -> int | None | str:
    """The thinking budget of a reasoning_effort level ("default" when no level was given)."""
    if effort is None:
        return "default"
    if effort not in EFFORT_BUDGETS:
        raise bad_request(
            f"reasoning effort {effort!r} is not one of {sorted(EFFORT_BUDGETS)}", param="reasoning_effort"
        )
    return EFFORT_BUDGETS[effort]


def normalize_tool_choice(tool_choice, tools: list[dict] | None) -> tuple[str, str | None]:
    """("auto" | "none" | "required", forced function name) from OpenAI's tool_choice forms."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise bad_request(
                f"tool_choice must be auto, none, required or a function, got {tool_choice!r}",
                param="tool_choice",
            )
        if tool_choice == "required" and not tools:
            raise bad_request('tool_choice "required" needs tools', param="tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") or {}
        name = function.get("name") if isinstance(function, dict) else None
        name = name or tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice names no function", param="tool_choice")
        known = {t["function"]["name"] for t in tools or ()}
        if name not in known:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        return "required", name
    raise bad_request("tool_choice has an unknown form", param="tool_choice")


def check_tools(tools) -> list[dict] | None:
    """OpenAI chat tools, checked: [{"type": "function", "function": {"name", "parameters", ...}}]."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", param="tools")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                'each tool must be {"type": "function", "function": {"name": ...}}', param="tools"
            )
    return tools


def plan_chat(
    state: ServerState,
    *,
    model: str,
    messages: list[dict],
    tools: list[dict] | None,
    tool_choice: str,
    forced_name: str | None,
    template_kwargs: dict,
    max_tokens: int | None,
    sampling_options: dict,
    parallel_tool_calls: bool = True,
    thinking_budget: int | None | str = "default",
    constraint_spec: ConstraintSpec | None = None,
    constraint_param: str | None = None,
) -> ChatPlan:
    """Render and encode the conversation and fix the sampling for one chat request.

    `thinking_budget` is the request's own budget in tokens, None for unlimited, or "default" for
    the server's --reasoning-budget. `constraint_spec` (from `constraint_param`) constrains the
    answer after any thinking; a forced tool call (Hermes format) is constrained to a valid call
    instead, whatever constraint_spec says.
    """
    config = state.config
    budget = config.reasoning_budget if thinking_budget == "default" else thinking_budget
    thinking = ThinkingPolicy(
        budget=budget, detect_loops=config.reasoning_loop, wrap_up=config.reasoning_wrap_up
    )
    rendered_tools = None if tool_choice == "none" else tools
    prompt = chat_support.render_prompt(state.tokenizer, messages, rendered_tools, template_kwargs)
    parser = chat_support.tool_parser_name(state.tokenizer, config.tool_call_parser)
    forced = ""
    if rendered_tools and tool_choice == "required":
        forced = chat_support.forced_tool_prefix(parser, forced_name)
    prompt_ids = chat_support.encode(state.tokenizer, prompt + forced)
    sampling = make_sampling(
        max_tokens=clamp_max_tokens(state, len(prompt_ids), max_tokens), **sampling_options
    )
    if forced:
        constraint = tool_call_constraint(state, parser, rendered_tools, forced_name, parallel_tool_calls)
    else:
        constraint = build_constraint(state, constraint_spec, constraint_param, prompt, thinking=True)
    return ChatPlan(
        model=model,
        prompt_text=prompt + forced,
        prompt_ids=prompt_ids,
        sampling=sampling,
        tools=rendered_tools,
        parser_name=parser,
        tolerant=config.tolerant_tool_calls,
        starts_in_reasoning=not forced and chat_support.prompt_opens_thinking(prompt),
        forced_prefix=forced,
        parallel_tool_calls=parallel_tool_calls,
        stop_sequences=tuple(sampling_options.get("stop") or ()),
        thinking=thinking,
        constraint=constraint,
    )
