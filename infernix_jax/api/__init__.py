"""The HTTP API: a Quart app that speaks OpenAI and Anthropic over an `Engine` (engine/protocol.py).

`create_app(engine, tokenizer, ServerConfig(...))` builds the app; one module per protocol turns its
request JSON into a `GenerationRequest` and the engine's `TokenEvent`s back into that protocol's
response and stream shapes.
"""

from infernix_jax.api.app import create_app
from infernix_jax.api.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
