"""Model configuration: one frozen, hashable `ModelConfig` for every Qwen3-family variant.

`ModelConfig.from_hf_config(path_or_dict)` reads a Hugging Face config.json (or its parsed dict)
and resolves everything the graph needs into explicit fields: per-layer mixer and MLP kinds, the
RMSNorm style, the rotary dimensions and YaRN frequencies, the GDN projection layout and where the
text model's weights live in the checkpoint. Being frozen and hashable, it is passed to `jax.jit`
as a static argument.

Facts and sources for each field: docs/model_config.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
MLP_DENSE = "dense"
MLP_MOE = "moe"


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its config values is not supported."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding as Qwen configures it (NeoX rotate-half over the first `rotary_dim` dims)."""

    theta: float
    rotary_dim: int  # head_dim * partial_rotary_factor: only these leading dims of a head are rotated
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0  # YaRN context extension factor
    original_max_position_embeddings: int = 0  # YaRN: the pretraining context
    attention_factor: float = 1.0  # multiplies cos and sin (YaRN's mscale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # YaRN: round the correction range to whole dims (transformers' default)

    def inv_freq(self) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2] in float32, exactly as transformers computes them."""
        d = self.rotary_dim
        pos_freqs = self.theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
        extrapolation = (1.0 / pos_freqs).astype(np.float32)
        if self.kind == "default":
            return extrapolation
        interpolation = (1.0 / (self.factor * pos_freqs)).astype(np.float32)

        def correction_dim(num_rotations: float) -> float:
            return (d * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


NGRAM_GATINGS = ("engram_scalar",)


@dataclass(frozen=True)
class NgramMemoryConfig:
    """Engram-style conditional memory (our own config.json schema, key "ngram_memory"; docs/ngram_memory.md).

    At each configured layer, hashed n-grams of the input tokens (every order in `orders`, with
    `heads_per_order` hash heads each) index rows of a big table that lives apart from the weights;
    the rows, gated by the hidden state, are added to the residual stream before the mixer.
    """

    orders: tuple[int, ...]  # n-gram orders, each >= 2 (the n-gram ending at the current token)
    heads_per_order: int  # hash heads per order; each head has its own prime-sized slice of rows
    table_rows: int  # row budget of one layer's table, split evenly between its heads
    row_width: int  # values per row (one head's embedding width)
    layers: tuple[int, ...]  # decoder layers that read the memory (before their mixer)
    seed: int = 0  # seeds each layer's hash multipliers
    gating: str = "engram_scalar"  # sigmoid(signed-sqrt(<norm(W_k e), norm(h)> / sqrt(D))) * W_v e
    table_dtype: str = "bfloat16"  # dtype of the rows in the table volume
    table_sha256: str | None = None  # when set, the volume's manifest must carry this checksum

    @property
    def num_heads(self) -> int:
        """Rows fetched per token per layer (orders x heads)."""
        return len(self.orders) * self.heads_per_order

    @property
    def memory_dim(self) -> int:
        """Width of the concatenated memory vector e_t of one layer."""
        return self.num_heads * self.row_width

    @property
    def max_order(self) -> int:
        return max(self.orders)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], num_layers: int) -> NgramMemoryConfig:
        """Parse and check config.json's "ngram_memory" object."""
        try:
            out = cls(
                orders=tuple(int(n) for n in raw["orders"]),
                heads_per_order=int(raw["heads_per_order"]),
                table_rows=int(raw["table_rows"]),
                row_width=int(raw["row_width"]),
                layers=tuple(int(i) for i in raw["layers"]),
                seed=int(raw.get("seed", 0)),
                gating=str(raw.get("gating", "engram_scalar")),
                table_dtype=str(raw.get("table_dtype", "bfloat16")),
                table_sha256=raw.get("table_sha256"),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"ngram_memory lacks the field {e.args[0]!r}") from None
        errors = []
        if not out.orders or min(out.orders) < 2 or len(set(out.orders)) != len(out.orders):
            errors.append(f"orders must be distinct and >= 2, got {list(out.orders)}")
        if out.heads_per_order < 1 or out.row_width < 1:
            errors.append("heads_per_order and row_width must be >= 1")
        if out.table_rows < 4 * max(out.num_heads, 1):
            errors.append(f"table_rows {out.table_rows} is too small for {out.num_heads} heads")
        if not out.layers or any(not 0 <= i < num_layers for i in out.layers) or len(set(out.layers)) != len(out.layers):
            errors.append(f"layers must be distinct layer indices in [0, {num_layers}), got {list(out.layers)}")
        if out.gating not in NGRAM_GATINGS:
            errors.append(f"gating must be one of {', '.join(NGRAM_GATINGS)}, got {out.gating!r}")
        if out.table_dtype not in ("bfloat16", "float16", "float32"):
            errors.append(f"table_dtype must be bfloat16, float16 or float32, got {out.table_dtype!r}")
        if errors:
            raise UnsupportedModelError("ngram_memory: " + "; ".join(errors))
        return dataclasses.replace(out, layers=tuple(sorted(out.layers)))


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward needs to know about a model, resolved from config.json."""

    architecture: str  # e.g. "Qwen3NextForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads of full-attention layers
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # FULL_ATTENTION or LINEAR_ATTENTION per layer
    mlp_types: tuple[str, ...]  # MLP_DENSE or MLP_MOE per layer
    intermediate_size: int = 0  # width of dense MLP layers
    zero_centered_norm: bool = True  # y = x_normed * (1 + w) (Qwen3-Next/3.5); False: y = x_normed * w (Qwen3)
    attn_output_gate: bool = True  # q_proj also yields a sigmoid gate on the attention output
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # Gated DeltaNet (linear-attention) layers
    linear_conv_kernel: int = 4
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    gdn_projection: str = "split"  # checkpoint layout: "fused" (in_proj_qkvz/ba) or "split" (in_proj_qkv/z/b/a)
    # Mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-MoE)
    norm_topk_prob: bool = True
    # Multi-token prediction head
    mtp_num_layers: int = 0
    mtp_mlp_type: str = MLP_DENSE
    # Where the text model's tensors live in the checkpoint
    weight_prefix: str = "model."
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Engram-style n-gram memory (docs/ngram_memory.md); None: the model has none
    ngram_memory: NgramMemoryConfig | None = None

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_k_heads * self.linear_k_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_v_heads * self.linear_v_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any]) -> ModelConfig:
        """Build from a model directory, a config.json path, or a parsed config dict."""
        raw = _read_config(source)
        architecture = _architecture(raw)
        text = dict(raw.get("text_config") or raw) if architecture in _CONDITIONAL else dict(raw)
        family = _FAMILIES[architecture]
        return _build(architecture, family, raw, text)


_CONDITIONAL = {"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}
# architecture -> family: what the graph looks like
_FAMILIES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


def _read_config(source: str | os.PathLike | Mapping[str, Any]) -> dict:
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in _FAMILIES:
            return arch
    model_type = raw.get("model_type")
    by_type = {
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen3_next": "Qwen3NextForCausalLM",
        "qwen3_5_text": "Qwen3_5ForCausalLM",
        "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    }
    if not archs and model_type in by_type:
        return by_type[model_type]
    raise UnsupportedModelError(
        f"unsupported architecture {archs or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(text: Mapping[str, Any], head_dim: int, default_partial: float) -> RopeConfig:
    params = dict(text.get("rope_parameters") or {})
    legacy = text.get("rope_scaling") or {}
    if legacy and not params.get("rope_type") and not params.get("type"):
        params.update(legacy)
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", default_partial))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise UnsupportedModelError(
            f"partial_rotary_factor {partial} gives rotary dim {rotary_dim} for head_dim {head_dim}; "
            "it must be even and in (0, head_dim]"
        )
    if kind in ("default", "mrope"):
        # Qwen3.5's interleaved MRoPE reduces to plain 1-D RoPE for text-only positions.
        return RopeConfig(theta=float(theta), rotary_dim=rotary_dim)
    if kind == "yarn":
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings") or text.get("original_max_position_embeddings")
        if original is None:
            original = text.get("max_position_embeddings")
        if factor is None:
            factor = text["max_position_embeddings"] / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if mscale and mscale_all:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            else:
                attention_factor = get_mscale(factor)
        return RopeConfig(
            theta=float(theta),
            rotary_dim=rotary_dim,
            kind="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(original),
            attention_factor=float(attention_factor),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
        )
    raise UnsupportedModelError(f"unsupported rope_type {kind!r}; supported: default, mrope (text), yarn")


def _layer_types(text: Mapping[str, Any], num_layers: int, hybrid: bool) -> tuple[str, ...]:
    if not hybrid:
        return (FULL_ATTENTION,) * num_layers
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    types = tuple(types)
    if len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {num_layers} layers")
    bad = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if bad:
        raise UnsupportedModelError(f"unsupported layer types {bad}; supported: {FULL_ATTENTION}, {LINEAR_ATTENTION}")
    return types


def _num_experts(text: Mapping[str, Any]) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts under its attribute-map name num_local_experts
    return int(text.get("num_experts") or text.get("num_local_experts") or 0)


def _mlp_types(family: str, text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    num_experts = _num_experts(text)
    if family in ("qwen3", "qwen3_5") or num_experts == 0:
        return (MLP_DENSE,) * num_layers
    if family == "qwen3_5_moe":
        return (MLP_MOE,) * num_layers
    step = int(text.get("decoder_sparse_step", 1) or 1)
    dense_only = set(text.get("mlp_only_layers") or [])
    return tuple(
        MLP_MOE if (i not in dense_only and (i + 1) % step == 0) else MLP_DENSE for i in range(num_layers)
    )


def _eos_ids(raw: Mapping[str, Any], text: Mapping[str, Any]) -> tuple[int, ...]:
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _build(architecture: str, family: str, raw: Mapping[str, Any], text: Mapping[str, Any]) -> ModelConfig:
    hybrid = family in ("qwen3_next", "qwen3_5", "qwen3_5_moe")
    num_layers = int(text["num_hidden_layers"])
    num_heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    head_dim = int(text.get("head_dim") or hidden // num_heads)
    hidden_act = text.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {hidden_act!r}; supported: silu")
    layer_types = _layer_types(text, num_layers, hybrid)
    mlp_types = _mlp_types(family, text, num_layers)
    moe = MLP_MOE in mlp_types

    linear = {}
    if hybrid:
        nk, nv = int(text.get("linear_num_key_heads", 16)), int(text.get("linear_num_value_heads", 32))
        if nv % nk:
            raise UnsupportedModelError(
                f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk})"
            )
        linear = dict(  # noqa: C408 - ModelConfig field names
            linear_conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            linear_num_k_heads=nk,
            linear_num_v_heads=nv,
            linear_k_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_v_head_dim=int(text.get("linear_value_head_dim", 128)),
            gdn_projection="fused" if family == "qwen3_next" else "split",
        )

    shared = int(text.get("shared_expert_intermediate_size", 0) or 0) if family != "qwen3_moe" else 0
    mtp_layers = int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0)) or 0)
    if family == "qwen3_5_moe":
        norm_topk = True
    else:
        norm_topk = bool(text.get("norm_topk_prob", family != "qwen3_moe"))
    tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if architecture in _CONDITIONAL:
        tie = bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))

    return ModelConfig(
        architecture=architecture,
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(text.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope=_rope(text, head_dim, default_partial=0.25 if hybrid else 1.0),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        layer_types=layer_types,
        mlp_types=mlp_types,
        intermediate_size=int(text.get("intermediate_size", 0) or 0),
        zero_centered_norm=hybrid,
        attn_output_gate=hybrid and bool(text.get("attn_output_gate", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        tie_word_embeddings=tie,
        num_experts=_num_experts(text) if moe else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0) if moe else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0) if moe else 0,
        shared_expert_intermediate_size=shared if moe else 0,
        norm_topk_prob=norm_topk,
        mtp_num_layers=mtp_layers,
        mtp_mlp_type=MLP_MOE if moe else MLP_DENSE,
        weight_prefix="model.language_model." if architecture in _CONDITIONAL else "model.",
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=_eos_ids(raw, text),
        ngram_memory=NgramMemoryConfig.from_dict(raw["ngram_memory"], num_layers) if raw.get("ngram_memory") else None,
        **linear,
    )
