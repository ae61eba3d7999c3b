"""Experts beyond device memory: device slots, a host-RAM tier, the artifact on disk (docs/experts.md)."""

from infernix_jax.experts.cache import ExpertCache, ExpertStats, Swap
from infernix_jax.experts.layout import ExpertLayout, experts_in_budget, layout_of
from infernix_jax.experts.offload import ExpertOffload
from infernix_jax.experts.profile import RoutingProfile
from infernix_jax.experts.store import ExpertReadError, ExpertStore

__all__ = [
    "ExpertCache",
    "ExpertLayout",
    "ExpertOffload",
    "ExpertReadError",
    "ExpertStats",
    "ExpertStore",
    "RoutingProfile",
    "Swap",
    "experts_in_budget",
    "layout_of",
]
