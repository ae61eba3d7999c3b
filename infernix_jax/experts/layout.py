"""What one expert is made of, and how many fit in a byte budget.

An expert is the (gate, up, down) projections of one MoE layer's expert e, kept in the model's
storage format (NVFP4 / FP8 / ... stay packed in every tier). Flattened, it is a short list of
host arrays ("leaves": packed data and scales per projection) in `jax.tree.flatten` order of
the (gate, up, down) tuple; every tier stores and moves experts as such lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from infernix_jax.cache.capacity import parse_bytes
from infernix_jax.config import ModelConfig
from infernix_jax.model.params import MoEParams, Params

Leaves = list[np.ndarray]  # one expert: its (gate, up, down) leaves, each without the expert axis


@dataclass(frozen=True)
class ExpertLayout:
    """Shapes of one model's experts: which layers have them and what one expert holds."""

    moe_layers: tuple[int, ...]  # decoder layer indices with routed experts (MTP layers stay resident)
    num_experts: int  # E per layer
    leaf_shapes: tuple[tuple[int, ...], ...]  # per-expert shape of each flattened leaf
    leaf_dtypes: tuple[np.dtype, ...]
    treedef: Any  # of the (gate, up, down) tuple

    @property
    def expert_bytes(self) -> int:
        """Packed bytes of one expert (data and scales): the unit every budget counts in."""
        return sum(math.prod(s) * np.dtype(d).itemsize for s, d in zip(self.leaf_shapes, self.leaf_dtypes))

    @property
    def total_experts(self) -> int:
        return len(self.moe_layers) * self.num_experts


def projections(moe: MoEParams) -> tuple[Any, Any, Any]:
    return (moe.gate_proj, moe.up_proj, moe.down_proj)


def layout_of(cfg: ModelConfig, params: Params) -> ExpertLayout:
    """The expert layout of `params` (full expert stacks [E, ...] in every MoE layer)."""
    layers = tuple(i for i, layer in enumerate(params.layers) if layer.moe is not None)
    if not layers:
        raise ValueError("the model has no routed experts to offload")
    leaves, treedef = jax.tree.flatten(projections(params.layers[layers[0]].moe))
    for leaf in leaves:
        if leaf.shape[0] != cfg.num_experts:
            raise ValueError(
                f"expected expert stacks [E={cfg.num_experts}, ...]; got a leaf of shape {leaf.shape}"
            )
    return ExpertLayout(
        moe_layers=layers,
        num_experts=cfg.num_experts,
        leaf_shapes=tuple(tuple(leaf.shape[1:]) for leaf in leaves),
        leaf_dtypes=tuple(np.dtype(leaf.dtype) for leaf in leaves),
        treedef=treedef,
    )


def experts_in_budget(budget: int | str | None, layout: ExpertLayout) -> int:
    """Experts per MoE layer a byte budget holds (budgets split evenly across layers).

    None or "all": every expert; "0" / 0: none; otherwise a size such as "16GiB"."""
    if budget is None or budget == "all":
        return layout.num_experts
    if budget in (0, "0"):
        return 0
    per_layer = parse_bytes(budget) // len(layout.moe_layers)
    return min(layout.num_experts, per_layer // layout.expert_bytes)
