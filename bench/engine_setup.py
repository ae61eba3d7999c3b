"""Shared by bench.decode and bench.prefill: model shapes, random weights on the device, an engine.

Shapes (random bf16 weights built directly on the accelerator, no files):

- ``27b``: Qwen3.5-27B (dense, hybrid GDN + gated attention).
- ``moe``: Qwen3-Next-80B-A3B's layer shapes with 24 of its 48 layers (~40B parameters, 3B active
  per token at the full depth), so that bf16 weights fit on one H200.
- ``tiny``: a small hybrid MoE for ``--quick`` runs on any machine.

Weights (``WEIGHT_FORMATS``): ``bf16``, or ``nvfp4`` / ``fp8`` for every linear projection and
routed expert stack, quantized on the device with the conversion recipes of the same names
(router, norms, embeddings and lm_head stay in the model dtype, as ModelOpt leaves them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from conversion.recipes import RECIPES, module_class
from infernix_jax.cache import BLOCK_SIZE, kv_bytes_per_block, state_bytes_per_slot
from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from infernix_jax.engine.request_state import Status
from infernix_jax.model.params import Decl, declare_params, init_params, param_dtype
from infernix_jax.weights.hf import path_str
from infernix_jax.weights.quant import quantize_fp8, quantize_int8, quantize_nvfp4

QWEN3_5_27B = dict(  # noqa: C408 - the shape of a config.json
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120,
    intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=262144, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
)  # fmt: skip
QWEN3_NEXT_24_LAYERS = dict(  # noqa: C408
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    rope_theta=10000000, partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    norm_topk_prob=True, tie_word_embeddings=False, full_attention_interval=4, max_position_embeddings=262144,
    mlp_only_layers=[],
)  # fmt: skip
TINY = dict(QWEN3_NEXT_24_LAYERS,
            vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
            head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, max_position_embeddings=65536)  # fmt: skip
SHAPES = {"27b": QWEN3_5_27B, "moe": QWEN3_NEXT_24_LAYERS, "tiny": TINY}


WEIGHT_FORMATS = ("bf16", "nvfp4", "fp8", "fp8_block", "int8")
_QUANTIZERS = {
    "nvfp4": quantize_nvfp4,
    "fp8": quantize_fp8,
    "fp8_block": functools.partial(quantize_fp8, block_size=128),  # Qwen's FP8 checkpoints' 128 x 128
    "int8": quantize_int8,
}
_RECIPE_OF = {"fp8_block": "fp8"}  # the conversion recipe whose module classes a format quantizes


def build_model(shape: str, dtype=jnp.bfloat16, seed: int = 0, weights: str = "bf16"):
    """(cfg, params) with random weights created on the default device; `weights` "nvfp4", "fp8",
    "fp8_block" (128 x 128 scale blocks) or "int8" quantizes the projections and experts leaf by
    leaf (`quantized_params`)."""
    cfg = ModelConfig.from_hf_config(SHAPES[shape])
    if weights == "bf16":
        return cfg, init_params(cfg, jax.random.key(seed), dtype, with_mtp=False)
    return cfg, quantized_params(cfg, jax.random.key(seed), dtype, weights)


def chain_params(
    cfg: ModelConfig,
    params,
    seed: int = 0,
    embed_scale: float = 1000.0,
    sharpness: float = 10.0,
    path: Sequence[int] = (),
):
    """(params, successor): the same random model made to keep to a fixed chain of tokens, the
    next token after t being successor[t] by a wide margin, greedy or sampled; for workloads that
    need a model that keeps to its grammar (as a trained one mostly does) at a real shape's cost.
    `path` (distinct token ids): successor[path[i]] = path[i + 1], so a row whose last token is
    path[0] writes the rest of it (a document of a given grammar); the other successors are random.

    The layers are untouched, so a step costs what the random model's does. The input embedding
    is scaled up by `embed_scale`, so the residual stream stays the token's own embedding whatever
    the layers add (each layer reads it through a norm, so the layers compute as before), and the
    output embedding's row successor[t] is t's embedding at unit RMS times sharpness / sqrt(D):
    that logit is ~ sharpness * sqrt(D), any other ~ sharpness * N(0, 1) (715 against at most ~50
    for D = 5120 over 151k tokens). With tied embeddings the successor is the token itself."""
    vocab, dim = params.embed.shape
    final_norm = jnp.full_like(params.final_norm, 0.0 if cfg.zero_centered_norm else 1.0)
    new_embed = _scaled(params.embed, embed_scale)
    if params.lm_head is None:
        if path:
            raise ValueError("with tied embeddings every token is its own successor: no path")
        return dataclasses.replace(params, embed=new_embed, final_norm=final_norm), np.arange(vocab)
    successor = _successors(vocab, list(path), np.random.default_rng(seed))
    predecessor = jnp.asarray(np.argsort(successor), jnp.int32)  # predecessor[successor[t]] = t
    head = _chain_head(params.embed, predecessor, sharpness / math.sqrt(dim))
    chained = dataclasses.replace(params, embed=new_embed, final_norm=final_norm, lm_head=head)
    return chained, successor


def _successors(vocab: int, path: list[int], rng: np.random.Generator) -> np.ndarray:
    """A random permutation of range(vocab) that maps path[i] to path[i + 1]."""
    if len(set(path)) != len(path) or any(not 0 <= t < vocab for t in path):
        raise ValueError("a chain's path must be distinct token ids of the vocabulary")
    successor = np.full(vocab, -1, np.int64)
    successor[path[:-1]] = path[1:]
    sources = np.flatnonzero(successor < 0)  # every token but path[:-1]
    taken = np.zeros(vocab, bool)
    taken[path[1:]] = True
    successor[sources] = rng.permutation(np.flatnonzero(~taken))  # every token but path[1:]
    return successor


@jax.jit
def _scaled(x: jax.Array, scale: float) -> jax.Array:
    return (x.astype(jnp.float32) * scale).astype(x.dtype)


@jax.jit
def _chain_head(embed: jax.Array, predecessor: jax.Array, scale: float) -> jax.Array:
    """Row j: the embedding of predecessor[j] at unit RMS times `scale` (one fused pass: a 27B
    shape's float32 copies of the embedding would not fit beside its weights)."""
    e = embed.astype(jnp.float32)
    unit = e * jax.lax.rsqrt(jnp.mean(jnp.square(e), axis=1, keepdims=True))
    return (unit[predecessor] * scale).astype(embed.dtype)


def quantized_params(cfg: ModelConfig, key: jax.Array, dtype, fmt: str):
    """Random weights (the same values as `init_params` with this key) with every leaf that the
    conversion recipe `fmt` quantizes stored in that format.

    Each leaf is made, quantized and dropped before the next is made, so the peak is the
    quantized model plus one leaf's working set, never the whole model in `dtype` (27B in bf16
    is 54 GB). Leaves the format cannot hold (NVFP4 needs K % 16 == 0) stay in `dtype`."""
    if fmt not in _QUANTIZERS:
        raise ValueError(f"weights={fmt!r} must be one of {WEIGHT_FORMATS}")
    recipe_name = _RECIPE_OF.get(fmt, fmt)
    recipe, quantize = RECIPES[recipe_name], _QUANTIZERS[fmt]
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        declare_params(cfg, with_mtp=False), is_leaf=lambda x: isinstance(x, Decl)
    )
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, decl), k in zip(flat, keys):
        leaf = decl.make(k, param_dtype(decl, dtype), cfg.zero_centered_norm)
        quantizable = recipe.format_for(module_class(path_str(path))) == recipe_name and leaf.ndim >= 2
        if quantizable and not (fmt == "nvfp4" and leaf.shape[-1] % 16):
            quantized = jax.block_until_ready(quantize(leaf))
            del leaf  # the last reference: its device buffer is freed here
            leaf = quantized
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# A routed expert stack leaf: .layers[i].moe.gate_proj / up_proj / down_proj (itself or a
# quantized weight's packed data and scales), not the shared expert.
_EXPERT_LEAF = re.compile(r"\.moe\.(gate_proj|up_proj|down_proj)(\.|$)")


def weight_bytes_per_token(cfg: ModelConfig, params) -> int:
    """Bytes of weights one decode step must read: everything except the experts not routed to
    (at batch b up to b * top_k experts are read; this counts top_k, the batch-1 figure) and the
    embedding table (one row is read). Quantized weights count as stored: packed data plus every
    scale, the per-expert scales of routed experts top_k / E of them like the data."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        size = math.prod(leaf.shape) * leaf.dtype.itemsize
        if name.startswith(".embed"):
            size = size // leaf.shape[0]
        elif cfg.num_experts and _EXPERT_LEAF.search(name) and leaf.shape[:1] == (cfg.num_experts,):
            size = size * cfg.num_experts_per_tok // cfg.num_experts
        total += size
    return total


def active_params_per_token(cfg: ModelConfig, params) -> int:
    """Weights one token multiplies with (2 FLOPs each): every weight's elements, quantized ones
    counted by their logical [.., N, K] shape, the routed experts top_k / E of them, one row of
    the embedding table."""
    from infernix_jax.weights.quant import QuantizedWeight

    total = 0
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda a: isinstance(a, QuantizedWeight))
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        size = math.prod(leaf.shape)
        if name.startswith(".embed"):
            size = size // leaf.shape[0]
        elif cfg.num_experts and _EXPERT_LEAF.search(name) and tuple(leaf.shape[:1]) == (cfg.num_experts,):
            size = size * cfg.num_experts_per_tok // cfg.num_experts
        total += size
    return total


def decode_bytes_per_step(cfg: ModelConfig, params, batch: int, context: int, kv_dtype: str, dtype) -> int:
    """Bytes one decode step must read: weights + every row's KV up to `context` + the state slots."""
    kv = batch * math.ceil(context / BLOCK_SIZE) * kv_bytes_per_block(cfg, kv_dtype, dtype)
    return weight_bytes_per_token(cfg, params) + kv + batch * state_bytes_per_slot(cfg, dtype)


def make_core(
    cfg, params, *, batch: int, context: int, steps: int, kv_dtype: str, prefill_chunk: int,
    new_tokens: int | None = None, **overrides,
) -> EngineCore:
    """An engine sized for `batch` rows of `context` prompt tokens plus `new_tokens` generated ones
    (default: two dispatches of `steps`); a row that reaches max_context stops generating.
    `overrides` go to EngineConfig (e.g. warmup=False: compile only the programs a bench uses)."""
    config = bench_config(
        batch=batch, context=context, steps=steps, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
        new_tokens=new_tokens, **overrides,
    )  # fmt: skip
    return EngineCore(cfg, params, config)


def bench_config(
    *, batch: int, context: int, steps: int, kv_dtype: str, prefill_chunk: int,
    new_tokens: int | None = None, **overrides,
) -> EngineConfig:
    """`make_core`'s EngineConfig: room for `batch` rows of `context` + `new_tokens` tokens, one
    decode batch size and one prefill shape, nothing compiled or cached beyond them."""
    room = context + (2 * steps if new_tokens is None else new_tokens) + 1
    config = EngineConfig(
        max_concurrency=batch, max_context=room, kv_dtype=kv_dtype,
        kv_capacity=batch * math.ceil(room / BLOCK_SIZE), prefill_chunk=prefill_chunk,
        prefill_shape_override=((1, prefill_chunk),), decode_batch_sizes=(batch,),
        decode_steps_per_dispatch=steps, compilation_cache_dir=None, progress=False, scoring=False,
    )  # fmt: skip
    return dataclasses.replace(config, **overrides)


# Qwen's recommended sampling for its instruct models (temperature 0.7, top_p 0.8, top_k 20): what a
# chat client sends; `bench.decode --sampling qwen` decodes with it
QWEN_SAMPLING = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=0)


def place_prompts_without_compute(
    core: EngineCore, batch: int, context: int, seed: int = 0, sampling: SamplingParams | None = None
) -> None:
    """Admit `batch` requests of `context` prompt tokens and mark all but the last as cached.

    Decode cost does not depend on the KV values, so the decode benchmark skips the prefill: the
    blocks hold zeros. Uses the scheduler's allocators directly (benchmark only). sampling: the
    requests' settings (default greedy); they never stop early.
    """
    settings = (sampling or SamplingParams()).replace(max_tokens=1 << 30, ignore_eos=True)
    rng = np.random.default_rng(seed)
    scheduler = core.scheduler
    for i in range(batch):
        prompt = rng.integers(0, core.cfg.vocab_size, size=context).tolist()
        core.add_request(
            GenerationRequest(f"bench{i}", prompt, settings)
        )
    while scheduler.waiting:
        state = scheduler.waiting.popleft()
        state.slot = scheduler.slots.allocate()
        state.blocks = scheduler.blocks.allocate(math.ceil(context / BLOCK_SIZE))
        state.num_computed = context - 1
        state.status = Status.RUNNING
        scheduler.running.append(state)
        core.runner.set_slot(state.slot, state.request.sampling, state.seed, state.prompt, state.output)
