"""The Quart app: routes, auth, error shapes and metrics around the protocol modules.

`create_app(engine, tokenizer, config)` is all a caller needs; serve.py runs the result on Hypercorn.
"""

from __future__ import annotations

import json
import logging
import time

from quart import Quart, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from infernix_jax.api import (
    anthropic_messages,
    chat_support,
    decide,
    fields,
    openai_chat,
    openai_completions,
    openai_responses,
)
from infernix_jax.api.auth import is_authorized
from infernix_jax.api.config import ServerConfig
from infernix_jax.api.errors import ApiError, bad_request, error_body, style_for_path
from infernix_jax.api.metrics import CONTENT_TYPE, ServerMetrics
from infernix_jax.api.state import ServerState
from infernix_jax.engine.protocol import Engine

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger(__name__)

# Generation routes and the protocol module that answers each.
_GENERATION_ROUTES = {
    "/v1/chat/completions": openai_chat.handle,
    "/v1/completions": openai_completions.handle,
    "/v1/responses": openai_responses.handle,
    "/v1/messages": anthropic_messages.handle,
    "/v1/decide": decide.handle,
}


async def read_json() -> dict:
    """The request body as a JSON object; malformed JSON is a 400, not a crash."""
    raw = await request.get_data()
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    return fields.require_object(body)


def _error_response(error: ApiError) -> Response:
    response = jsonify(error_body(error, style_for_path(request.path)))
    response.status_code = error.status
    if error.retry_after_s is not None:
        response.headers["Retry-After"] = str(error.retry_after_s)
    return response


def create_app(engine: Engine, tokenizer, config: ServerConfig | None = None) -> Quart:
    """An app serving `engine` with `tokenizer` (chat.tokenizer.Tokenizer) under `config`."""
    config = config or ServerConfig()
    app = Quart("infernix_jax")
    app.config["RESPONSE_TIMEOUT"] = None  # long generations must not be cut off
    app.config["BODY_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024
    state = ServerState(engine=engine, tokenizer=tokenizer, config=config, metrics=ServerMetrics())
    app.extensions["infernix"] = state

    @app.before_request
    async def _authorize():
        if not is_authorized(request.headers, request.path, config.api_key):
            raise ApiError(
                401,
                "invalid or missing API key (send Authorization: Bearer KEY or x-api-key: KEY)",
                code="invalid_api_key",
            )

    @app.after_request
    async def _count(response: Response) -> Response:
        endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
        state.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.errorhandler(ApiError)
    async def _api_error(error: ApiError):
        if error.status >= 500:
            log.error("%s %s: %s", request.method, request.path, error.message)
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException):
        message = "no such route" if error.code == 404 else (error.description or error.name)
        return _error_response(ApiError(error.code or 500, message))

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception):
        log.exception("unexpected error on %s %s", request.method, request.path)
        return _error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}"))

    for path, handler in _GENERATION_ROUTES.items():
        app.add_url_rule(path, view_func=_generation_view(state, handler), methods=["POST"], endpoint=path)

    @app.post("/v1/messages/count_tokens")
    async def _count_tokens():
        body = await read_json()
        return jsonify({"input_tokens": anthropic_messages.count_tokens(state, body)})

    @app.get("/health")
    async def _health():
        stats = engine.stats()
        return jsonify(
            {
                "status": "ok",
                "running": stats.running,
                "waiting": stats.waiting,
                "kv_blocks_used": stats.kv_blocks_used,
                "kv_blocks_total": stats.kv_blocks_total,
            }
        )

    @app.get("/v1/models")
    async def _models():
        return jsonify({"object": "list", "data": [_model_card(state, name) for name in state.model_names()]})

    @app.get("/v1/models/<path:name>")
    async def _model(name: str):
        if name not in state.model_names():
            raise ApiError(404, f"the model {name!r} does not exist", code="model_not_found")
        return jsonify(_model_card(state, name))

    @app.post("/tokenize")
    async def _tokenize():
        body = await read_json()
        fields.check_model(state, body)
        if "messages" in body:
            messages = openai_chat.chat_messages(body["messages"])
            kwargs = openai_chat.template_kwargs_for(body)
            text = chat_support.render_prompt(tokenizer, messages, body.get("tools"), kwargs)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise bad_request('send "prompt" (a string) or "messages"', param="prompt")
        tokens = chat_support.encode(tokenizer, text)
        return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_context})

    @app.post("/detokenize")
    async def _detokenize():
        body = await read_json()
        fields.check_model(state, body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("tokens must be a list of integers", param="tokens")
        return jsonify({"prompt": chat_support.decode(tokenizer, tokens)})

    @app.get("/metrics")
    async def _metrics():
        return Response(state.metrics.render(engine.stats()), content_type=CONTENT_TYPE)

    return app


def _model_card(state: ServerState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "infernix",
        "max_model_len": state.engine.max_context,
    }


def _generation_view(state: ServerState, handler):
    async def view():
        arrival = time.monotonic()
        body = await read_json()
        return await handler(state, body, arrival)

    return view
