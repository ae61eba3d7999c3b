"""`Params` -> Hugging Face tensors, the inverse of weights/hf.py's table.

Used to ship checkpoints we train (the demo model) in the exact layout transformers and other
engines load: Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` when the config says so, per-expert
expert tensors, `conv1d.weight` as [C, 1, K], and the `mtp.*` head.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from infernix_jax.config import ModelConfig
from infernix_jax.model.params import GDNParams, LayerParams, MLPParams, MoEParams, Params
from infernix_jax.weights.safetensors_io import save_safetensors


def _np(x, dtype) -> np.ndarray:
    return np.asarray(jax.device_get(x)).astype(dtype)


def fused_qkvz(cfg: ModelConfig, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Split [all q | all k | all v] + z rows -> Qwen3-Next's per-key-head groups [q_g | k_g | v_g | z_g]."""
    hk, dk, dv = cfg.linear_num_k_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim
    r = cfg.linear_num_v_heads // hk
    key_dim = hk * dk
    q = qkv[:key_dim].reshape(hk, dk, -1)
    k = qkv[key_dim : 2 * key_dim].reshape(hk, dk, -1)
    v = qkv[2 * key_dim :].reshape(hk, r * dv, -1)
    zz = z.reshape(hk, r * dv, -1)
    return np.concatenate([q, k, v, zz], axis=1).reshape(-1, qkv.shape[-1])


def fused_ba(cfg: ModelConfig, b: np.ndarray, a: np.ndarray) -> np.ndarray:
    hk = cfg.linear_num_k_heads
    r = cfg.linear_num_v_heads // hk
    return np.concatenate([b.reshape(hk, r, -1), a.reshape(hk, r, -1)], axis=1).reshape(-1, b.shape[-1])


def _mlp(out: dict, prefix: str, p: MLPParams, dtype) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{prefix}{name}.weight"] = _np(getattr(p, name), dtype)


def _moe(out: dict, prefix: str, p: MoEParams, dtype) -> None:
    out[prefix + "gate.weight"] = _np(p.router, dtype)
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked = _np(getattr(p, name), dtype)
        for e in range(stacked.shape[0]):
            out[f"{prefix}experts.{e}.{name}.weight"] = stacked[e]
    if p.shared is not None:
        _mlp(out, prefix + "shared_expert.", p.shared, dtype)
        out[prefix + "shared_expert_gate.weight"] = _np(p.shared_gate, dtype)


def _gdn(out: dict, prefix: str, p: GDNParams, cfg: ModelConfig, dtype) -> None:
    qkv, z = _np(p.in_proj_qkv, dtype), _np(p.in_proj_z, dtype)
    b, a = _np(p.in_proj_b, dtype), _np(p.in_proj_a, dtype)
    if cfg.gdn_projection == "fused":
        out[prefix + "in_proj_qkvz.weight"] = fused_qkvz(cfg, qkv, z)
        out[prefix + "in_proj_ba.weight"] = fused_ba(cfg, b, a)
    else:
        out[prefix + "in_proj_qkv.weight"] = qkv
        out[prefix + "in_proj_z.weight"] = z
        out[prefix + "in_proj_b.weight"] = b
        out[prefix + "in_proj_a.weight"] = a
    conv = _np(p.conv_weight, dtype)
    out[prefix + "conv1d.weight"] = conv.reshape(conv.shape[0], 1, conv.shape[1])
    out[prefix + "dt_bias"] = _np(p.dt_bias, dtype)
    out[prefix + "A_log"] = _np(p.A_log, np.float32)
    out[prefix + "norm.weight"] = _np(p.norm, dtype)
    out[prefix + "out_proj.weight"] = _np(p.out_proj, dtype)


def _layer(out: dict, prefix: str, p: LayerParams, cfg: ModelConfig, dtype) -> None:
    out[prefix + "input_layernorm.weight"] = _np(p.input_norm, dtype)
    out[prefix + "post_attention_layernorm.weight"] = _np(p.post_norm, dtype)
    if p.attn is not None:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{prefix}self_attn.{name}.weight"] = _np(getattr(p.attn, name), dtype)
            bias = getattr(p.attn, name[0] + "_bias")
            if bias is not None:
                out[f"{prefix}self_attn.{name}.bias"] = _np(bias, dtype)
        out[prefix + "self_attn.q_norm.weight"] = _np(p.attn.q_norm, dtype)
        out[prefix + "self_attn.k_norm.weight"] = _np(p.attn.k_norm, dtype)
    else:
        _gdn(out, prefix + "linear_attn.", p.gdn, cfg, dtype)
    if p.moe is not None:
        _moe(out, prefix + "mlp.", p.moe, dtype)
    else:
        _mlp(out, prefix + "mlp.", p.mlp, dtype)
    if p.ngram is not None:
        for name in ("key_proj", "value_proj", "key_norm", "query_norm"):
            out[f"{prefix}ngram_memory.{name}.weight"] = _np(getattr(p.ngram, name), dtype)


def params_to_hf(params: Params, cfg: ModelConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """Every tensor under its Hugging Face name, in `dtype` (A_log stays float32)."""
    out: dict[str, np.ndarray] = {}
    prefix = cfg.weight_prefix
    out[prefix + "embed_tokens.weight"] = _np(params.embed, dtype)
    out[prefix + "norm.weight"] = _np(params.final_norm, dtype)
    for i, layer in enumerate(params.layers):
        _layer(out, f"{prefix}layers.{i}.", layer, cfg, dtype)
    if params.lm_head is not None:
        out["lm_head.weight"] = _np(params.lm_head, dtype)
    if params.mtp is not None:
        m = params.mtp
        out["mtp.fc.weight"] = _np(m.fc, dtype)
        out["mtp.pre_fc_norm_embedding.weight"] = _np(m.pre_fc_norm_embedding, dtype)
        out["mtp.pre_fc_norm_hidden.weight"] = _np(m.pre_fc_norm_hidden, dtype)
        out["mtp.norm.weight"] = _np(m.norm, dtype)
        for j, layer in enumerate(m.layers):
            _layer(out, f"mtp.layers.{j}.", layer, cfg, dtype)
    return out


def save_hf(params: Params, cfg: ModelConfig, path: str | os.PathLike, dtype=np.float32,
            max_shard_bytes: int | None = None) -> None:
    """Write model.safetensors into the directory `path`, or shards of at most `max_shard_bytes`
    (model-0000i-of-0000n.safetensors with model.safetensors.index.json) when it is given."""
    tensors = params_to_hf(params, cfg, dtype)
    if max_shard_bytes is None:
        save_safetensors(tensors, os.path.join(path, "model.safetensors"))
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, os.path.join(path, file))
        weight_map.update({name: file for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
