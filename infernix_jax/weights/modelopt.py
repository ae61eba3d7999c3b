"""Read NVIDIA ModelOpt (NVFP4, FP8) and block-FP8 checkpoints into the quantized weight types.

Two jobs, both used by the Hugging Face loader once per Linear:

* `read_quant_config(model_dir)` parses the quantization metadata, in either of its forms:
  `hf_quant_config.json` ({"producer", "quantization": {"quant_algo", "group_size",
  "exclude_modules"}}) or `config.json["quantization_config"]` ({"quant_method": "modelopt",
  "quant_algo", "ignore", "config_groups"} or Qwen/DeepSeek {"quant_method": "fp8",
  "weight_block_size", "modules_to_not_convert"}).
* `build_linear(get_tensor, prefix, qcfg)` turns the tensors of one Linear `<prefix>` into a
  plain array (unquantized or excluded modules) or an `NVFP4Weight` / `FP8Weight` holding the
  stored bytes unchanged (bit-exact: nothing is re-quantized or re-laid-out).

Tensors per Linear (weight [N, K]): NVFP4 `weight` u8 [N, K/2], `weight_scale` e4m3 [N, K/16],
`weight_scale_2` f32 scalar, `input_scale` f32 scalar; FP8 `weight` e4m3 [N, K] with
`weight_scale` f32 scalar (per tensor) or `weight_scale_inv` f32 [ceil(N/b), ceil(K/b)] (block).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from infernix_jax.weights.quant import FP8Weight, NVFP4Weight

# quant_algo values we load; others (W4A8 AWQ, INT4, mixed precision) raise with the name.
SUPPORTED_ALGOS = ("NVFP4", "FP8", "FP8_PB_WO", "FP8_BLOCK")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint's quantization metadata says, in one shape whatever file it came from."""

    quant_algo: str  # "NVFP4", "FP8" (per tensor), "FP8_PB_WO" / "FP8_BLOCK" (128x128 blocks)
    group_size: int | None = None  # NVFP4 block along K (16)
    weight_block_size: tuple[int, int] | None = None  # block FP8 (rows, cols), e.g. (128, 128)
    exclude_modules: tuple[str, ...] = ()  # fnmatch wildcards of modules kept unquantized
    kv_cache_quant_algo: str | None = None  # "FP8" or None
    producer: str | None = None  # e.g. "modelopt 0.31.0"
    source: str = ""  # the file it was read from: "hf_quant_config.json" or "config.json"

    def is_excluded(self, module: str) -> bool:
        """True when `module` (a dotted name like "model.layers.0.mlp.gate") stays unquantized.

        An entry matches the module or any of its parents as an fnmatch wildcard ("lm_head",
        "*.mlp.gate", "model.layers.*.linear_attn*"); an entry without wildcards also matches
        as a run of whole dotted components ("mlp.gate" excludes "model.layers.3.mlp.gate" but
        not "model.layers.3.mlp.gate_proj"), which is how `modules_to_not_convert` is written.
        """
        parts = module.split(".")
        ancestors = [".".join(parts[: i + 1]) for i in range(len(parts))]
        for pattern in self.exclude_modules:
            if any(fnmatch.fnmatchcase(a, pattern) for a in ancestors):
                return True
            if not any(c in pattern for c in "*?[") and f".{pattern}." in f".{module}.":
                return True
        return False


def _algo_from_config_groups(groups: dict[str, Any]) -> tuple[str, int | None]:
    """Infer quant_algo from compressed-tensors style `config_groups` when quant_algo is absent."""
    for group in groups.values():
        weights = group.get("weights") or {}
        bits, kind = weights.get("num_bits"), weights.get("type")
        if bits == 4 and kind == "float":
            return "NVFP4", weights.get("group_size", 16)
        if bits == 8 and kind == "float":
            return "FP8", None
    raise ValueError(f"cannot tell the quantization format from config_groups {groups}")


def _from_hf_quant_config(data: dict[str, Any]) -> QuantConfig:
    q = data.get("quantization")
    if not isinstance(q, dict) or "quant_algo" not in q:
        raise ValueError("hf_quant_config.json has no quantization.quant_algo")
    producer = data.get("producer") or {}
    return QuantConfig(
        quant_algo=str(q["quant_algo"]).upper(),
        group_size=q.get("group_size"),
        weight_block_size=(128, 128) if str(q["quant_algo"]).upper() == "FP8_PB_WO" else None,
        exclude_modules=tuple(q.get("exclude_modules") or ()),
        kv_cache_quant_algo=q.get("kv_cache_quant_algo"),
        producer=" ".join(str(v) for v in (producer.get("name"), producer.get("version")) if v) or None,
        source="hf_quant_config.json",
    )


def _from_quantization_config(q: dict[str, Any]) -> QuantConfig:
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":  # Qwen / DeepSeek block FP8
        block = q.get("weight_block_size")
        return QuantConfig(
            quant_algo="FP8_BLOCK" if block else "FP8",
            weight_block_size=tuple(block) if block else None,
            exclude_modules=tuple(q.get("modules_to_not_convert") or ()),
            source="config.json",
        )
    if method != "modelopt":
        raise ValueError(
            f"quantization_config.quant_method={q.get('quant_method')!r} is not a ModelOpt or "
            f"FP8 checkpoint; supported: 'modelopt', 'fp8'"
        )
    algo, group_size = q.get("quant_algo"), q.get("group_size")
    if algo is None:
        algo, group_size = _algo_from_config_groups(q.get("config_groups") or {})
    algo = str(algo).upper()
    kv = q.get("kv_cache_quant_algo") or (q.get("kv_cache_scheme") or {}).get("type")
    producer = q.get("producer") or {}
    return QuantConfig(
        quant_algo=algo,
        group_size=group_size if group_size is not None else (16 if algo == "NVFP4" else None),
        weight_block_size=(128, 128) if algo == "FP8_PB_WO" else None,
        exclude_modules=tuple(q.get("ignore") or q.get("exclude_modules") or ()),
        kv_cache_quant_algo=str(kv).upper() if kv else None,
        producer=" ".join(str(v) for v in (producer.get("name"), producer.get("version")) if v) or None,
        source="config.json",
    )


def read_quant_config(model_dir: str | os.PathLike) -> QuantConfig | None:
    """The checkpoint's quantization config, or None for an unquantized checkpoint.

    `hf_quant_config.json` wins when both it and `config.json["quantization_config"]` exist
    (ModelOpt writes both in newer exports and they agree).
    """
    legacy = os.path.join(model_dir, "hf_quant_config.json")
    if os.path.exists(legacy):
        with open(legacy) as f:
            qcfg = _from_hf_quant_config(json.load(f))
    else:
        config_path = os.path.join(model_dir, "config.json")
        if not os.path.exists(config_path):
            return None
        with open(config_path) as f:
            q = json.load(f).get("quantization_config")
        if not q:
            return None
        qcfg = _from_quantization_config(q)
    if qcfg.quant_algo not in SUPPORTED_ALGOS:
        raise ValueError(
            f"quant_algo={qcfg.quant_algo!r} ({qcfg.source}) is not supported; "
            f"supported: {', '.join(SUPPORTED_ALGOS)}"
        )
    return qcfg


def _maybe(get_tensor: Callable[[str], np.ndarray], name: str) -> np.ndarray | None:
    try:
        return get_tensor(name)
    except KeyError:
        return None


def _as_e4m3(a: np.ndarray, name: str) -> np.ndarray:
    """float8_e4m3fn view of a tensor that a reader returned as e4m3 or as its raw uint8 bytes."""
    a = np.asarray(a)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return a
    if a.dtype == np.uint8:
        return a.view(ml_dtypes.float8_e4m3fn)
    raise ValueError(f"{name} must be float8_e4m3fn (or its uint8 bytes); got {a.dtype}")


def _scalar_f32(a: np.ndarray, name: str) -> jnp.ndarray:
    a = np.asarray(a)
    if a.size != 1:
        raise ValueError(f"{name} must be a scalar; got shape {a.shape}")
    return jnp.asarray(a.astype(np.float32).reshape(()))


def _build_nvfp4(get_tensor, prefix: str, weight: np.ndarray) -> NVFP4Weight:
    n, half_k = weight.shape
    scale = _as_e4m3(get_tensor(f"{prefix}.weight_scale"), f"{prefix}.weight_scale")
    if scale.shape != (n, 2 * half_k // 16):
        raise ValueError(
            f"{prefix}.weight_scale has shape {scale.shape}; expected [N, K/16] = "
            f"{(n, 2 * half_k // 16)} for weight {weight.shape}"
        )
    input_scale = _maybe(get_tensor, f"{prefix}.input_scale")
    return NVFP4Weight(
        packed=jnp.asarray(weight),
        block_scale=jnp.asarray(scale),
        tensor_scale=_scalar_f32(get_tensor(f"{prefix}.weight_scale_2"), f"{prefix}.weight_scale_2"),
        input_scale=None if input_scale is None else _scalar_f32(input_scale, f"{prefix}.input_scale"),
    )


def _build_fp8(get_tensor, prefix: str, weight: np.ndarray, qcfg: QuantConfig) -> FP8Weight:
    data = jnp.asarray(_as_e4m3(weight, f"{prefix}.weight"))
    n, k = weight.shape
    input_scale = _maybe(get_tensor, f"{prefix}.input_scale")
    input_scale = None if input_scale is None else _scalar_f32(input_scale, f"{prefix}.input_scale")
    scale_inv = _maybe(get_tensor, f"{prefix}.weight_scale_inv")
    if scale_inv is not None:
        rows, cols = qcfg.weight_block_size or (128, 128)
        if rows != cols:
            raise ValueError(f"{prefix}: only square FP8 blocks are supported; got {(rows, cols)}")
        want = (-(-n // rows), -(-k // cols))
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"{prefix}.weight_scale_inv has shape {scale_inv.shape}; expected {want}")
        return FP8Weight(
            data=data,
            scale=jnp.asarray(np.asarray(scale_inv, np.float32)),
            block_size=rows,
            input_scale=input_scale,
        )
    scale = _maybe(get_tensor, f"{prefix}.weight_scale")
    if scale is None:
        raise ValueError(f"{prefix}.weight is float8 but neither weight_scale nor weight_scale_inv exists")
    scale = np.asarray(scale, np.float32)
    if scale.size == 1:
        return FP8Weight(data=data, scale=jnp.asarray(scale.reshape(())), input_scale=input_scale)
    if scale.ndim == 2 and qcfg.weight_block_size is not None:  # FP8_PB_WO stores block scales here
        rows = qcfg.weight_block_size[0]
        return FP8Weight(data=data, scale=jnp.asarray(scale), block_size=rows, input_scale=input_scale)
    raise ValueError(f"{prefix}.weight_scale of shape {scale.shape} (per-channel FP8) is not supported")


def build_linear(get_tensor: Callable[[str], np.ndarray], prefix: str, qcfg: QuantConfig | None) -> Any:
    """The weight of Linear `prefix` as a plain array or a quantized type, from its stored tensors.

    `get_tensor(name)` returns the named tensor as a numpy array and raises KeyError when it is
    absent; e4m3 tensors may come back as ml_dtypes.float8_e4m3fn or as their uint8 bytes. The
    format follows the stored dtype (uint8 weight: NVFP4; e4m3 weight: FP8), so a module that the
    exclude list missed but the exporter left in bf16 still loads as bf16.
    """
    weight = np.asarray(get_tensor(f"{prefix}.weight"))
    if qcfg is None or qcfg.is_excluded(prefix):
        if weight.dtype == np.uint8:
            raise ValueError(f"{prefix} is excluded from quantization but its weight is packed uint8")
        return jnp.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"{prefix}.weight must be 2-D [N, K]; got shape {weight.shape}")
    if weight.dtype == np.uint8 and qcfg.quant_algo == "NVFP4":
        return _build_nvfp4(get_tensor, prefix, weight)
    has_fp8_scale = _maybe(get_tensor, f"{prefix}.weight_scale_inv") is not None or (
        _maybe(get_tensor, f"{prefix}.weight_scale") is not None
    )
    if weight.dtype == ml_dtypes.float8_e4m3fn or (weight.dtype == np.uint8 and has_fp8_scale):
        return _build_fp8(get_tensor, prefix, weight, qcfg)
    if weight.dtype == np.uint8:
        raise ValueError(f"{prefix}.weight is uint8 but quant_algo={qcfg.quant_algo}")
    return jnp.asarray(weight)
