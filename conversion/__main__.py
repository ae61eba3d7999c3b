"""`python -m conversion --in HF_DIR --out ARTIFACT_DIR --recipe RECIPE`: convert, then print bytes per class."""

from __future__ import annotations

import argparse
import sys

from conversion.convert import convert
from conversion.recipes import FORMATS, QUANTIZABLE, RECIPES, RecipeError, parse_recipe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conversion",
        description="Convert a Hugging Face checkpoint folder (plain, ModelOpt NVFP4/FP8 or block FP8) into an "
        "infernix artifact (TensorStore zarr3 tensors + config, tokenizer and a metadata record).",
        epilog=f"Recipes: {', '.join(RECIPES)}; or rules per module class, e.g. 'experts=nvfp4,dense=int8'. "
        f"Classes: {', '.join(QUANTIZABLE)}, dense (all non-expert projections), default. "
        f"Formats: {', '.join(FORMATS)} (q8/q4 take a group size: q4_g64). See docs/conversion.md.",
    )
    parser.add_argument("--in", dest="in_dir", required=True, help="Hugging Face model folder")
    parser.add_argument("--out", dest="out_dir", required=True, help="artifact folder to write")
    parser.add_argument("--recipe", default="bf16", help="quantization recipe (default: bf16)")
    parser.add_argument("--no-mtp", action="store_true", help="leave out the MTP head")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        recipe = parse_recipe(args.recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = convert(args.in_dir, args.out_dir, recipe, with_mtp=not args.no_mtp, progress=not args.quiet)
    print(summary.table())
    ratio = summary.source_bytes / max(summary.stored_bytes, 1)
    print(f"wrote {args.out_dir} ({summary.stored_bytes / 2**20:.2f} MiB, {ratio:.2f}x smaller than the source)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
