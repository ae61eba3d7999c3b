"""Quantization recipes: which format each module class of the model gets.

A leaf of `Params` belongs to one module class (`module_class`): experts, shared_expert,
attention, linear_attn, mlp, mtp_fc, router, lm_head, embed, norm or other. A `Recipe` maps the
classes to formats: bf16, nvfp4, fp8, fp8_block, int8, q8, q4 (q8/q4 take a group: q4_g64).
Embeddings, norms and `other` (GDN conv, dt_bias, A_log, biases) are never quantized.

`apply(recipe, path, value)` is the one function that turns a loaded leaf into what the artifact
stores, used both by the converter and by tests that quantize a loaded model in memory.
A leaf that is already in its target format (an NVFP4 expert from a ModelOpt checkpoint under an
nvfp4 rule) is kept byte for byte; one in another format is dequantized and requantized.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.weights.quant import (
    FP8Weight,
    Int8Weight,
    NVFP4Weight,
    Q4Weight,
    Q8Weight,
    QuantizedWeight,
    dequantize,
    quantize_fp8,
    quantize_int8,
    quantize_nvfp4,
    quantize_q4,
    quantize_q8,
)

MODULE_CLASSES = (
    "experts", "shared_expert", "attention", "linear_attn", "mlp", "mtp_fc", "router", "lm_head", "embed", "norm",
    "other",
)
QUANTIZABLE = ("experts", "shared_expert", "attention", "linear_attn", "mlp", "mtp_fc", "router", "lm_head")
DENSE = ("shared_expert", "attention", "linear_attn", "mlp", "mtp_fc")  # the non-expert projections
FORMATS = ("bf16", "nvfp4", "fp8", "fp8_block", "int8", "q8", "q4")
DEFAULT_GROUP = 32
MIN_GROUP = 8


class RecipeError(ValueError):
    """A recipe that cannot be parsed, or a tensor that its format cannot hold."""


def module_class(path: str) -> str:
    """The module class of a dotted `Params` leaf path, e.g. "layers.3.moe.gate_proj" -> "experts"."""
    parts = path.split(".")
    last = parts[-1]
    if path == "embed":
        return "embed"
    if path == "lm_head":
        return "lm_head"
    if path == "mtp.fc":
        return "mtp_fc"
    if "norm" in last:  # input_norm, post_norm, q_norm, k_norm, gdn.norm, final_norm, mtp norms
        return "norm"
    if "moe" in parts:
        if last in ("router", "shared_gate"):
            return "router"
        return "shared_expert" if "shared" in parts else "experts"
    if "attn" in parts and last.endswith("_proj"):
        return "attention"
    if "gdn" in parts and last.startswith(("in_proj", "out_proj")):
        return "linear_attn"
    if "mlp" in parts:
        return "mlp"
    return "other"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A name and one format per quantizable module class (classes not listed stay bf16)."""

    name: str
    formats: tuple[tuple[str, str], ...]  # (module class, format)

    def format_for(self, cls: str) -> str:
        return dict(self.formats).get(cls, "bf16") if cls in QUANTIZABLE else "bf16"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "formats": {cls: self.format_for(cls) for cls in MODULE_CLASSES}}


def _uniform(name: str, fmt: str) -> Recipe:
    """Every projection (experts, dense, MTP fc) in `fmt`; router, lm_head and embeddings bf16."""
    return Recipe(name, tuple((cls, fmt) for cls in ("experts", *DENSE)))


DENSE8 = Recipe("dense8", (("experts", "nvfp4"), *((cls, "int8") for cls in DENSE)))
RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", ()),
    **{fmt: _uniform(fmt, fmt) for fmt in ("nvfp4", "fp8", "int8", "q8", "q4")},
    "dense8": DENSE8,
    "mixed": dataclasses.replace(DENSE8, name="mixed"),
}


def _check_format(fmt: str) -> str:
    base = re.sub(r"_g\d+$", "", fmt)
    if base not in FORMATS or (fmt != base and base not in ("q8", "q4")):
        raise RecipeError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)} (q8/q4 take a group: q4_g64)")
    return fmt


def parse_recipe(spec: str) -> Recipe:
    """A named recipe (bf16, nvfp4, fp8, int8, q8, q4, dense8, mixed) or rules per class.

    Rules: "experts=nvfp4,dense=int8,router=bf16"; "dense" stands for shared_expert, attention,
    linear_attn, mlp and mtp_fc; "default" for every quantizable class not named. Later rules win.
    """
    if spec in RECIPES:
        return RECIPES[spec]
    if "=" not in spec:
        raise RecipeError(f"unknown recipe {spec!r}; recipes: {', '.join(RECIPES)}, or rules like 'experts=nvfp4,dense=int8'")
    formats: dict[str, str] = {}
    for rule in spec.split(","):
        cls, _, fmt = (s.strip() for s in rule.partition("="))
        fmt = _check_format(fmt)
        if cls == "default":
            targets = [c for c in QUANTIZABLE if c not in formats]
        elif cls == "dense":
            targets = list(DENSE)
        elif cls in QUANTIZABLE:
            targets = [cls]
        else:
            raise RecipeError(f"module class {cls!r} cannot be quantized; classes: {', '.join(QUANTIZABLE)}, dense, default")
        formats.update({c: fmt for c in targets})
    return Recipe(spec, tuple(formats.items()))


def _format_of(value: Any) -> str:
    if isinstance(value, NVFP4Weight):
        return "nvfp4"
    if isinstance(value, FP8Weight):
        return "fp8" if value.block_size is None else "fp8_block"
    if isinstance(value, Int8Weight):
        return "int8"
    if isinstance(value, Q8Weight):
        return f"q8_g{value.group_size}"
    if isinstance(value, Q4Weight):
        return f"q4_g{value.group_size}"
    return "bf16"


def _fit_group(k: int, group: int, path: str) -> int:
    """The group size actually used: `group`, halved until it divides K (small models), at least 8."""
    g = group
    while g > MIN_GROUP and k % g:
        g //= 2
    if k % g:
        raise RecipeError(f"{path}: K={k} has no group size between {MIN_GROUP} and {group} that divides it")
    return g


def _host(w: QuantizedWeight) -> QuantizedWeight:
    return jax.tree.map(np.asarray, w)


def apply(recipe: Recipe, path: str, value: Any) -> Any:
    """The leaf at `path` as `recipe` stores it (host arrays); see `convert_leaf`."""
    return convert_leaf(recipe, path, value)[0]


def convert_leaf(recipe: Recipe, path: str, value: Any) -> tuple[Any, str]:
    """(the leaf as `recipe` stores it, what happened: "plain", "quantized", "kept" or "requantized").

    Plain leaves become bfloat16 except A_log (float32). "kept": the source was already in the
    target format and its bytes are stored unchanged; "requantized": a quantized source leaf was
    dequantized and quantized again (or dequantized to bf16). nvfp4 needs K divisible by 16;
    q8 / q4 use the largest group up to the asked one (32 by default) that divides K, at least 8.
    """
    cls = module_class(path)
    fmt = recipe.format_for(cls)
    was_quantized = isinstance(value, QuantizedWeight)
    if not was_quantized and (np.ndim(value) < 2 or cls not in QUANTIZABLE):
        fmt = "bf16"
    action = "requantized" if was_quantized else "quantized"
    if fmt == "bf16":
        dtype = jnp.float32 if path.endswith("A_log") else jnp.bfloat16
        return np.asarray(dequantize(value, dtype)), "requantized" if was_quantized else "plain"
    if was_quantized:
        have = _format_of(value)
        if have == fmt or (fmt in ("q8", "q4") and have.startswith(fmt + "_g")):
            return _host(value), "kept"
        value = dequantize(value, jnp.float32)
    base = re.sub(r"_g\d+$", "", fmt)
    w = jnp.asarray(value, jnp.float32)
    k = w.shape[-1]
    if base == "nvfp4":
        if k % 16:
            raise RecipeError(f"{path}: nvfp4 needs K divisible by 16; shape {list(w.shape)}")
        return _host(quantize_nvfp4(w)), action
    if base == "fp8":
        return _host(quantize_fp8(w)), action
    if base == "fp8_block":
        return _host(quantize_fp8(w, block_size=128)), action
    if base == "int8":
        return _host(quantize_int8(w)), action
    group = _fit_group(k, int(fmt.split("_g")[1]) if "_g" in fmt else DEFAULT_GROUP, path)
    if base == "q8":
        return _host(quantize_q8(w, group_size=group)), action
    return _host(quantize_q4(w, group_size=group)), action


def stored_bytes(value: Any) -> int:
    """Bytes a leaf takes as stored (packed data and scales for quantized leaves)."""
    if isinstance(value, QuantizedWeight):
        return value.nbytes
    return int(np.asarray(value).nbytes)
