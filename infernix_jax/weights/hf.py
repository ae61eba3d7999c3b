"""Hugging Face checkpoint -> `Params`: the name mapping in one table, and the loader.

Each pytree leaf of a decoder layer has one or more `Rule`s: the Hugging Face tensor names it
reads (relative to `layers.{i}.`) and a transform. Alternatives cover the layouts the Qwen3
family ships: fused (Qwen3-Next `in_proj_qkvz` / `in_proj_ba`) or split (Qwen3.5) GDN
projections, per-expert (`experts.{e}.gate_proj`) or fused (`experts.gate_up_proj`) experts.
The first rule whose tensors are all present wins. Every problem (missing, unexpected or
mis-shaped tensors) is collected and reported in one error.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from infernix_jax.config import ModelConfig
from infernix_jax.model.params import Decl, Params, declare_params, is_routed_expert_leaf, param_dtype
from infernix_jax.weights.modelopt import QuantConfig, build_weight, read_quant_config
from infernix_jax.weights.quant import FP8Weight, NVFP4Weight, QuantizedWeight
from infernix_jax.weights.safetensors_io import CheckpointError, SafetensorsCheckpoint

Transform = Callable[..., np.ndarray]


@dataclass(frozen=True)
class Rule:
    """Fill the leaf at `path` from the tensors `names` (templates with {e} for the expert index)."""

    path: str
    names: tuple[str, ...]
    transform: Transform | None = None  # (cfg, *arrays) -> array; None: the single tensor as is
    per_expert: bool = False  # names contain {e}: read every expert and stack them


# ---- transforms ------------------------------------------------------------------------------


def _fused_qkvz_parts(cfg: ModelConfig, w: np.ndarray) -> tuple[np.ndarray, ...]:
    """Qwen3-Next's in_proj_qkvz rows are grouped per k-head: [q_g | k_g | v_g (r heads) | z_g (r heads)]."""
    hk, dk, dv = cfg.linear_num_k_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim
    r = cfg.linear_num_v_heads // hk
    grouped = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
    q = grouped[:, :dk]
    k = grouped[:, dk : 2 * dk]
    v = grouped[:, 2 * dk : 2 * dk + r * dv]
    z = grouped[:, 2 * dk + r * dv :]
    d = w.shape[-1]
    return q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d), z.reshape(-1, d)


def qkv_from_fused(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    q, k, v, _ = _fused_qkvz_parts(cfg, w)
    return np.concatenate([q, k, v], axis=0)


def z_from_fused(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    return _fused_qkvz_parts(cfg, w)[3]


def _fused_ba_parts(cfg: ModelConfig, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """in_proj_ba rows are grouped per k-head: [b (r) | a (r)]."""
    hk = cfg.linear_num_k_heads
    r = cfg.linear_num_v_heads // hk
    grouped = w.reshape(hk, 2 * r, -1)
    return grouped[:, :r].reshape(-1, w.shape[-1]), grouped[:, r:].reshape(-1, w.shape[-1])


def b_from_fused(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    return _fused_ba_parts(cfg, w)[0]


def a_from_fused(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    return _fused_ba_parts(cfg, w)[1]


def conv_weight(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], w.shape[-1])  # [C, 1, K] -> [C, K]


def gate_from_fused_experts(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    return w[:, : cfg.moe_intermediate_size]  # gate_up_proj [E, 2I, D]: gate rows first


def up_from_fused_experts(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    return w[:, cfg.moe_intermediate_size :]


# ---- the table -----------------------------------------------------------------------------------

ATTN = "self_attn."
GDN = "linear_attn."

LAYER_RULES: tuple[Rule, ...] = (
    Rule("input_norm", ("input_layernorm.weight",)),
    Rule("post_norm", ("post_attention_layernorm.weight",)),
    # full attention
    Rule("attn.q_proj", (ATTN + "q_proj.weight",)),
    Rule("attn.k_proj", (ATTN + "k_proj.weight",)),
    Rule("attn.v_proj", (ATTN + "v_proj.weight",)),
    Rule("attn.o_proj", (ATTN + "o_proj.weight",)),
    Rule("attn.q_norm", (ATTN + "q_norm.weight",)),
    Rule("attn.k_norm", (ATTN + "k_norm.weight",)),
    Rule("attn.q_bias", (ATTN + "q_proj.bias",)),
    Rule("attn.k_bias", (ATTN + "k_proj.bias",)),
    Rule("attn.v_bias", (ATTN + "v_proj.bias",)),
    Rule("attn.o_bias", (ATTN + "o_proj.bias",)),
    # Gated DeltaNet: split (Qwen3.5) or fused (Qwen3-Next) projections
    Rule("gdn.in_proj_qkv", (GDN + "in_proj_qkv.weight",)),
    Rule("gdn.in_proj_qkv", (GDN + "in_proj_qkvz.weight",), qkv_from_fused),
    Rule("gdn.in_proj_z", (GDN + "in_proj_z.weight",)),
    Rule("gdn.in_proj_z", (GDN + "in_proj_qkvz.weight",), z_from_fused),
    Rule("gdn.in_proj_b", (GDN + "in_proj_b.weight",)),
    Rule("gdn.in_proj_b", (GDN + "in_proj_ba.weight",), b_from_fused),
    Rule("gdn.in_proj_a", (GDN + "in_proj_a.weight",)),
    Rule("gdn.in_proj_a", (GDN + "in_proj_ba.weight",), a_from_fused),
    Rule("gdn.conv_weight", (GDN + "conv1d.weight",), conv_weight),
    Rule("gdn.dt_bias", (GDN + "dt_bias",)),
    Rule("gdn.A_log", (GDN + "A_log",)),
    Rule("gdn.norm", (GDN + "norm.weight",)),
    Rule("gdn.out_proj", (GDN + "out_proj.weight",)),
    # dense MLP
    Rule("mlp.gate_proj", ("mlp.gate_proj.weight",)),
    Rule("mlp.up_proj", ("mlp.up_proj.weight",)),
    Rule("mlp.down_proj", ("mlp.down_proj.weight",)),
    # MoE: per-expert or fused experts, shared expert with its gate
    Rule("moe.router", ("mlp.gate.weight",)),
    Rule("moe.gate_proj", ("mlp.experts.{e}.gate_proj.weight",), per_expert=True),
    Rule("moe.gate_proj", ("mlp.experts.gate_up_proj",), gate_from_fused_experts),
    Rule("moe.up_proj", ("mlp.experts.{e}.up_proj.weight",), per_expert=True),
    Rule("moe.up_proj", ("mlp.experts.gate_up_proj",), up_from_fused_experts),
    Rule("moe.down_proj", ("mlp.experts.{e}.down_proj.weight",), per_expert=True),
    Rule("moe.down_proj", ("mlp.experts.down_proj",)),
    Rule("moe.shared.gate_proj", ("mlp.shared_expert.gate_proj.weight",)),
    Rule("moe.shared.up_proj", ("mlp.shared_expert.up_proj.weight",)),
    Rule("moe.shared.down_proj", ("mlp.shared_expert.down_proj.weight",)),
    Rule("moe.shared_gate", ("mlp.shared_expert_gate.weight",)),
    # n-gram memory's dense parts (our own names; the table itself is a separate volume)
    Rule("ngram.key_proj", ("ngram_memory.key_proj.weight",)),
    Rule("ngram.value_proj", ("ngram_memory.value_proj.weight",)),
    Rule("ngram.key_norm", ("ngram_memory.key_norm.weight",)),
    Rule("ngram.query_norm", ("ngram_memory.query_norm.weight",)),
)

# Global tensors, relative to the text model's prefix (`model.` or `model.language_model.`)
MODEL_RULES = (Rule("embed", ("embed_tokens.weight",)), Rule("final_norm", ("norm.weight",)))
MTP_RULES = (
    Rule("fc", ("fc.weight",)),
    Rule("pre_fc_norm_embedding", ("pre_fc_norm_embedding.weight",)),
    Rule("pre_fc_norm_hidden", ("pre_fc_norm_hidden.weight",)),
    Rule("norm", ("norm.weight",)),
)

# Tensors a checkpoint may carry that the text model does not use.
IGNORED = ("model.visual.*", "visual.*", "*.rotary_emb.inv_freq", "model.vision_tower.*", "mtp.*")


# ---- loading -------------------------------------------------------------------------------------


def path_str(path_keys) -> str:
    """A pytree key path as a dotted string, e.g. ("layers", 3, "attn", "q_proj") -> "layers.3.attn.q_proj"."""
    parts = []
    for key in path_keys:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(getattr(key, "key", key)))
    return ".".join(parts)


def leaf_paths(tree) -> dict[str, Decl]:
    """Flatten a declaration tree into {dotted path: Decl}."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Decl))[0]
    return {path_str(path): decl for path, decl in flat}


def _transform_quantized(transform: Transform, cfg: ModelConfig, w: QuantizedWeight) -> QuantizedWeight:
    """Apply a row transform (a split or slice of the N axis) to a quantized weight.

    The transforms here only regroup rows ([.., N, K] -> [.., N', K]); every full-rank leaf of
    NVFP4 (packed, block_scale) and per-tensor FP8 (data) is indexed by the same rows, and the
    per-tensor scales are shared by all rows, so regrouping the row leaves is exact.
    """
    if isinstance(w, FP8Weight) and w.block_size is not None:
        raise CheckpointError(
            f"{transform.__name__}: block-scaled FP8 rows cannot be regrouped (the 128-row scale blocks "
            f"straddle the split); this layout is not supported"
        )
    if not isinstance(w, (NVFP4Weight, FP8Weight)):
        raise CheckpointError(f"{transform.__name__}: cannot regroup the rows of a {type(w).__name__}")
    rank = len(w.shape)
    return jax.tree.map(lambda a: transform(cfg, a) if np.ndim(a) == rank else a, w)


def _stack(values: list) -> np.ndarray | QuantizedWeight:
    """Stack per-expert values (plain arrays or quantized weights alike) on a new leading axis."""
    return jax.tree.map(lambda *xs: np.stack(xs), *values)


class _Reader:
    """Resolves rules against a checkpoint, recording every tensor it reads and every problem."""

    def __init__(self, ckpt: SafetensorsCheckpoint, cfg: ModelConfig, qcfg: QuantConfig | None):
        self.ckpt, self.cfg, self.qcfg = ckpt, cfg, qcfg
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.misshaped: list[str] = []

    def _get(self, name: str) -> np.ndarray:
        if name not in self.ckpt:
            raise KeyError(name)
        self.used.add(name)
        return self.ckpt.get(name)

    def _load(self, name: str):
        """One stored weight: its array, or its quantized type with the stored bytes (ModelOpt)."""
        if self.qcfg is None:
            return self._get(name)
        try:
            return build_weight(self._get, name, self.qcfg)
        except ValueError as e:
            raise CheckpointError(f"{name}: {e}") from e

    def _names(self, rule: Rule, base: str) -> list[str] | None:
        if rule.per_expert:
            names = [base + n.format(e=e) for n in rule.names for e in range(self.cfg.num_experts)]
        else:
            names = [base + n for n in rule.names]
        return names if all(n in self.ckpt for n in names) else None

    def read(self, path: str, rules: list[Rule], base: str, decl: Decl):
        for rule in rules:
            names = self._names(rule, base)
            if names is None:
                continue
            try:
                arrays = [self._load(n) for n in names]
            except KeyError as e:  # a scale that a quantized weight needs
                self.missing.append(f"{e.args[0]} (for {names[0]})")
                return None
            if rule.per_expert:
                value = _stack(arrays)
            elif rule.transform is not None:
                if isinstance(arrays[0], QuantizedWeight):
                    value = _transform_quantized(rule.transform, self.cfg, arrays[0])
                else:
                    value = rule.transform(self.cfg, *arrays)
            else:
                value = arrays[0]
            if tuple(value.shape) != tuple(decl.shape):
                self.misshaped.append(
                    f"{', '.join(names[:1])}{' ...' if len(names) > 1 else ''}: expected {list(decl.shape)} "
                    f"for {path}, found {list(value.shape)}"
                )
                return None
            return value
        tried = " or ".join(base + r.names[0].replace("{e}", "<e>") for r in rules) or path
        self.missing.append(tried)
        return None


def _rules_by_path(rules: tuple[Rule, ...]) -> dict[str, list[Rule]]:
    by_path: dict[str, list[Rule]] = {}
    for rule in rules:
        by_path.setdefault(rule.path, []).append(rule)
    return by_path


class HFWeightSource:
    """A Hugging Face checkpoint read one `Params` leaf at a time, on the host.

    `leaves` maps each dotted leaf path ("layers.3.moe.gate_proj") to its declaration; `read(path)`
    returns that leaf as a numpy array or a quantized weight with numpy leaves (ModelOpt NVFP4 /
    FP8 checkpoints keep their stored bytes); `check()` raises one CheckpointError listing every
    missing, unexpected or mis-shaped tensor seen. The loader and the converter both use it, so a
    converted artifact holds exactly what loading the folder would.
    """

    def __init__(self, model_dir: str | os.PathLike, cfg: ModelConfig, with_mtp: bool = True):
        self.model_dir, self.cfg = model_dir, cfg
        self.ckpt = SafetensorsCheckpoint(model_dir)
        self.qcfg = read_quant_config(model_dir)
        self.with_mtp = (
            with_mtp and cfg.mtp_num_layers > 0 and any(n.startswith("mtp.") for n in self.ckpt.names())
        )
        self.decls = declare_params(cfg, with_mtp=self.with_mtp)
        self.leaves = leaf_paths(self.decls)
        self._reader = _Reader(self.ckpt, cfg, self.qcfg)
        self._layer_rules = _rules_by_path(LAYER_RULES)
        self._model_rules = _rules_by_path(MODEL_RULES)
        self._mtp_rules = _rules_by_path(MTP_RULES)

    def read(self, path: str):
        """The leaf at `path` on the host, or None when its tensors are missing or mis-shaped."""
        parts = path.split(".")
        prefix = self.cfg.weight_prefix
        if parts[0] == "layers":
            base, sub, rules = f"{prefix}layers.{parts[1]}.", ".".join(parts[2:]), self._layer_rules
        elif parts[0] == "mtp" and parts[1] == "layers":
            base, sub, rules = f"mtp.layers.{parts[2]}.", ".".join(parts[3:]), self._layer_rules
        elif parts[0] == "mtp":
            base, sub, rules = "mtp.", ".".join(parts[1:]), self._mtp_rules
        elif parts[0] == "lm_head":
            base, sub, rules = "", "lm_head", {"lm_head": [Rule("lm_head", ("lm_head.weight",))]}
        else:
            base, sub, rules = prefix, path, self._model_rules
        return self._reader.read(path, rules.get(sub, []), base, self.leaves[path])

    def check(self) -> None:
        """Raise CheckpointError naming every problem met so far and every tensor never read."""
        reader, cfg = self._reader, self.cfg
        unexpected = [
            n
            for n in self.ckpt.names()
            if n not in reader.used
            and not any(fnmatch.fnmatch(n, pat) for pat in IGNORED if not (self.with_mtp and pat == "mtp.*"))
            and not (cfg.tie_word_embeddings and n == "lm_head.weight")
            and not (self.qcfg is not None and n.endswith(_KV_SCALE_SUFFIXES))
        ]
        problems = []
        if reader.missing:
            problems.append(f"missing tensors ({len(reader.missing)}): " + "; ".join(reader.missing[:20]))
        if reader.misshaped:
            problems.append(f"mis-shaped tensors ({len(reader.misshaped)}): " + "; ".join(reader.misshaped[:20]))
        if unexpected:
            problems.append(f"unexpected tensors ({len(unexpected)}): " + "; ".join(sorted(unexpected)[:20]))
        if problems:
            raise CheckpointError(
                f"checkpoint {self.model_dir} does not match {cfg.architecture}: " + " | ".join(problems)
            )


# KV-cache scales that ModelOpt stores beside the attention projections (`self_attn.k_proj.k_scale`)
# when it calibrated an FP8 KV cache; the KV-cache format is the engine's choice, so they are unused.
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def to_device(value, dtype=None):
    """A host leaf on the default device: plain arrays cast to `dtype` (None keeps theirs); quantized
    weights keep their stored dtypes."""
    if isinstance(value, QuantizedWeight):
        return jax.tree.map(jnp.asarray, value)
    return jnp.asarray(value, dtype=dtype)


def to_host(value, dtype=None):
    """A leaf kept in host memory as numpy: plain arrays cast to `dtype`, quantized weights as stored."""
    if isinstance(value, QuantizedWeight):
        return jax.tree.map(np.asarray, value)
    return np.asarray(value, dtype=dtype)


# where a loader puts the decoder layers' routed expert stacks: on the device (the plain model),
# in host RAM (numpy, for experts beyond device memory), or nowhere yet ("artifact": shapes only,
# read expert by expert from the artifact by the offload; docs/experts.md)
EXPERTS_AT = ("device", "host", "artifact")


def place_params(decls: Params, values: dict, dtype, experts: str = "device") -> Params:
    """Params from host `values` (dotted path -> leaf): on the default device, except routed expert
    stacks when `experts` is "host" (kept as numpy) or "artifact" (`values` holds their shapes
    only). Leaves take `dtype` (A_log float32)."""
    if experts not in EXPERTS_AT:
        raise ValueError(f"experts must be one of {EXPERTS_AT}, got {experts!r}")

    def place(path_keys, decl: Decl):
        path, leaf_dtype = path_str(path_keys), param_dtype(decl, dtype)
        if experts == "device" or not is_routed_expert_leaf(path):
            return to_device(values[path], leaf_dtype)
        if experts == "host":
            return to_host(values[path], leaf_dtype)
        return values[path]  # "artifact": shapes only (see Artifact.abstract)

    return jax.tree_util.tree_map_with_path(place, decls, is_leaf=lambda x: isinstance(x, Decl))


def load_params(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    dtype=jnp.float32,
    with_mtp: bool = True,
    progress: bool = True,
    experts: str = "device",
) -> Params:
    """Read a Hugging Face checkpoint into `Params` on the default device, cast to `dtype`.

    ModelOpt NVFP4 / FP8 checkpoints (hf_quant_config.json or config.json's quantization_config)
    load as `NVFP4Weight` / `FP8Weight` leaves holding the stored bytes; excluded modules and
    everything that is not a quantized Linear take `dtype` like an unquantized checkpoint.
    experts="host" keeps the routed expert stacks in host RAM (for `gpu_expert_budget`).
    Raises CheckpointError listing every missing, unexpected or mis-shaped tensor at once.
    """
    if experts == "artifact":
        raise ValueError(
            "experts can stay on disk only in a converted artifact (python -m conversion); "
            "a Hugging Face folder's experts load into host RAM"
        )
    source = HFWeightSource(model_dir, cfg, with_mtp)
    values = {
        path: source.read(path)
        for path in tqdm(source.leaves, desc="loading weights", disable=not progress, unit="tensor")
    }
    source.check()
    return place_params(source.decls, values, dtype, experts)
