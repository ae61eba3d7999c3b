"""`python -m conversion.ngram_volume`: write an n-gram memory table volume for a model.

    python -m conversion.ngram_volume --config MODEL_DIR --npy table.npy --out VOLUME
    python -m conversion.ngram_volume --config MODEL_DIR --safetensors ckpt.safetensors --tensor NAME --out VOLUME
    python -m conversion.ngram_volume --config MODEL_DIR --random SEED --out VOLUME   (tests, benchmarks)
    python -m conversion.ngram_volume --config MODEL_DIR --verify VOLUME

The table must be [rows, width] with the rows the model's hashing addresses (the sum of its heads'
primes, printed by --describe). It is streamed shard by shard (a .npy is memory-mapped, a
safetensors tensor read by row ranges), so a table larger than RAM converts. The volume's manifest
records the shape, the hash parameters and the sha256 of the data (infernix_jax/ngram/volume.py;
docs/ngram_memory.md).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from infernix_jax.config import ModelConfig
from infernix_jax.ngram.hashing import NgramHasher
from infernix_jax.ngram.volume import NgramVolumeError, open_volume, table_dtype, write_volume


class RandomRows:
    """A deterministic random table generated one row range at a time (never whole in RAM)."""

    def __init__(self, shape: tuple[int, int], dtype: np.dtype, seed: int, scale: float = 1.0):
        self.shape, self.dtype, self.seed, self.scale = shape, dtype, seed, scale

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        rng = np.random.default_rng([self.seed, start])
        return (rng.standard_normal((stop - start, self.shape[1]), np.float32) * self.scale).astype(
            self.dtype
        )


class SafetensorsRows:
    """One tensor of a safetensors file, read by row ranges."""

    def __init__(self, path: str, name: str):
        from safetensors import safe_open

        self._file = safe_open(path, framework="numpy")
        if name not in self._file.keys():  # noqa: SIM118 - safe_open is not a dict
            raise NgramVolumeError(f"{path} has no tensor {name!r}")
        self._slice = self._file.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        if len(self.shape) != 2:
            raise NgramVolumeError(f"tensor {name!r} is {list(self.shape)}, not a [rows, width] table")

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self._slice[rows]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conversion.ngram_volume", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="model folder or config.json with an ngram_memory section")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--npy", help="table as a .npy file [rows, width] (memory-mapped)")
    source.add_argument("--safetensors", help="checkpoint file holding the table tensor (with --tensor)")
    source.add_argument(
        "--random", type=int, metavar="SEED", help="a random normal table (tests, benchmarks)"
    )
    source.add_argument(
        "--verify", metavar="VOLUME", help="check a volume against the model and its checksum"
    )
    source.add_argument("--describe", action="store_true", help="print the table shape the model addresses")
    p.add_argument("--tensor", help="tensor name in --safetensors")
    p.add_argument("--out", help="volume folder to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig.from_hf_config(args.config)
    if cfg.ngram_memory is None:
        print("error: the config has no ngram_memory section", file=sys.stderr)
        return 2
    hasher = NgramHasher(cfg.ngram_memory, cfg.vocab_size)
    shape = (hasher.total_rows, cfg.ngram_memory.row_width)
    dtype = table_dtype(cfg.ngram_memory.table_dtype)
    if args.describe:
        print(
            f"table [{shape[0]}, {shape[1]}] {dtype.name} ({shape[0] * shape[1] * dtype.itemsize / 2**30:.2f} GiB)"
        )
        return 0
    try:
        if args.verify:
            open_volume(args.verify, cfg, verify=True)
            print(f"{args.verify}: matches the model, checksum verified")
            return 0
        if not args.out:
            print("error: --out is required", file=sys.stderr)
            return 2
        if args.npy:
            table = np.load(args.npy, mmap_mode="r")
        elif args.safetensors:
            if not args.tensor:
                print("error: --safetensors needs --tensor NAME", file=sys.stderr)
                return 2
            table = SafetensorsRows(args.safetensors, args.tensor)
        else:
            table = RandomRows(shape, dtype, args.random)
        manifest = write_volume(args.out, cfg, table)
    except NgramVolumeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: [{manifest['shape'][0]}, {manifest['shape'][1]}] {manifest['dtype']} sha256 {manifest['sha256']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
