"""Read NVIDIA ModelOpt (NVFP4, FP8) and block-FP8 checkpoints into the quantized weight types.

Two jobs, both used by the Hugging Face loader once per Linear:

* `read_quant_config(model_dir)` parses the quantization metadata, in either of its forms:
  `hf_quant_config.json` ({"producer", "quantization": {"quant_algo", "group_size",
  "exclude_modules"}}) or `config.json["quantization_config"]` ({"quant_method": "modelopt",
  "quant_algo", "ignore", "config_groups"} or Qwen/DeepSeek {"quant_method": "fp8",
  "weight_block_size", "modules_to_not_convert"}).
* `build_weight(get_tensor, weight_name, qcfg)` (and `build_linear` for `<prefix>.weight`) turns
  the tensors of one Linear into a plain numpy array (unquantized or excluded modules) or an
  `NVFP4Weight` / `FP8Weight` with numpy leaves holding the stored bytes unchanged (bit-exact:
  nothing is re-quantized or re-laid-out). The loader moves them to the device.

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


@dataclasses.dataclass(frozen=True)
class LinearNames:
    """The stored tensor names of one Linear weight and its scales.

    A Linear `<p>` stores `<p>.weight` with `<p>.weight_scale`, `<p>.weight_scale_2`,
    `<p>.input_scale`, `<p>.weight_scale_inv`. A fused expert parameter with no `.weight`
    suffix (`mlp.experts.gate_up_proj` [E, 2I, D]) keeps its scales beside it as
    `<name>_weight_scale` and so on (our convention for fused quantized experts).
    """

    weight: str
    module: str  # the dotted module name that exclude lists match
    weight_scale: str
    weight_scale_2: str
    input_scale: str
    weight_scale_inv: str

    @classmethod
    def of(cls, weight_name: str) -> LinearNames:
        if weight_name.endswith(".weight"):
            module, base = weight_name[: -len(".weight")], weight_name[: -len("weight")]
        else:
            module, base = weight_name, weight_name + "_"
        return cls(weight_name, module, *(base + s for s in ("weight_scale", "weight_scale_2", "input_scale",
                                                              "weight_scale_inv")))


def _as_e4m3(a: np.ndarray, name: str) -> np.ndarray:
    """float8_e4m3fn view of a tensor that a reader returned as e4m3 or as its raw uint8 bytes."""
    a = np.asarray(a)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return a
    if a.dtype == np.uint8:
        return a.view(ml_dtypes.float8_e4m3fn)
    raise ValueError(f"{name} must be float8_e4m3fn (or its uint8 bytes); got {a.dtype}")


def _per_tensor_f32(a: np.ndarray, lead: tuple[int, ...], name: str) -> np.ndarray:
    """A per-tensor scale as float32 of shape `lead` (() for one matrix, [E] for stacked experts)."""
    a = np.asarray(a).astype(np.float32)
    if a.size == 1:
        return np.broadcast_to(a.reshape(()), lead).copy() if lead else a.reshape(())
    if tuple(a.shape) == lead or (a.size == int(np.prod(lead)) and a.ndim <= len(lead) + 1):
        return a.reshape(lead)
    raise ValueError(f"{name} must be a scalar (or one per expert, {list(lead)}); got shape {list(a.shape)}")


def _build_nvfp4(get_tensor, names: LinearNames, weight: np.ndarray) -> NVFP4Weight:
    *lead, n, half_k = weight.shape
    lead = tuple(lead)
    scale = _as_e4m3(get_tensor(names.weight_scale), names.weight_scale)
    want = (*lead, n, 2 * half_k // 16)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{names.weight_scale} has shape {scale.shape}; expected [.., N, K/16] = {want} "
            f"for weight {weight.shape}"
        )
    input_scale = _maybe(get_tensor, names.input_scale)
    return NVFP4Weight(
        packed=np.asarray(weight),
        block_scale=scale,
        tensor_scale=_per_tensor_f32(get_tensor(names.weight_scale_2), lead, names.weight_scale_2),
        input_scale=None if input_scale is None else _per_tensor_f32(input_scale, lead, names.input_scale),
    )


def _build_fp8(get_tensor, names: LinearNames, weight: np.ndarray, qcfg: QuantConfig) -> FP8Weight:
    data = _as_e4m3(weight, names.weight)
    *lead, n, k = weight.shape
    lead = tuple(lead)
    input_scale = _maybe(get_tensor, names.input_scale)
    input_scale = None if input_scale is None else _per_tensor_f32(input_scale, lead, names.input_scale)
    scale_inv = _maybe(get_tensor, names.weight_scale_inv)
    if scale_inv is not None:
        rows, cols = qcfg.weight_block_size or (128, 128)
        if rows != cols:
            raise ValueError(f"{names.module}: only square FP8 blocks are supported; got {(rows, cols)}")
        want = (*lead, -(-n // rows), -(-k // cols))
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"{names.weight_scale_inv} has shape {scale_inv.shape}; expected {want}")
        return FP8Weight(
            data=data, scale=np.asarray(scale_inv, np.float32), block_size=rows, input_scale=input_scale
        )
    scale = _maybe(get_tensor, names.weight_scale)
    if scale is None:
        raise ValueError(f"{names.weight} is float8 but neither weight_scale nor weight_scale_inv exists")
    scale = np.asarray(scale, np.float32)
    if scale.ndim >= 2 and qcfg.weight_block_size is not None:  # FP8_PB_WO stores block scales here
        rows = qcfg.weight_block_size[0]
        return FP8Weight(data=data, scale=scale, block_size=rows, input_scale=input_scale)
    if scale.size == 1 or scale.size == int(np.prod(lead)):
        return FP8Weight(data=data, scale=_per_tensor_f32(scale, lead, names.weight_scale), input_scale=input_scale)
    raise ValueError(f"{names.weight_scale} of shape {scale.shape} (per-channel FP8) is not supported")


def stored_as_quantized(dtype: np.dtype) -> bool:
    """True for the stored dtypes of quantized weights (packed uint8 NVFP4, float8 FP8)."""
    return dtype in (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn))


def build_weight(get_tensor: Callable[[str], np.ndarray], weight_name: str, qcfg: QuantConfig | None) -> Any:
    """The weight stored as `weight_name` as a numpy array or a quantized type with numpy leaves.

    `get_tensor(name)` returns the named tensor as a numpy array and raises KeyError when it is
    absent; e4m3 tensors may come back as ml_dtypes.float8_e4m3fn or as their uint8 bytes. The
    format follows the stored dtype (uint8 weight: NVFP4; e4m3 weight: FP8), so a module that the
    exclude list missed but the exporter left in bf16 still loads as bf16. The bytes are the
    stored bytes, unchanged (nothing is re-quantized or re-laid-out). Leading axes stack experts.
    """
    names = LinearNames.of(weight_name)
    weight = np.asarray(get_tensor(names.weight))
    if qcfg is None or qcfg.is_excluded(names.module):
        if stored_as_quantized(weight.dtype) and qcfg is not None:
            raise ValueError(f"{names.module} is excluded from quantization but its weight is stored as {weight.dtype}")
        return weight
    if not stored_as_quantized(weight.dtype):
        return weight
    if weight.ndim < 2:
        raise ValueError(f"{names.weight} must be [.., N, K]; got shape {weight.shape}")
    if weight.dtype == np.uint8 and qcfg.quant_algo == "NVFP4":
        return _build_nvfp4(get_tensor, names, weight)
    has_fp8_scale = _maybe(get_tensor, names.weight_scale_inv) is not None or (
        _maybe(get_tensor, names.weight_scale) is not None
    )
    if weight.dtype == ml_dtypes.float8_e4m3fn or has_fp8_scale:
        return _build_fp8(get_tensor, names, weight, qcfg)
    raise ValueError(f"{names.weight} is uint8 but quant_algo={qcfg.quant_algo}")


def build_linear(get_tensor: Callable[[str], np.ndarray], prefix: str, qcfg: QuantConfig | None) -> Any:
    """The weight of Linear `prefix` (tensors `<prefix>.weight`, `<prefix>.weight_scale`, ...): see
    `build_weight`."""
    return build_weight(get_tensor, f"{prefix}.weight", qcfg)
