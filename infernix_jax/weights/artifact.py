"""Our converted-model artifact: one TensorStore zarr3 array per stored tensor, plus a metadata record.

Layout (docs/conversion.md has the full description):

    ARTIFACT/
      infernix_artifact.json   {"format": "infernix-artifact", "format_version": 1, "recipe", "source",
                                "with_mtp", "tensors": {leaf path: record}}; written last
      config.json, tokenizer files, generation_config.json      copied from the source
      tensors/<leaf path>/<field>/   zarr3 arrays (zarr.json + chunk files)

A record says how to rebuild one `Params` leaf: {"format": "plain" | "nvfp4" | "fp8" | "int8" |
"q8" | "q4", "shape": logical [.., N, K], "meta": {"block_size" / "group_size"}, "arrays":
{field: {"path", "dtype", "shape", "chunks"}}, "nbytes"}. The fields are the quantized type's data
fields (NVFP4: packed, block_scale, tensor_scale, input_scale), or "value" for a plain array.
Stacked experts are chunked one expert per chunk, so `Artifact.read_expert` reads a single expert
from disk; other tensors are chunked by rows into pieces of at most `CHUNK_BYTES`.

Reads refuse missing chunks (`fill_missing_data_reads: false`) and writes store every chunk, so a
truncated or deleted tensor is an `ArtifactError` naming it, never silent zeros.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import tensorstore as ts
from tqdm.auto import tqdm

from infernix_jax.config import ModelConfig
from infernix_jax.model.params import Params, declare_params, is_routed_expert_leaf, param_dtype
from infernix_jax.weights.hf import leaf_paths, place_params
from infernix_jax.weights.quant import FP8Weight, Int8Weight, NVFP4Weight, Q4Weight, Q8Weight, QuantizedWeight
from infernix_jax.weights.safetensors_io import CheckpointError

FORMAT_NAME = "infernix-artifact"
FORMAT_VERSION = 1
METADATA_FILE = "infernix_artifact.json"
TENSOR_DIR = "tensors"
CHUNK_BYTES = 64 << 20  # rows per chunk of a non-expert tensor: at most this many bytes

# format name in the metadata <-> quantized type
FORMATS: dict[str, type] = {"nvfp4": NVFP4Weight, "fp8": FP8Weight, "int8": Int8Weight, "q8": Q8Weight, "q4": Q4Weight}
_FORMAT_OF = {cls: name for name, cls in FORMATS.items()}
_DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float16": np.float16,
    "float32": np.float32,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
}


class ArtifactError(CheckpointError):
    """An artifact is missing, of another format version, or has a missing or damaged tensor."""


def is_artifact(path: str | os.PathLike) -> bool:
    """True when `path` is a converted artifact (it has the metadata record), not a HF folder."""
    return (Path(path) / METADATA_FILE).is_file()


def _fields(cls) -> tuple[list[str], list[str]]:
    """(array fields, static metadata fields) of a registered quantized dataclass."""
    meta = {"block_size", "group_size"}
    names = [f.name for f in dataclasses.fields(cls)]
    return [n for n in names if n not in meta], [n for n in names if n in meta]


def _dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ArtifactError(f"cannot store dtype {name}")
    return name


def _spec(path: Path) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}


def _chunks(shape: tuple[int, ...], itemsize: int, experts: int | None) -> list[int]:
    """One expert per chunk for expert stacks; otherwise row blocks of at most CHUNK_BYTES."""
    if not shape:
        return []
    if experts is not None and shape[0] == experts:
        return [1, *shape[1:]]
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    return [max(1, min(shape[0], CHUNK_BYTES // row_bytes)), *shape[1:]]


def leaf_arrays(value: Any) -> tuple[str, dict[str, Any], dict[str, np.ndarray]]:
    """(format, static meta, {field: host array}) of a plain or quantized leaf."""
    if isinstance(value, QuantizedWeight):
        fmt = _FORMAT_OF[type(value)]
        array_fields, meta_fields = _fields(type(value))
        arrays = {f: np.asarray(jax.device_get(getattr(value, f))) for f in array_fields if getattr(value, f) is not None}
        return fmt, {m: getattr(value, m) for m in meta_fields}, arrays
    return "plain", {}, {"value": np.asarray(jax.device_get(value))}


class ArtifactWriter:
    """Writes leaves one at a time; `finish()` writes the metadata record that makes it an artifact."""

    def __init__(self, out_dir: str | os.PathLike, num_experts: int | None = None):
        self.dir = Path(out_dir)
        self.num_experts = num_experts or None
        if (self.dir / METADATA_FILE).exists():
            (self.dir / METADATA_FILE).unlink()  # an interrupted rewrite must not look complete
        if (self.dir / TENSOR_DIR).is_dir():
            shutil.rmtree(self.dir / TENSOR_DIR)  # no stale arrays from an earlier conversion
        (self.dir / TENSOR_DIR).mkdir(parents=True)
        self.records: dict[str, dict[str, Any]] = {}

    def write(self, path: str, value: Any) -> dict[str, Any]:
        """Store the leaf at dotted `path` ("layers.3.moe.gate_proj"); returns its record."""
        fmt, meta, arrays = leaf_arrays(value)
        experts = self.num_experts if len(value.shape) == 3 else None  # only expert stacks are [E, N, K]
        record: dict[str, Any] = {"format": fmt, "shape": list(value.shape), "meta": meta, "arrays": {}}
        nbytes = 0
        for field, array in arrays.items():
            rel = f"{TENSOR_DIR}/{path}/{field}"
            chunks = _chunks(array.shape, array.dtype.itemsize, experts)
            store = ts.open(
                {
                    **_spec(self.dir / rel),
                    "metadata": {
                        "shape": list(array.shape),
                        "data_type": _dtype_name(array.dtype),
                        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks or []}},
                    },
                    "store_data_equal_to_fill_value": True,  # every chunk on disk: a missing one is an error
                },
                create=True,
                delete_existing=True,
            ).result()
            store.write(array).result()
            record["arrays"][field] = {"path": rel, "dtype": array.dtype.name, "shape": list(array.shape), "chunks": chunks}
            nbytes += array.nbytes
        record["nbytes"] = nbytes
        self.records[path] = record
        return record

    def finish(self, **fields: Any) -> Path:
        """Write the metadata record (atomically, last) with `fields` (recipe, source, with_mtp...)."""
        meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **fields, "tensors": self.records}
        tmp = self.dir / (METADATA_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, self.dir / METADATA_FILE)
        return self.dir / METADATA_FILE


class Artifact:
    """A converted artifact opened for reading: the metadata record and its tensors."""

    def __init__(self, path: str | os.PathLike):
        self.dir = Path(path)
        meta_path = self.dir / METADATA_FILE
        if not meta_path.is_file():
            raise ArtifactError(f"{self.dir} is not an infernix artifact: {METADATA_FILE} is missing")
        try:
            self.meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{meta_path} is not valid JSON ({e}); re-run the conversion") from e
        name, version = self.meta.get("format"), self.meta.get("format_version")
        if name != FORMAT_NAME or version != FORMAT_VERSION:
            raise ArtifactError(
                f"{meta_path}: format {name!r} version {version!r}; this build reads {FORMAT_NAME!r} version "
                f"{FORMAT_VERSION}. Re-run `python -m conversion` with this version to rebuild the artifact."
            )
        self.tensors: dict[str, dict[str, Any]] = self.meta["tensors"]

    @property
    def with_mtp(self) -> bool:
        return bool(self.meta.get("with_mtp", False))

    def record(self, path: str) -> dict[str, Any]:
        if path not in self.tensors:
            raise ArtifactError(f"artifact {self.dir} has no tensor {path!r}")
        return self.tensors[path]

    def open_array(self, path: str, field: str) -> ts.TensorStore:
        """The TensorStore of one stored array (lazy: index it, then `.read()`)."""
        info = self.record(path)["arrays"].get(field)
        if info is None:
            raise ArtifactError(f"artifact tensor {path!r} has no array {field!r}")
        try:
            store = ts.open({**_spec(self.dir / info["path"]), "fill_missing_data_reads": False}, open=True).result()
        except Exception as e:  # tensorstore raises ValueError / its own status errors
            raise ArtifactError(f"artifact tensor {path}.{field} ({info['path']}) cannot be opened: {e}") from e
        if list(store.shape) != info["shape"] or store.dtype.numpy_dtype != np.dtype(_DTYPES[info["dtype"]]):
            raise ArtifactError(
                f"artifact tensor {path}.{field} is {store.dtype.name} {list(store.shape)} on disk but "
                f"{info['dtype']} {info['shape']} in {METADATA_FILE}"
            )
        return store

    def _read(self, path: str, field: str, index: Any = ()) -> np.ndarray:
        store = self.open_array(path, field)
        try:
            return np.asarray(store[index].read().result())
        except Exception as e:
            raise ArtifactError(
                f"artifact tensor {path}.{field} is damaged or incomplete ({e}); re-run the conversion"
            ) from e

    def _build(self, record: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        if record["format"] == "plain":
            return arrays["value"]
        cls = FORMATS.get(record["format"])
        if cls is None:
            raise ArtifactError(f"unknown tensor format {record['format']!r} (known: plain, {', '.join(FORMATS)})")
        array_fields, _ = _fields(cls)
        return cls(**{f: arrays.get(f) for f in array_fields}, **record.get("meta", {}))

    def read(self, path: str) -> Any:
        """The leaf at `path` on the host: a numpy array or a quantized type with numpy leaves."""
        record = self.record(path)
        return self._build(record, {f: self._read(path, f) for f in record["arrays"]})

    def abstract(self, path: str, dtype=None) -> Any:
        """The leaf at `path` as shapes and dtypes only (`jax.ShapeDtypeStruct` arrays), reading
        nothing; a plain leaf takes `dtype` (the dtype loading would cast it to)."""
        record = self.record(path)
        arrays = {f: jax.ShapeDtypeStruct(tuple(i["shape"]), _DTYPES[i["dtype"]]) for f, i in record["arrays"].items()}
        if record["format"] == "plain" and dtype is not None:
            arrays["value"] = jax.ShapeDtypeStruct(arrays["value"].shape, dtype)
        return self._build(record, arrays)

    def read_expert(self, path: str, expert: int) -> Any:
        """Expert `expert` of a stacked expert leaf ([E, N, K] -> [N, K]), reading only its chunks."""
        record = self.record(path)
        experts = record["shape"][0]
        if len(record["shape"]) != 3 or not 0 <= expert < experts:
            raise ArtifactError(f"{path} has shape {record['shape']}; no expert {expert}")
        arrays = {}
        for field, info in record["arrays"].items():
            per_expert = info["shape"][:1] == [experts]
            arrays[field] = self._read(path, field, expert if per_expert else ())
        return self._build(record, arrays)


def load_artifact_params(
    path: str | os.PathLike,
    cfg: ModelConfig,
    dtype=np.float32,
    with_mtp: bool = True,
    progress: bool = True,
    experts: str = "device",
) -> Params:
    """Read an artifact into `Params` on the default device.

    Plain leaves are cast to `dtype` (A_log stays float32), quantized leaves keep their stored
    dtypes. experts="host" keeps the routed expert stacks in host RAM; experts="artifact" reads
    none of them: their leaves are shapes (`jax.ShapeDtypeStruct`) and the expert offload reads
    the experts it places in slots and RAM one by one (docs/experts.md). Raises ArtifactError when
    a declared leaf is absent or a tensor is damaged.
    """
    artifact = Artifact(path)
    decls = declare_params(cfg, with_mtp=with_mtp and artifact.with_mtp)
    leaves = leaf_paths(decls)
    missing = [p for p in leaves if p not in artifact.tensors]
    if missing:
        raise ArtifactError(f"artifact {path} lacks tensors ({len(missing)}): {'; '.join(missing[:20])}")
    values = {}
    for leaf, decl in tqdm(leaves.items(), desc="loading artifact", disable=not progress, unit="tensor"):
        lazy = experts == "artifact" and is_routed_expert_leaf(leaf)
        value = artifact.abstract(leaf, param_dtype(decl, dtype)) if lazy else artifact.read(leaf)
        if tuple(value.shape) != tuple(decl.shape):
            raise ArtifactError(f"artifact tensor {leaf} has shape {list(value.shape)}; expected {list(decl.shape)}")
        values[leaf] = value
    return place_params(decls, values, dtype, experts)
