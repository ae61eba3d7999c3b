"""infernix-jax: an inference engine for Qwen's hybrid models in JAX.

The curated public API: `load` a checkpoint into a `Model`, or call the pure `forward` directly.
"""

from infernix_jax.config import ModelConfig
from infernix_jax.loaded_model import GenerationResult, Model, load
from infernix_jax.model.forward import forward, mtp_forward

__all__ = ["GenerationResult", "Model", "ModelConfig", "forward", "load", "mtp_forward"]
