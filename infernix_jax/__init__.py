"""infernix-jax: an inference engine for Qwen's hybrid models in JAX."""

from infernix_jax.config import ModelConfig
from infernix_jax.model.forward import forward, mtp_forward

__all__ = ["ModelConfig", "forward", "mtp_forward"]
