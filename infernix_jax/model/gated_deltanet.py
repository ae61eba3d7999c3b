"""Gated DeltaNet (the linear-attention layers of Qwen3-Next / Qwen3.5).

Causal depthwise conv over [q | k | v] channels with a carried conv state, then the gated delta
rule with an fp32 recurrent state per value head: the chunked form (chunks of 64, as the FLA
kernels and transformers' reference compute it) for multi-token input, the per-token recurrence
for short windows. Padding tokens (position -1) must come after a row's valid tokens; they get
beta = 0 and decay 1, so they leave the state untouched.

In the engine's decode and prefill programs the state arrives as a `SlottedGDNState` (the state
pool seen through the rows' slots): windows of up to 16 tokens then run the recurrence as one
kernel that updates the rows' slots in place (pallas_kernels/gated_delta.py, chosen by
cache/attention_choice.py); every other path gathers the states, runs as below, and commits them.

Tree-shaped verify windows (speculative decoding, `tree_parents`): node i continues its parent's
state rather than node i-1's. The recurrence walks the nodes in order (parents come first) and
gathers the previous state by parent index; the conv window of a node is its ancestor path's raw
inputs. Every node's state is returned, so the caller keeps the one after the last accepted node.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from infernix_jax.cache.attention_choice import use_recurrent_kernel
from infernix_jax.cache.sequence import GDNState
from infernix_jax.cache.state_pool import SlottedGDNState
from infernix_jax.config import ModelConfig
from infernix_jax.model.norm import gated_rms_norm
from infernix_jax.model.params import GDNParams
from infernix_jax.weights.quant import NormSource, matmul, matmuls, matmuls_joined

CHUNK = 64
# Windows up to this length run the per-token recurrence (decode, draft verification); longer
# ones use the chunked form.
RECURRENT_MAX_TOKENS = 16


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gates(
    b_in: jax.Array, a_in: jax.Array, a_log: jax.Array, dt_bias: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The recurrence's log decay and write strength from the b / a projections [B, T, H]:
    (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), float32, 0 where not `valid` [B, T]
    (padding tokens then leave the state as it was)."""
    f32 = jnp.float32
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(b_in.astype(f32)), 0.0)
    g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a_in.astype(f32) + dt_bias.astype(f32))
    return jnp.where(valid[..., None], g, 0.0), beta


def causal_conv(
    x: jax.Array, conv_state: jax.Array, weight: jax.Array, n_valid: jax.Array, keep_states: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU.

    x [B, T, C] raw inputs, conv_state [B, C, K-1] the previous K-1 raw inputs, weight [C, K],
    n_valid [B] valid tokens per row. Returns (out [B, T, C], new conv state [B, C, K-1]), or with
    keep_states the conv state after every token: [B, T, C, K-1] (entry t holds inputs t-K+2..t).
    """
    _, t, _ = x.shape
    k = weight.shape[-1]
    ext = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight.astype(x.dtype)
    out = sum(ext[:, j : j + t, :] * w[:, j] for j in range(k))
    if keep_states:  # after token i the state is ext[i + 1 : i + K]
        states = jnp.stack([ext[:, i + 1 : i + k, :] for i in range(t)], axis=1)  # [B, T, K-1, C]
        return jax.nn.silu(out), jnp.swapaxes(states, 2, 3).astype(conv_state.dtype)
    new_state = jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, k - 1, axis=0))(ext, n_valid)
    return jax.nn.silu(out), jnp.swapaxes(new_state, 1, 2).astype(conv_state.dtype)


def tree_causal_conv(
    x: jax.Array, conv_state: jax.Array, weight: jax.Array, parents: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU over a tree of nodes: each node's window is the raw inputs of its
    ancestor path (then the conv state before the root).

    x [B, T, C], conv_state [B, C, K-1], weight [C, K], parents i32 [B, T] (-1: the root continues
    the conv state). Returns (out [B, T, C], the conv state after every node [B, T, C, K-1]).
    With parents = i - 1 this is causal_conv with keep_states.
    """
    b, t, _ = x.shape
    k = weight.shape[-1]
    ext = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    # the predecessor of every entry of ext: conv-state entry j follows j - 1, node i follows its
    # parent (the last conv-state entry for the root)
    state_prev = jnp.broadcast_to(jnp.maximum(jnp.arange(k - 1) - 1, 0)[None, :], (b, k - 1))
    node_prev = jnp.where(parents >= 0, parents + k - 1, k - 2).astype(jnp.int32)
    prev = jnp.concatenate([state_prev, node_prev], axis=1)  # [B, K-1+T]
    index = jnp.broadcast_to(jnp.arange(k - 1, k - 1 + t)[None, :], (b, t))
    path = [index]  # path[j]: the entry j steps up from each node
    for _ in range(k - 1):
        path.append(jnp.take_along_axis(prev, path[-1], axis=1))
    take = lambda idx: jnp.take_along_axis(ext, idx[..., None], axis=1)  # [B, T, C]
    inputs = [take(idx) for idx in reversed(path)]  # oldest first, the node itself last
    w = weight.astype(x.dtype)
    out = sum(inputs[j] * w[:, j] for j in range(k))
    states = jnp.stack(inputs[1:], axis=-1)  # [B, T, C, K-1]
    return jax.nn.silu(out), states.astype(conv_state.dtype)


def tree_gated_delta_rule(q, k, v, g, beta, state, parents):
    """The per-token recurrence over tree nodes: node i starts from the state after parents[b, i]
    (the initial state for -1). Shapes as recurrent_gated_delta_rule; parents i32 [B, T].
    Returns (out [B, T, H, Dv], the state after every node [B, T, H, Dk, Dv])."""
    b, t = parents.shape
    rows = jnp.arange(b)

    def step(states, inputs):
        i, parent, q_t, k_t, v_t, g_t, b_t = inputs
        previous = jnp.where((parent >= 0)[:, None, None, None], states[rows, jnp.maximum(parent, 0)], state)
        s = previous * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
        out_t = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        return states.at[:, i].set(s), out_t

    xs = (jnp.arange(t), parents.T) + tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta))
    states = jnp.zeros((b, t) + state.shape[1:], state.dtype)
    states, out = jax.lax.scan(step, states, xs)
    return jnp.swapaxes(out, 0, 1), states


def _capture(buffer: jax.Array, wanted: jax.Array, index, state: jax.Array) -> jax.Array:
    """buffer [B, S, ...] with the rows' entries whose `wanted` [B, S] equals `index` set to state [B, ...]."""
    hit = (wanted == index).reshape(wanted.shape + (1,) * (state.ndim - 1))
    return jnp.where(hit, state[:, None], buffer)


def recurrent_gated_delta_rule(q, k, v, g, beta, state, capture_at=None, keep_states: bool = False):
    """Per-token recurrence. q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv].

    All fp32; q already L2-normalised and scaled. Returns (out [B, T, H, Dv], final state); with
    `capture_at` i32 [B, S] also the states after the first capture_at[b, s] tokens [B, S, H, Dk, Dv];
    with keep_states the state after every token instead of the final one: [B, T, H, Dk, Dv].
    """

    def step(carry, inputs):
        s, buffer, t = carry
        q_t, k_t, v_t, g_t, b_t = inputs
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
        if buffer is not None:
            buffer = _capture(buffer, capture_at, t + 1, s)
        out_t = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        return (s, buffer, t + 1), ((out_t, s) if keep_states else out_t)

    buffer = None
    if capture_at is not None:
        buffer = _capture(jnp.zeros(capture_at.shape + state.shape[1:], state.dtype), capture_at, 0, state)
    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta))
    (state, buffer, _), out = jax.lax.scan(step, (state, buffer, jnp.int32(0)), xs)
    if keep_states:
        out, states = out
        return jnp.swapaxes(out, 0, 1), jnp.swapaxes(states, 0, 1)
    if capture_at is None:
        return jnp.swapaxes(out, 0, 1), state
    return jnp.swapaxes(out, 0, 1), state, buffer


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """(I + strict)^-1 for strictly lower triangular [..., C, C] (float32), from matmuls alone.

    The inverses of the diagonal blocks double in size each round: [[A, 0], [L, D]]^-1 is
    [[A^-1, 0], [-D^-1 L A^-1, D^-1]] (log2 C rounds of two batched matmuls; FLA's `solve_tril`
    merges blocks the same way). No LAPACK call, hence no CPU thread-pool deadlock (see
    `solve_unit_lower`); on random delta-rule systems it is as accurate as the triangular solve.
    """
    c = strict.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()  # pad to a power of two with the identity
    if size != c:
        pad = [(0, 0)] * (strict.ndim - 2) + [(0, size - c), (0, size - c)]
        return unit_lower_inverse(jnp.pad(strict, pad))[..., :c, :c]
    lead = strict.shape[:-2]
    dot = partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    inverse = jnp.ones(lead + (c, 1, 1), strict.dtype)  # [..., blocks, s, s]: the 1 x 1 diagonal
    s = 1
    while s < c:
        n = c // (2 * s)
        blocks = strict.reshape(lead + (n, 2 * s, n, 2 * s))
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., n, 2s, 2s]
        first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -dot(second, dot(blocks[..., s:, :s], first))
        inverse = jnp.concatenate(
            [jnp.concatenate([first, jnp.zeros_like(first)], -1), jnp.concatenate([corner, second], -1)], -2
        )
        s *= 2
    return inverse[..., 0, :, :]


def solve_unit_lower(strict: jax.Array, rhs: jax.Array) -> jax.Array:
    """X with (I + strict) X = rhs, for the chunked rule's [..., C, C] systems.

    On the CPU through `unit_lower_inverse`: jaxlib's CPU `triangular_solve` is a LAPACK call that
    splits its batch over XLA's intra-op pool and blocks until the pieces finish, and two of them
    running at once (in one program or in two in flight) deadlock a 2-thread pool
    (docs/model_config.md). Elsewhere the library's triangular solve.
    """
    if jax.default_backend() == "cpu":
        return jnp.matmul(unit_lower_inverse(strict), rhs, precision=jax.lax.Precision.HIGHEST)
    unit = strict + jnp.eye(strict.shape[-1], dtype=strict.dtype)
    return jax.lax.linalg.triangular_solve(unit, rhs, left_side=True, lower=True, unit_diagonal=True)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK, capture_chunks=None):
    """Chunked form of the same recurrence (WY representation within each chunk); same contract.

    With `capture_chunks` i32 [B, S] it also returns the state at the start of chunk
    capture_chunks[b, s] ([B, S, H, Dk, Dv]; the final state for index = number of chunks).
    """
    b, t, h, _ = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    n = (t + pad) // chunk

    def to_chunks(a):  # [B, T, H, ...] -> [B, H, N, C, ...]
        a = jnp.moveaxis(a, 2, 1)
        return a.reshape(a.shape[0], a.shape[1], n, chunk, *a.shape[3:])

    q, k, v, g, beta = (to_chunks(a) for a in (q, k, v, g, beta))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    strictly_lower = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    system = jnp.where(strictly_lower, jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay, 0.0)
    # One system, both right-hand sides: the values and the decayed keys.
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = solve_unit_lower(system, rhs)
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]  # [B, H, N, C, Dv], [B, H, N, C, Dk]
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

    def step(carry, inputs):
        s, buffer, c = carry
        if buffer is not None:
            buffer = _capture(buffer, capture_chunks, c, s)
        nv, kc, qd, kd, intra_i, cd = inputs
        v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kc, s)
        out = jnp.einsum("bhck,bhkv->bhcv", qd, s) + jnp.einsum("bhcj,bhjv->bhcv", intra_i, v_new)
        s = s * cd[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new)
        return (s, buffer, c + 1), out

    buffer = None
    if capture_chunks is not None:
        buffer = jnp.zeros(capture_chunks.shape + state.shape[1:], state.dtype)
    xs = tuple(
        jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay)
    )
    (state, buffer, _), out = jax.lax.scan(step, (state, buffer, jnp.int32(0)), xs)  # out [N, B, H, C, Dv]
    out = jnp.moveaxis(jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t], 1, 2)
    if capture_chunks is None:
        return out, state
    return out, state, _capture(buffer, capture_chunks, n, state)


def _rule_with_snapshots(q, k, v, g, beta, state, offsets):
    """The rule over the window plus the recurrent states after the first offsets[b, s] tokens.

    Returns (out, final state, snapshots [B, S, H, Dk, Dv] fp32). Short windows capture the
    snapshots inside the per-token recurrence. Longer ones capture, inside the one chunked scan,
    the state at the start of the 64-token chunk holding each offset, then finish it with that
    chunk alone with its tokens from the offset on masked out (beta = 0, decay 1: the identity).
    A snapshot costs one extra chunk, not a second walk over the prompt.
    """
    b, t = q.shape[:2]
    if t <= RECURRENT_MAX_TOKENS:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state, capture_at=offsets)
    s = offsets.shape[1]
    chunk_index = offsets // CHUNK
    out, final, starts = chunk_gated_delta_rule(q, k, v, g, beta, state, capture_chunks=chunk_index)
    token = chunk_index[..., None] * CHUNK + jnp.arange(CHUNK)  # [B, S, C]
    keep = token < offsets[..., None]
    token = jnp.minimum(token, t - 1)

    def window(a):  # [B, T, H, ...] -> [B * S, C, H, ...], tokens at or after the offset masked
        rows = jax.vmap(lambda x, idx: x[idx])(a, token)  # [B, S, C, H, ...]
        mask = keep.reshape(keep.shape + (1,) * (rows.ndim - 3))
        return jnp.where(mask, rows, 0).reshape((b * s, CHUNK) + a.shape[2:])

    flat = lambda a: a.reshape((b * s,) + a.shape[2:])
    _, finished = chunk_gated_delta_rule(
        window(q), window(k), window(v), window(g), window(beta), flat(starts)
    )
    return out, final, finished.reshape(starts.shape)


def _conv_states_at(conv_state: jax.Array, x: jax.Array, offsets: jax.Array) -> jax.Array:
    """Conv states after the first offsets[b, s] raw inputs: [B, S, C, K-1] (the K-1 inputs before each offset)."""
    keep = conv_state.shape[-1]
    ext = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    take = jax.vmap(jax.vmap(lambda e, j: jax.lax.dynamic_slice_in_dim(e, j, keep, axis=0), (None, 0)))
    states = take(ext, jnp.maximum(offsets, 0))  # [B, S, K-1, C]
    return jnp.swapaxes(states, 2, 3).astype(conv_state.dtype)


def _output_projection(p: GDNParams, out: jax.Array, z: jax.Array, cfg: ModelConfig) -> jax.Array:
    """out_proj of the gated output norm of out [B, T, Hv, Dv] (z its gate): [B, T, D]. The
    projection may take its float16 rows from the norm's own launch (`NormSource` with the gate)."""
    b, t, hv, dv = z.shape
    normed = gated_rms_norm(out, z, p.norm, cfg.rms_norm_eps).reshape(b, t, hv * dv)
    norm = NormSource(out.reshape(b, t, hv * dv), p.norm, cfg.rms_norm_eps, gate=z.reshape(b, t, hv * dv))
    return matmul(normed, p.out_proj, norm)


def gated_deltanet(
    p: GDNParams,
    x: jax.Array,
    positions: jax.Array,
    state: GDNState | SlottedGDNState,
    cfg: ModelConfig,
    snapshot_at: jax.Array | None = None,
    keep_states: bool = False,
    tree_parents: jax.Array | None = None,
    norm: NormSource | None = None,
):
    """x [B, T, D] at positions [B, T] -> (out [B, T, D], new state). A row starting at position 0 starts fresh.

    With `snapshot_at` i32 [B, S] (token counts within the window, 0..T; entries < 0 are unused)
    it returns a third value: the states after that many tokens of each row (GDNState with
    conv [B, S, C, K-1] and recurrent [B, S, H, Dk, Dv]): the prefix cache's snapshots, taken
    inside the walk.

    keep_states (speculative verification): the returned GDNState holds the state after every
    position instead of the final one, conv [B, T, C, K-1] and recurrent [B, T, Hv, Dk, Dv], so that
    the caller keeps the one at the accepted length without recomputing (windows of at most
    RECURRENT_MAX_TOKENS tokens; positions past a row's valid tokens repeat its last state).

    tree_parents i32 [B, T] (a tree-shaped verify window; each node's parent index, -1 for the
    root): as keep_states, the state after every node, each node continuing its parent's state.

    A SlottedGDNState `state` comes back as a SlottedGDNState with the rows' new states in their
    slots (not with keep_states or tree_parents, whose per-position states are the caller's to pick).

    norm: x is that RMSNorm's output (the layer's input norm; `weights.quant.NormSource`).
    """
    keep_states = keep_states or tree_parents is not None
    if keep_states and x.shape[1] > RECURRENT_MAX_TOKENS:
        raise ValueError(f"keep_states needs a window of <= {RECURRENT_MAX_TOKENS} tokens, got {x.shape[1]}")
    slotted = state if isinstance(state, SlottedGDNState) else None
    if slotted is not None and keep_states:
        raise ValueError(
            "a slotted state keeps the final state only: gather it for keep_states / tree_parents"
        )
    b, t, _ = x.shape
    hk, hv = cfg.linear_num_k_heads, cfg.linear_num_v_heads
    dk, dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
    in_place, interpret = False, False
    if slotted is not None and snapshot_at is None and t <= RECURRENT_MAX_TOKENS:
        in_place, interpret = use_recurrent_kernel(t, dk, dv)
    if slotted is not None and not in_place:
        state = slotted.gather()
    valid = positions >= 0
    n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
    fresh = positions[:, 0] == 0

    projections = (p.in_proj_qkv, p.in_proj_z, p.in_proj_b, p.in_proj_a)
    joined = matmuls_joined(x, projections, norm) if in_place else None
    if joined is not None:  # one array: the kernel reads q | k | v, b and a at their columns (no slices)
        projected, (c_qkv, c_z, c_b, c_a) = joined
        # its readers take the array as written (the kernel reads it anyway): at the 27B's shapes XLA
        # otherwise redid its partial sums inside the output norm's reduce and split that in two
        projected = jax.lax.optimization_barrier(projected)
        z = projected[..., c_z : c_z + hv * dv].reshape(b, t, hv, dv)
        out, entry = slotted.recurrent_update(
            projected, projected, projected, (p.conv_weight, p.A_log, p.dt_bias), fresh, n_valid, key_heads=hk,
            interpret=interpret, columns=(c_qkv, c_b, c_a),
        )  # fmt: skip
        return _output_projection(p, out, z, cfg), entry
    mixed, z, b_in, a_in = matmuls(x, projections, norm)  # one launch
    z = z.reshape(b, t, hv, dv)
    if in_place:  # conv, gates and recurrence on the rows' slots in one kernel
        out, entry = slotted.recurrent_update(
            mixed, b_in, a_in, (p.conv_weight, p.A_log, p.dt_bias), fresh, n_valid, key_heads=hk,
            interpret=interpret,
        )  # fmt: skip
        return _output_projection(p, out, z, cfg), entry

    conv_state = jnp.where(fresh[:, None, None], 0, state.conv)
    raw = mixed
    if tree_parents is None:
        mixed, new_conv = causal_conv(mixed, conv_state, p.conv_weight, n_valid, keep_states)
    else:
        mixed, new_conv = tree_causal_conv(mixed, conv_state, p.conv_weight, tree_parents)
    g, beta = gates(b_in, a_in, p.A_log, p.dt_bias, valid)

    key_dim = cfg.linear_key_dim
    q = mixed[..., :key_dim].reshape(b, t, hk, dk)
    k = mixed[..., key_dim : 2 * key_dim].reshape(b, t, hk, dk)
    v = mixed[..., 2 * key_dim :].reshape(b, t, hv, dv)
    rec_state = jnp.where(fresh[:, None, None, None], 0, state.recurrent)
    if hv != hk:  # v-head h reads k-head h // (hv / hk)
        q = jnp.repeat(q, hv // hk, axis=2)
        k = jnp.repeat(k, hv // hk, axis=2)
    q = l2_normalize(q.astype(jnp.float32)) * (dk**-0.5)
    k = l2_normalize(k.astype(jnp.float32))
    v = v.astype(jnp.float32)
    if tree_parents is not None:
        out, new_rec = tree_gated_delta_rule(q, k, v, g, beta, rec_state, tree_parents)
    elif keep_states:
        out, new_rec = recurrent_gated_delta_rule(q, k, v, g, beta, rec_state, keep_states=True)
    elif snapshot_at is None:
        rule = recurrent_gated_delta_rule if t <= RECURRENT_MAX_TOKENS else chunk_gated_delta_rule
        out, new_rec = rule(q, k, v, g, beta, rec_state)
    else:
        offsets = jnp.clip(snapshot_at, 0, t)
        out, new_rec, rec_snapshots = _rule_with_snapshots(q, k, v, g, beta, rec_state, offsets)
    new_state = GDNState(conv=new_conv, recurrent=new_rec)
    result = (
        _output_projection(p, out.astype(x.dtype), z, cfg),
        new_state if slotted is None else slotted.commit(new_state),
    )
    if snapshot_at is None:
        return result
    snapshots = GDNState(conv=_conv_states_at(conv_state, raw, offsets), recurrent=rec_snapshots)
    return (*result, snapshots)
