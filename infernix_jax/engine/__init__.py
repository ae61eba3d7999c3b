"""The serving engine: scheduler, runner, sampling, the async `Engine` and the offline `LLM`.

Import the heavy parts lazily so that `from infernix_jax.engine.protocol import ...` (the API
server's only dependency) does not pull in the model.
"""

from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.protocol import (
    Engine,
    EngineStats,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)

__all__ = [
    "LLM",
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "GenerationRequest",
    "SamplingParams",
    "TokenEvent",
    "TokenLogprob",
    "create_engine",
]


def __getattr__(name: str):
    if name in ("AsyncEngine", "create_engine"):
        from infernix_jax.engine import engine

        return getattr(engine, name)
    if name == "EngineCore":
        from infernix_jax.engine.core import EngineCore

        return EngineCore
    if name == "LLM":
        from infernix_jax.engine.llm import LLM

        return LLM
    raise AttributeError(name)
