"""The one forward: embeddings -> decoder layers -> final norm -> logits.

`forward(params, tokens, positions, cache, cfg)` is pure and jittable (cfg static). Prefill,
decode, verification, perplexity and training all call it; they differ only in the shapes they
pass and the cache view they hand in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from infernix_jax.cache.sequence import SequenceCache
from infernix_jax.config import FULL_ATTENTION, ModelConfig
from infernix_jax.model.attention import attention
from infernix_jax.model.gated_deltanet import gated_deltanet
from infernix_jax.model.mlp import (
    announce_next_moe,
    collect_expert_routing,
    mlp,
    moe,
    prefetching_experts,
    report_expert_routing,
)
from infernix_jax.model.ngram_memory import ngram_memory
from infernix_jax.model.norm import rms_norm
from infernix_jax.model.params import LayerParams, Params
from infernix_jax.weights.quant import NormSource, matmul


def decoder_layer(
    p: LayerParams,
    x: jax.Array,
    positions: jax.Array,
    entry,
    cfg: ModelConfig,
    snapshot_at=None,
    keep_states: bool = False,
    memory_rows=None,
    tree_parents=None,
):
    """Pre-norm residual block: x + mixer(norm(x)), then + mlp(norm(.)). Returns (x, cache entry),
    and for a linear-attention layer given `snapshot_at` also its state snapshots (see gated_deltanet).

    keep_states: a linear-attention layer returns its state after every position (see gated_deltanet).
    memory_rows: [B, T, heads, width] n-gram memory rows for a layer with `p.ngram` (read before the mixer).
    tree_parents: a tree-shaped verify window (see attention.py and gated_deltanet.py).
    """
    eps, zc = cfg.rms_norm_eps, cfg.zero_centered_norm
    if getattr(p, "ngram", None) is not None:
        x = ngram_memory(p.ngram, x, memory_rows, cfg)
    h = rms_norm(x, p.input_norm, eps, zc)
    norm = NormSource(x, p.input_norm, eps, zc)  # the projections may take h's rows from the norm's launch
    snapshots = None
    if p.attn is not None:
        h, entry = attention(p.attn, h, positions, entry, cfg, tree_parents=tree_parents, norm=norm)
    elif snapshot_at is None:
        h, entry = gated_deltanet(
            p.gdn, h, positions, entry, cfg, keep_states=keep_states, tree_parents=tree_parents, norm=norm
        )
    else:
        h, entry, snapshots = gated_deltanet(p.gdn, h, positions, entry, cfg, snapshot_at, norm=norm)
    x = x + h
    h = rms_norm(x, p.post_norm, eps, zc)
    norm = NormSource(x, p.post_norm, eps, zc)
    h = moe(p.moe, h, cfg, valid=positions >= 0, norm=norm) if p.moe is not None else mlp(p.mlp, h, norm)
    if snapshots is not None:
        return x + h, entry, snapshots
    return x + h, entry


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Logits in float32 from final hidden states."""
    w = params.output_embedding
    if hasattr(w, "matmul"):
        return w.matmul(hidden).astype(jnp.float32)
    return jnp.einsum("...d,vd->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)


def embed(params: Params, tokens: jax.Array, dtype) -> jax.Array:
    return jnp.take(params.embed, tokens, axis=0).astype(dtype)


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: SequenceCache,
    cfg: ModelConfig,
    logit_indices: jax.Array | None = None,
    snapshot_at: jax.Array | None = None,
    keep_states: bool = False,
    ngram_rows: jax.Array | None = None,
    tree_parents: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, SequenceCache]:
    """Run the model on tokens [B, T] at positions [B, T] (-1 marks padding after a row's tokens).

    Returns (logits float32 [B, T, V] — or [B, N, V] at `logit_indices` [B, N] when given —,
    hidden [B, T, D] after the final norm (what lm_head and the MTP head read), the updated cache).
    With `snapshot_at` i32 [B, S] (token counts into each row's window) the returned cache's
    `snapshots` holds, per linear-attention layer, the recurrent state after that many tokens.
    keep_states (static; speculative verification of windows <= 16 tokens): every GDNState entry of
    the returned cache holds the state after each position, conv [B, T, C, K-1] and recurrent
    [B, T, Hv, Dk, Dv]; engine/speculative/rollback.py keeps the one at each row's accepted length.
    ngram_rows [L, B, T, heads, width]: the n-gram memory rows of each memory layer (in
    cfg.ngram_memory.layers order), gathered on the host (infernix_jax/ngram); required when the
    model has an n-gram memory.
    tree_parents i32 [B, T] (speculative tree verification): the window is a tree, node i's parent
    is window index tree_parents[b, i] (-1 for the root, index 0); positions are start + depth.
    Attention nodes see only their ancestors (keys stored at slot start + node index), and GDN
    layers return every node's state as with keep_states, each node continuing its parent's.
    """
    memory_layers = cfg.ngram_memory.layers if cfg.ngram_memory is not None else ()
    if memory_layers and ngram_rows is None:
        raise ValueError("this model has an n-gram memory: forward needs ngram_rows (see docs/ngram_memory.md)")
    dtype = params.final_norm.dtype
    x = embed(params, tokens, dtype)
    entries = list(cache.layers)
    snapshots = []
    # experts beyond device memory: one routing report (below); each layer may copy the next
    # one's likely misses ahead
    with collect_expert_routing() as routing, prefetching_experts():
        for i, layer in enumerate(params.layers):
            announce_next_moe(params.layers[i + 1].moe if i + 1 < len(params.layers) else None)
            kind = "attn" if cfg.layer_types[i] == FULL_ATTENTION else "gdn"
            rows = ngram_rows[memory_layers.index(i)] if i in memory_layers else None
            with jax.named_scope(f"layer{i}_{kind}"):
                if kind == "gdn" and snapshot_at is not None:
                    x, entries[i], taken = decoder_layer(
                        layer, x, positions, entries[i], cfg, snapshot_at, memory_rows=rows
                    )
                    snapshots.append(taken)
                else:
                    x, entries[i] = decoder_layer(
                        layer,
                        x,
                        positions,
                        entries[i],
                        cfg,
                        keep_states=keep_states,
                        memory_rows=rows,
                        tree_parents=tree_parents,
                    )
    receipt = report_expert_routing(routing)
    if receipt is not None:  # the report is sent only if the result depends on it
        x = x + receipt.astype(x.dtype)
    hidden = rms_norm(x, params.final_norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
    selected = hidden
    if logit_indices is not None:
        selected = jnp.take_along_axis(hidden, logit_indices[..., None], axis=1)
    logits = lm_head(params, selected)
    return logits, hidden, SequenceCache(layers=tuple(entries), mtp=cache.mtp, snapshots=tuple(snapshots))


def mtp_forward(
    params: Params,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    cache: SequenceCache,
    cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array, SequenceCache]:
    """The MTP head (vLLM's qwen3_next_mtp semantics).

    At index i it reads token x_{i+1} (tokens [B, T], already shifted by the caller) and the
    target's final hidden state h_i (hidden [B, T, D]) at the target's position i, and predicts
    x_{i+2}. Returns (logits [B, T, V], its own post-norm hidden [B, T, D] — fed back in when
    drafting several tokens —, the cache with the MTP layers' KV updated).
    """
    m = params.mtp
    if m is None:
        raise ValueError("this model has no MTP weights")
    eps, zc = cfg.rms_norm_eps, cfg.zero_centered_norm
    dtype = params.final_norm.dtype
    e = rms_norm(embed(params, tokens, dtype), m.pre_fc_norm_embedding, eps, zc)
    h = rms_norm(hidden.astype(dtype), m.pre_fc_norm_hidden, eps, zc)
    x = matmul(jnp.concatenate([e, h], axis=-1), m.fc)
    entries = list(cache.mtp)
    for j, layer in enumerate(m.layers):
        with jax.named_scope(f"mtp{j}"):
            x, entries[j] = decoder_layer(layer, x, positions, entries[j], cfg)
    out = rms_norm(x, m.norm, eps, zc)
    return lm_head(params, out), out, SequenceCache(layers=cache.layers, mtp=tuple(entries))
