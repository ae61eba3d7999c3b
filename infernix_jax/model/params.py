"""The model's weights as a pytree of registered dataclasses, declared once.

Every weight is declared once here (`declare_params`: shape and how to initialise it); random
init, `jax.eval_shape` trees and the checkpoint loader's expected shapes all derive from that
declaration. Linear weights keep Hugging Face's [out, in] layout, so a quantized weight (packed
along `in`) slots in without changing layer code. GDN input projections are held in the split
(Qwen3.5) form whatever the checkpoint used; the loader converts Qwen3-Next's fused layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from infernix_jax.config import FULL_ATTENTION, MLP_MOE, ModelConfig
from infernix_jax.model.ngram_memory import NgramMemoryParams


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclass(cls))


@_pytree
class MLPParams:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    gate_proj: Any  # [I, D]
    up_proj: Any  # [I, D]
    down_proj: Any  # [D, I]


@_pytree
class MoEParams:
    """Routed experts (stacked on a leading expert axis) plus an optional gated shared expert."""

    router: Any  # [E, D]
    gate_proj: Any  # [E, I, D]
    up_proj: Any  # [E, I, D]
    down_proj: Any  # [E, D, I]
    shared: MLPParams | None = None
    shared_gate: Any = None  # [1, D]


@_pytree
class AttentionParams:
    """Full attention; with an output gate, q_proj rows interleave [query | gate] per head."""

    q_proj: Any  # [H * Dh * (2 if gated else 1), D]
    k_proj: Any  # [K * Dh, D]
    v_proj: Any  # [K * Dh, D]
    o_proj: Any  # [D, H * Dh]
    q_norm: Any  # [Dh]
    k_norm: Any  # [Dh]
    q_bias: Any = None
    k_bias: Any = None
    v_bias: Any = None
    o_bias: Any = None


@_pytree
class GDNParams:
    """Gated DeltaNet in the split layout: in_proj_qkv rows are [all q | all k | all v]."""

    in_proj_qkv: Any  # [2 * key_dim + value_dim, D]
    in_proj_z: Any  # [value_dim, D]
    in_proj_b: Any  # [Hv, D]
    in_proj_a: Any  # [Hv, D]
    conv_weight: Any  # [conv_dim, kernel]
    dt_bias: Any  # [Hv]
    A_log: Any  # [Hv]
    norm: Any  # [Dv] plain (not zero-centred) gated RMSNorm weight
    out_proj: Any  # [D, value_dim]


@_pytree
class LayerParams:
    """One decoder layer: exactly one of attn/gdn and one of mlp/moe is set."""

    input_norm: Any  # [D]
    post_norm: Any  # [D]
    attn: AttentionParams | None = None
    gdn: GDNParams | None = None
    mlp: MLPParams | None = None
    moe: MoEParams | None = None
    ngram: NgramMemoryParams | None = None  # n-gram memory read before the mixer (model/ngram_memory.py)


@_pytree
class MTPParams:
    """Multi-token prediction head (vLLM qwen3_next_mtp semantics); shares embed and lm_head."""

    fc: Any  # [D, 2D]: input is concat[embedding, hidden]
    pre_fc_norm_embedding: Any  # [D]
    pre_fc_norm_hidden: Any  # [D]
    norm: Any  # [D]
    layers: tuple[LayerParams, ...]


@_pytree
class Params:
    embed: Any  # [V, D]
    layers: tuple[LayerParams, ...]
    final_norm: Any  # [D]
    lm_head: Any = None  # [V, D]; None when tied to embed
    mtp: MTPParams | None = None

    @property
    def output_embedding(self):
        return self.embed if self.lm_head is None else self.lm_head


# ---- declarations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decl:
    """One declared weight: its shape and how random init fills it."""

    shape: tuple[int, ...]
    init: str = "linear"  # "linear" (fan-in scaled normal), "embed", "norm", "ones", "A_log", "zeros", "normal"

    def make(self, key: jax.Array, dtype, zero_centered: bool) -> jax.Array:
        shape = self.shape
        if self.init == "linear":
            fan_in = shape[-1]
            return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
        if self.init == "embed":
            return jax.random.normal(key, shape, jnp.float32).astype(dtype)
        if self.init == "norm":
            base = 0.0 if zero_centered else 1.0
            return (base + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        if self.init == "ones":
            return jnp.ones(shape, dtype)
        if self.init == "A_log":
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(jnp.float32)
        if self.init == "normal":
            return (0.5 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return jnp.zeros(shape, dtype)


def _mlp_decl(d: int, i: int) -> MLPParams:
    return MLPParams(gate_proj=Decl((i, d)), up_proj=Decl((i, d)), down_proj=Decl((d, i)))


def _layer_decl(cfg: ModelConfig, mixer: str, mlp: str) -> LayerParams:
    d = cfg.hidden_size
    layer = LayerParams(input_norm=Decl((d,), "norm"), post_norm=Decl((d,), "norm"))
    if mixer == FULL_ATTENTION:
        hq, hk, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_rows = hq * dh * (2 if cfg.attn_output_gate else 1)
        bias = cfg.attention_bias
        layer.attn = AttentionParams(
            q_proj=Decl((q_rows, d)),
            k_proj=Decl((hk * dh, d)),
            v_proj=Decl((hk * dh, d)),
            o_proj=Decl((d, hq * dh)),
            q_norm=Decl((dh,), "norm"),
            k_norm=Decl((dh,), "norm"),
            q_bias=Decl((q_rows,), "normal") if bias else None,
            k_bias=Decl((hk * dh,), "normal") if bias else None,
            v_bias=Decl((hk * dh,), "normal") if bias else None,
            o_bias=Decl((d,), "normal") if bias else None,
        )
    else:
        hv = cfg.linear_num_v_heads
        layer.gdn = GDNParams(
            in_proj_qkv=Decl((cfg.linear_conv_dim, d)),
            in_proj_z=Decl((cfg.linear_value_dim, d)),
            in_proj_b=Decl((hv, d)),
            in_proj_a=Decl((hv, d)),
            conv_weight=Decl((cfg.linear_conv_dim, cfg.linear_conv_kernel), "normal"),
            dt_bias=Decl((hv,), "normal"),
            A_log=Decl((hv,), "A_log"),
            norm=Decl((cfg.linear_v_head_dim,), "ones"),
            out_proj=Decl((d, cfg.linear_value_dim)),
        )
    if mlp == MLP_MOE:
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        s = cfg.shared_expert_intermediate_size
        layer.moe = MoEParams(
            router=Decl((e, d)),
            gate_proj=Decl((e, i, d)),
            up_proj=Decl((e, i, d)),
            down_proj=Decl((e, d, i)),
            shared=_mlp_decl(d, s) if s else None,
            shared_gate=Decl((1, d)) if s else None,
        )
    else:
        layer.mlp = _mlp_decl(d, cfg.intermediate_size)
    return layer


def declare_params(cfg: ModelConfig, with_mtp: bool = True) -> Params:
    """The declaration tree: same structure as `Params`, with a `Decl` at every leaf."""
    d, v = cfg.hidden_size, cfg.vocab_size
    layers = tuple(_layer_decl(cfg, cfg.layer_types[i], cfg.mlp_types[i]) for i in range(cfg.num_layers))
    if cfg.ngram_memory is not None:
        e = cfg.ngram_memory.memory_dim
        for i in cfg.ngram_memory.layers:
            layers[i].ngram = NgramMemoryParams(
                key_proj=Decl((d, e)), value_proj=Decl((d, e)), key_norm=Decl((d,), "norm"), query_norm=Decl((d,), "norm")
            )
    mtp = None
    if with_mtp and cfg.mtp_num_layers:
        mtp = MTPParams(
            fc=Decl((d, 2 * d)),
            pre_fc_norm_embedding=Decl((d,), "norm"),
            pre_fc_norm_hidden=Decl((d,), "norm"),
            norm=Decl((d,), "norm"),
            layers=tuple(_layer_decl(cfg, FULL_ATTENTION, cfg.mtp_mlp_type) for _ in range(cfg.mtp_num_layers)),
        )
    return Params(
        embed=Decl((v, d), "embed"),
        layers=layers,
        final_norm=Decl((d,), "norm"),
        lm_head=None if cfg.tie_word_embeddings else Decl((v, d)),
        mtp=mtp,
    )


def _is_decl(x: Any) -> bool:
    return isinstance(x, Decl)


def map_decls(fn: Callable[[tuple, Decl], Any], decls: Params) -> Params:
    """Apply fn(path, decl) at every declared leaf."""
    return jax.tree_util.tree_map_with_path(fn, decls, is_leaf=_is_decl)


# dotted paths of the decoder layers' routed expert stacks and of their quantized fields
# (the MTP head's experts are not among them)
_ROUTED_EXPERT_LEAF = re.compile(r"layers\.\d+\.moe\.(gate|up|down)_proj(\.\w+)?")


def is_routed_expert_leaf(path: str) -> bool:
    """Whether a dotted params path ("layers.3.moe.gate_proj", or a quantized stack's field such as
    "layers.3.moe.gate_proj.packed") is a decoder layer's routed expert stack: what experts beyond
    device memory place in slots and tiers (docs/experts.md), and what the loaders can leave off
    the device for them."""
    return _ROUTED_EXPERT_LEAF.fullmatch(path) is not None


def param_dtype(decl: Decl, dtype) -> Any:
    """A_log stays float32 (it feeds exp); everything else takes the model dtype."""
    return jnp.float32 if decl.init == "A_log" else dtype


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, with_mtp: bool = True) -> Params:
    """Random weights in the declared shapes (tests, benchmarks, the demo model's starting point)."""
    decls = declare_params(cfg, with_mtp)
    leaves, treedef = jax.tree_util.tree_flatten(decls, is_leaf=_is_decl)
    keys = jax.random.split(key, len(leaves))
    arrays = [
        decl.make(k, param_dtype(decl, dtype), cfg.zero_centered_norm) for decl, k in zip(leaves, keys)
    ]
    return jax.tree_util.tree_unflatten(treedef, arrays)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16, with_mtp: bool = True) -> Params:
    """ShapeDtypeStructs of the full model, without allocating it."""
    return map_decls(lambda _, d: jax.ShapeDtypeStruct(d.shape, param_dtype(d, dtype)), declare_params(cfg, with_mtp))


def count_params(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))
