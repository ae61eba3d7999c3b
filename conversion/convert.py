"""HF folder (plain, ModelOpt NVFP4 / FP8, block FP8) -> artifact, one leaf at a time.

Each `Params` leaf is read through the Hugging Face loader's rule table (so the artifact holds
what loading the folder would), passed through the recipe, and written as soon as it is ready,
so memory holds one leaf at a time. The metadata record is written last: an interrupted
conversion leaves a folder that `infernix_jax.load` refuses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import Counter
from pathlib import Path

from tqdm.auto import tqdm

from conversion.recipes import Recipe, convert_leaf, module_class, stored_bytes
from infernix_jax.config import ModelConfig
from infernix_jax.weights.artifact import ArtifactWriter, leaf_arrays
from infernix_jax.weights.hf import HFWeightSource

# Files copied next to the tensors when the source has them.
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclasses.dataclass
class ClassSummary:
    """What the conversion did to one module class."""

    tensors: int = 0
    source_bytes: int = 0  # as the source stores them (float32 / bf16 / packed)
    stored_bytes: int = 0  # as the artifact stores them
    formats: Counter = dataclasses.field(default_factory=Counter)  # stored format -> tensor count
    kept: int = 0  # quantized leaves kept byte for byte from the source
    requantized: int = 0  # quantized leaves of the source turned into another format


@dataclasses.dataclass
class ConversionSummary:
    recipe: str
    classes: dict[str, ClassSummary]

    @property
    def source_bytes(self) -> int:
        return sum(c.source_bytes for c in self.classes.values())

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_bytes for c in self.classes.values())

    def table(self) -> str:
        """A plain-text table of bytes per module class."""
        rows = [("class", "tensors", "formats", "source MiB", "artifact MiB", "kept", "requantized")]
        for name, c in sorted(self.classes.items(), key=lambda kv: -kv[1].stored_bytes):
            fmts = ", ".join(f"{f} x{n}" for f, n in sorted(c.formats.items()))
            rows.append((name, str(c.tensors), fmts, f"{c.source_bytes / 2**20:.3f}", f"{c.stored_bytes / 2**20:.3f}",
                         str(c.kept), str(c.requantized)))
        rows.append(("total", str(sum(c.tensors for c in self.classes.values())), "",
                     f"{self.source_bytes / 2**20:.3f}", f"{self.stored_bytes / 2**20:.3f}", "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)

    def to_json(self) -> dict:
        return {name: {**dataclasses.asdict(c), "formats": dict(c.formats)} for name, c in self.classes.items()}


def _stored_format(value) -> str:
    fmt, meta, arrays = leaf_arrays(value)
    if fmt == "plain":
        return str(arrays["value"].dtype)
    return fmt + "".join(f"_{k[0]}{v}" for k, v in meta.items() if v is not None)


def _copy_side_files(src: Path, dst: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)  # the artifact's metadata record says how tensors are stored
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def convert(
    in_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    recipe: Recipe,
    with_mtp: bool = True,
    progress: bool = True,
) -> ConversionSummary:
    """Convert the Hugging Face folder `in_dir` into an artifact at `out_dir` with `recipe`."""
    src, dst = Path(in_dir), Path(out_dir)
    if src.resolve() == dst.resolve():
        raise ValueError("--out must differ from --in")
    cfg = ModelConfig.from_hf_config(src)
    source = HFWeightSource(src, cfg, with_mtp)
    dst.mkdir(parents=True, exist_ok=True)
    writer = ArtifactWriter(dst, cfg.num_experts)
    classes: dict[str, ClassSummary] = {}
    for path in tqdm(source.leaves, desc=f"converting ({recipe.name})", disable=not progress, unit="tensor"):
        value = source.read(path)
        if value is None:  # missing or mis-shaped: reported by check() below
            continue
        out, action = convert_leaf(recipe, path, value)
        writer.write(path, out)
        c = classes.setdefault(module_class(path), ClassSummary())
        c.tensors += 1
        c.source_bytes += stored_bytes(value)
        c.stored_bytes += stored_bytes(out)
        c.formats[_stored_format(out)] += 1
        c.kept += action == "kept"
        c.requantized += action == "requantized"
    source.check()
    _copy_side_files(src, dst)
    summary = ConversionSummary(recipe.name, classes)
    writer.finish(
        recipe=recipe.to_json(),
        source={"path": str(src), "quant_algo": source.qcfg.quant_algo if source.qcfg else None},
        with_mtp=source.with_mtp,
        summary=summary.to_json(),
    )
    return summary
