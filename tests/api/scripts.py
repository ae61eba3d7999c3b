"""Scripted model outputs shared by the API tests (a function of the prompt text)."""

from __future__ import annotations

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
WEATHER_ANSWER = "It is sunny in Paris."


def weather_agent(prompt: str) -> str:
    """Calls get_weather first; once the tool result is in the prompt, answers from it."""
    if "<tool_response>" in prompt:
        return WEATHER_ANSWER
    if "get_weather" in prompt:
        return "<think>\nI should look it up.\n</think>\n\nLet me check.\n" + WEATHER_CALL
    return "I have no tools."
