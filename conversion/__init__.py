"""Convert Hugging Face checkpoints (plain, ModelOpt NVFP4 / FP8, block FP8) into our artifact.

    python -m conversion --in HF_DIR --out ARTIFACT_DIR --recipe RECIPE

Recipes (conversion/recipes.py, docs/conversion.md): bf16, nvfp4, fp8, int8, q8, q4, dense8
(alias mixed: experts nvfp4, dense projections int8, router / norms / embeddings bf16), or rules
per module class such as "experts=nvfp4,dense=q8". The artifact format lives in
infernix_jax/weights/artifact.py; `infernix_jax.load` reads artifacts and HF folders alike.
"""

from conversion.convert import ConversionSummary, convert
from conversion.recipes import RECIPES, Recipe, RecipeError, apply, module_class, parse_recipe

__all__ = ["RECIPES", "ConversionSummary", "Recipe", "RecipeError", "apply", "convert", "module_class", "parse_recipe"]
