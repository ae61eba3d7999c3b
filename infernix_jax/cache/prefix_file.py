"""The prefix cache's file tier: save the cache on shutdown (and periodically), load it at start.

Layout: 8-byte magic, u64 little-endian header length, a JSON header, then the payload (raw array
bytes). The header names the format version and the cache salt (model + KV format), and lists
every entry with its arrays' dtypes, shapes and payload offsets and a BLAKE2b checksum over the
entry's metadata and bytes. A file written by another version or for another model, a truncated
file, or any entry whose checksum fails makes the whole file be ignored (with a warning): nothing
from it ever reaches the model. Writes go to a temporary file that is fsynced and then renamed
over the target, so a crash leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"IXJPFXC\x01"
VERSION = 1
_ARRAY_FIELDS = ("host", "state", "tail_host")


@dataclass
class FileEntry:
    """One cache entry as stored: a full block ("block") or a snapshot ("snapshot")."""

    kind: str
    meta: dict  # block: key, parent, depth, tokens; snapshot: node, tail, position
    arrays: dict[str, tuple[np.ndarray, ...]]  # "host" (block KV) / "state", "tail_host" (snapshot)
    last_used: int = 0


class PrefixFileError(ValueError):
    """The file is not a usable prefix cache for this model (why is in the message)."""


def _checksum(meta: dict, chunks: Iterable[bytes]) -> str:
    h = hashlib.blake2b(json.dumps(meta, sort_keys=True).encode(), digest_size=16)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def save_prefix_file(path: str | os.PathLike, salt: bytes, entries: Iterable[FileEntry]) -> int:
    """Write entries atomically; returns the number written."""
    path = Path(path)
    records, payload, offset = [], [], 0
    for entry in entries:
        arrays_meta, chunks = {}, []
        for name, arrays in entry.arrays.items():
            described = []
            for a in arrays:
                a = np.ascontiguousarray(a)
                raw = a.tobytes()
                described.append([str(a.dtype), list(a.shape), offset, len(raw)])
                chunks.append(raw)
                offset += len(raw)
            arrays_meta[name] = described
        meta = {"kind": entry.kind, "last_used": entry.last_used, **entry.meta, "arrays": arrays_meta}
        meta["checksum"] = _checksum(meta, chunks)
        records.append(meta)
        payload.extend(chunks)
    header = json.dumps(
        {"version": VERSION, "salt": salt.hex(), "payload_bytes": offset, "entries": records}
    ).encode()
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.writelines(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # directories cannot be fsynced on some platforms
        pass
    return len(records)


def load_prefix_file(path: str | os.PathLike, salt: bytes) -> list[FileEntry]:
    """Read and verify a cache file. Raises PrefixFileError when it cannot be used."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < len(MAGIC) + 8 or data[: len(MAGIC)] != MAGIC:
        raise PrefixFileError("not a prefix cache file (bad magic)")
    (header_len,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if start + header_len > len(data):
        raise PrefixFileError("truncated header")
    try:
        header = json.loads(data[start : start + header_len])
    except ValueError as exc:
        raise PrefixFileError(f"unreadable header: {exc}") from exc
    if header.get("version") != VERSION:
        raise PrefixFileError(f"format version {header.get('version')}, this build reads {VERSION}")
    if header.get("salt") != salt.hex():
        raise PrefixFileError("written for another model or KV format")
    body = memoryview(data)[start + header_len :]
    if len(body) != header.get("payload_bytes"):
        raise PrefixFileError(f"payload is {len(body)} bytes, the header says {header.get('payload_bytes')}")
    entries = []
    for i, meta in enumerate(header["entries"]):
        meta = dict(meta)
        expected = meta.pop("checksum", None)
        arrays, chunks = {}, []
        for name, described in meta["arrays"].items():
            if name not in _ARRAY_FIELDS:
                raise PrefixFileError(f"entry {i}: unknown array field {name!r}")
            out = []
            for dtype, shape, offset, nbytes in described:
                raw = bytes(body[offset : offset + nbytes])
                if len(raw) != nbytes:
                    raise PrefixFileError(f"entry {i}: array past the end of the file")
                chunks.append(raw)
                out.append(np.frombuffer(raw, dtype=jnp.dtype(dtype)).reshape(shape))
            arrays[name] = tuple(out)
        if _checksum(meta, chunks) != expected:
            raise PrefixFileError(f"entry {i}: checksum mismatch")
        kind = meta.pop("kind")
        last_used = meta.pop("last_used", 0)
        meta.pop("arrays")
        entries.append(FileEntry(kind, meta, arrays, last_used))
    return entries
