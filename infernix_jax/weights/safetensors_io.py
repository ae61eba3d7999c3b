"""Memory-mapped safetensors reading (one file or sharded with model.safetensors.index.json).

numpy has no bfloat16 or float8, so safetensors' own numpy loader cannot read most checkpoints;
the format is simple (8-byte header length, JSON header, raw little-endian data), so we map the
files and view each tensor with ml_dtypes' types, without copying.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model."""


def _read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        out[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), base + start, base + end)
    return out


class SafetensorsCheckpoint:
    """All tensors of a checkpoint directory, read lazily through memory maps."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors files in {self.dir}")
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            path = self.dir / name
            if not path.exists():
                raise CheckpointError(f"{path} is listed in the index but missing")
            self.tensors.update(_read_header(path))
        self._maps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the mapped file."""
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{name}: unsupported dtype {info.dtype}")
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return mm[info.start : info.end].view(DTYPES[info.dtype]).reshape(info.shape)


def save_safetensors(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write numpy arrays (bfloat16 and float8 included) as one safetensors file."""
    names = {v: k for k, v in DTYPES.items()}
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        dtype = names.get(arr.dtype.type)
        if dtype is None:
            raise ValueError(f"{name}: cannot store dtype {arr.dtype}")
        data = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * ((-len(head)) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.writelines(blobs)
    os.replace(tmp, path)
