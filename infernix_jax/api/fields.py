"""Reading and checking request JSON fields; every mistake becomes a 400 that names the field."""

from __future__ import annotations

from typing import Any

from infernix_jax.api.errors import ApiError, bad_request
from infernix_jax.api.state import ServerState


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def get_int(body: dict, name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise bad_request(f"{name} must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise bad_request(f"{name} must be >= {minimum}, got {value}", param=name)
    return value


def get_float(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", param=name)
    return value


def get_stop(body: dict, name: str) -> tuple[str, ...]:
    """Stop strings given as one string or a list of strings."""
    value = body.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise bad_request(f"{name} must be a string or a list of strings", param=name)


def get_logit_bias(body: dict, name: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map as (id, bias) pairs."""
    value = body.get(name)
    if not value:
        return ()
    if not isinstance(value, dict):
        raise bad_request(f"{name} must map token ids to numbers", param=name)
    try:
        return tuple((int(k), float(v)) for k, v in value.items())
    except (TypeError, ValueError):
        raise bad_request(f"{name} must map token ids to numbers", param=name) from None


def check_model(state: ServerState, body: dict) -> str:
    """The model name to echo back; an unknown name is a 404 (as the real services answer)."""
    model = body.get("model")
    if model is None:
        return state.config.served_model_name
    if not isinstance(model, str):
        raise bad_request("model must be a string", param="model")
    if state.config.accept_any_model or model in state.model_names():
        return model
    raise ApiError(
        404,
        f"the model {model!r} does not exist; this server serves {state.config.served_model_name!r}",
        param="model",
        code="model_not_found",
    )
