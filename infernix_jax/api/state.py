"""What every route handler shares: the engine, the tokenizer, the settings and the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infernix_jax.api.config import ServerConfig
from infernix_jax.api.metrics import ServerMetrics
from infernix_jax.engine.protocol import Engine


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any  # chat.tokenizer.Tokenizer: encode, decode, eos_token_ids, chat_template
    config: ServerConfig
    metrics: ServerMetrics
    structured_backend: Any = None  # structured.GrammarBackend, built on the first constrained request

    def model_names(self) -> tuple[str, ...]:
        return (self.config.served_model_name, *self.config.model_aliases)
