"""The gated delta rule's per-token recurrence (decode, short windows) in place on the state pool:
a Pallas GPU (Triton) kernel.

A Gated DeltaNet layer's decode reads and rewrites a float32 state of Hv x Dk x Dv per sequence
(3 MB a layer for Qwen3.5-27B, 48 such layers). XLA's form of the step gathers the rows' states
out of the pool, updates them over several fusions (decay, the k.S read, the rank-1 write, the
q.S read), and scatters them back: several state-sized passes and up to five launches a layer,
~15 us a layer on the H200 (docs/pallas.md, "Gated delta decode"). Here one launch reads each row's
state straight from its slot once, keeps it in registers over the window's tokens, and writes it
back into the same slot (the pool is aliased to the output: no gather, no scatter, no copy).

For row b, value head h (key head h // (Hv / Hk)) and each token t of the window:

    q, k  = l2norm(q_t) / sqrt(Dk), l2norm(k_t)         (from the conv output, as the model does)
    S     = S * exp(g_t)
    S     = S + k (beta_t * (v_t - k^T S))               (S is [Dk, Dv])
    o_t   = q^T S

* Grid (B, Hv, Dv / block_v): each program owns a [Dk, block_v] column block of one row's state
  for one head; the columns are independent in every step above, so programs never meet.
* The conv output `mixed` [B, T, 2 Hk Dk + Hv Dv] goes in whole (q | k | v channels, the layout
  of the GDN input projection): no slices are materialised between the conv and the kernel.
* `fresh` rows start from zeros (their slot is not read); rows aimed at `drop_slot` (the pool's
  scratch slot of padding rows) compute but write no state.
* Padding tokens carry g = 0 and beta = 0 (the caller's convention), which leaves the state as
  it was: no token mask is needed here.

`gated_delta_conv_decode` folds the layer's work between its input projection and this
recurrence into the same launch: the causal depthwise conv (+ SiLU) over the raw q | k | v
channels, each row's conv state read from its slot of the conv pool, and the gates
beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias) with padding tokens (past `n_valid`)
zeroed. Without it XLA runs the conv state's gather, the conv and the gates as launches of their
own around the kernel. The rows' new conv states come out as a batch for the caller to scatter:
written into the pool in place they would race, since every program of a key head reads that
head's q / k conv state and one of them would have overwritten it (seen on an H100 as wrong
outputs in some tile shapes; the interpreter runs programs on a copy and cannot show it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import compat

MAX_TOKENS = 16  # tokens per row the kernel unrolls (the model's RECURRENT_MAX_TOKENS)
NORM_EPS = 1e-6  # l2 normalisation epsilon of q and k (the model's l2_normalize)
DEFAULT_BLOCK_V = 32  # state columns per program: [Dk, 32] float32 is 32 registers a thread at 4 warps
DEFAULT_NUM_WARPS = 4


def _l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + NORM_EPS)


def reference_gated_delta_decode(
    mixed: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    key_heads: int,
    drop_slot: int = 0,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Plain-JAX reference: (out [B, T, Hv, Dv], the pool with the rows' new states in their slots).

    mixed [B, T, 2 Hk Dk + Hv Dv] (q | k | v after the conv), g / beta [B, T, Hv] float32 (log
    decay and write strength; 0 on padding tokens), pool [S, Hv, Dk, Dv] float32, slots [B] int32,
    fresh [B] bool (start from zeros). Writes to `drop_slot` are dropped."""
    b, t, _ = mixed.shape
    _, hv, dk, dv = pool.shape
    key_dim = key_heads * dk
    f32 = jnp.float32
    q = mixed[..., :key_dim].reshape(b, t, key_heads, dk).astype(f32)
    k = mixed[..., key_dim : 2 * key_dim].reshape(b, t, key_heads, dk).astype(f32)
    v = mixed[..., 2 * key_dim :].reshape(b, t, hv, dv).astype(f32)
    q = jnp.repeat(_l2_normalize(q) * dk**-0.5, hv // key_heads, axis=2)
    k = jnp.repeat(_l2_normalize(k), hv // key_heads, axis=2)
    state = jnp.where(fresh[:, None, None, None], 0.0, pool[slots])
    hi = jax.lax.Precision.HIGHEST
    outs = []
    for i in range(t):
        state = state * jnp.exp(g[:, i])[..., None, None]
        read = jnp.einsum("bhkv,bhk->bhv", state, k[:, i], precision=hi)
        delta = (v[:, i] - read) * beta[:, i][..., None]
        state = state + k[:, i][..., None] * delta[..., None, :]
        outs.append(jnp.einsum("bhkv,bhk->bhv", state, q[:, i], precision=hi))
    out = jnp.stack(outs, axis=1).astype(mixed.dtype if out_dtype is None else out_dtype)
    target = jnp.where(slots == drop_slot, pool.shape[0], slots)  # out of range -> dropped
    return out, pool.at[target].set(state, mode="drop")


def _recurrence_step(state, q, k, v, g, beta, dk: int):
    """One token on a [Dk, block_v] float32 state block: q, k [Dk] and v [block_v] float32 as the
    conv gives them (normalised here), g / beta scalars. Returns (state, out [block_v])."""
    q = q * (jax.lax.rsqrt(jnp.sum(q * q) + NORM_EPS) * dk**-0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + NORM_EPS)
    state = state * jnp.exp(g)
    read = jnp.sum(state * k[:, None], axis=0)  # [block_v]
    delta = (v - read) * beta
    state = state + k[:, None] * delta[None, :]
    return state, jnp.sum(state * q[:, None], axis=0)


def _gated_delta_decode_kernel(
    slots_ref,  # [B] int32
    fresh_ref,  # [B] int32 (1: start from zeros)
    mixed_ref,  # [B, T, C] conv output: q | k | v channels
    g_ref,  # [B, T, Hv] float32
    beta_ref,  # [B, T, Hv] float32
    pool_ref,  # [S, Hv, Dk, Dv] float32 (aliased to state_ref)
    out_ref,  # [B, T, Hv, Dv]
    state_ref,  # [S, Hv, Dk, Dv] float32: the pool, written in place
    *,
    tokens: int,
    group: int,
    key_dim: int,
    dk: int,
    dv: int,
    block_v: int,
    drop_slot: int,
):
    b, h, j = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    slot = slots_ref[b]
    fresh = fresh_ref[b] != 0
    kh = h // group
    v0 = j * block_v
    block = pool_ref.at[slot, h, slice(None), compat.ds(v0, block_v)]  # [Dk, block_v]
    state = compat.load(block, mask=jnp.broadcast_to(~fresh, (dk, block_v)), other=0.0)
    f32 = jnp.float32
    for i in range(tokens):
        t = jnp.int32(i)  # a traced index: the interpreter's loads take no Python ints beside slices
        q = compat.load(mixed_ref.at[b, t, compat.ds(kh * dk, dk)]).astype(f32)
        k = compat.load(mixed_ref.at[b, t, compat.ds(key_dim + kh * dk, dk)]).astype(f32)
        v = compat.load(mixed_ref.at[b, t, compat.ds(2 * key_dim + h * dv + v0, block_v)]).astype(f32)
        state, out = _recurrence_step(state, q, k, v, g_ref[b, t, h], beta_ref[b, t, h], dk)
        compat.store(out_ref.at[b, t, h, compat.ds(v0, block_v)], out.astype(out_ref.dtype))

    @compat.when(slot != drop_slot)
    def _():
        compat.store(state_ref.at[slot, h, slice(None), compat.ds(v0, block_v)], state)


def _silu_rounded(y: jax.Array, dtype) -> jax.Array:
    """SiLU in float32, rounded to the activations' dtype (where the unfused path stores the conv
    output between the conv and the recurrence)."""
    return (y / (1.0 + jnp.exp(-y))).astype(dtype).astype(jnp.float32)


def _gates(b_in, a_in, a_log, dt_bias, valid):
    """(g, beta) float32 from the b / a projections: g = -exp(A_log) softplus(a + dt_bias), beta =
    sigmoid(b), both 0 where not `valid` (softplus and sigmoid written out: Triton has neither)."""
    f32 = jnp.float32
    a = a_in.astype(f32) + dt_bias.astype(f32)
    softplus = jnp.maximum(a, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(a)))
    g = jnp.where(valid, -jnp.exp(a_log.astype(f32)) * softplus, 0.0)
    beta = jnp.where(valid, 1.0 / (1.0 + jnp.exp(-b_in.astype(f32))), 0.0)
    return g, beta


def reference_gated_delta_conv_decode(
    raw: jax.Array,
    b_in: jax.Array,
    a_in: jax.Array,
    conv_weight: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    conv_pool: jax.Array,
    pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    n_valid: jax.Array,
    *,
    key_heads: int,
    drop_slot: int = 0,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-JAX reference: (out [B, T, Hv, Dv], the rows' new conv states [B, C, W-1], the pool
    with the rows' new recurrent states in their slots).

    raw [B, T, C] the input projection's q | k | v channels before the conv, b_in / a_in [B, T, Hv]
    the b / a projections, conv_weight [C, W], a_log / dt_bias [Hv], conv_pool [S, C, W-1] (the
    last W-1 raw inputs of each slot), pool [S, Hv, Dk, Dv] float32, slots [B], fresh [B] bool,
    n_valid [B] int (tokens 0..n_valid-1 of a row are real, the rest padding)."""
    t = raw.shape[1]
    width = conv_weight.shape[1]
    f32 = jnp.float32
    state = jnp.where(fresh[:, None, None], 0.0, conv_pool[slots].astype(f32))  # [B, C, W-1]
    ext = jnp.concatenate([jnp.swapaxes(state, 1, 2), raw.astype(f32)], axis=1)  # [B, W-1+T, C]
    w = conv_weight.astype(f32)
    conv = sum(ext[:, i : i + t] * w[:, i] for i in range(width))
    mixed = _silu_rounded(conv, raw.dtype)
    kept = jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, width - 1, axis=0))(ext, n_valid)
    valid = (jnp.arange(t)[None, :] < n_valid[:, None])[..., None]
    g, beta = _gates(b_in, a_in, a_log, dt_bias, valid)
    out, pool = reference_gated_delta_decode(
        mixed, g, beta, pool, slots, fresh, key_heads=key_heads, drop_slot=drop_slot,
        out_dtype=raw.dtype if out_dtype is None else out_dtype,
    )  # fmt: skip
    return out, jnp.swapaxes(kept, 1, 2).astype(conv_pool.dtype), pool


def _gated_delta_conv_kernel(
    slots_ref,  # [B] int32
    fresh_ref,  # [B] int32 (1: start from zeros)
    valid_ref,  # [B] int32: real tokens of the row (the rest are padding)
    raw_ref,  # [B, T, C] q | k | v channels before the conv
    b_ref,  # [B, T, Hv] the b projection (beta before its sigmoid)
    a_ref,  # [B, T, Hv] the a projection
    w_ref,  # [C, W] conv weight
    a_log_ref,  # [Hv]
    dt_bias_ref,  # [Hv]
    conv_ref,  # [S, C, W-1] conv pool (read only: see conv_out_ref)
    pool_ref,  # [S, Hv, Dk, Dv] float32 (aliased to state_ref)
    out_ref,  # [B, T, Hv, Dv]
    conv_out_ref,  # [B, C, W-1] the rows' new conv states: not the pool in place, since a key
    # head's q / k channels are read by all of its programs and one of them would overwrite them
    state_ref,  # [S, Hv, Dk, Dv]: the pool, written in place
    *,
    tokens: int,
    group: int,
    key_dim: int,
    dk: int,
    dv: int,
    block_v: int,
    width: int,
    drop_slot: int,
    columns: tuple[int, int, int] = (0, 0, 0),  # where q | k | v, b and a start in their refs' last axis
):
    b, h, j = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    raw_col0, b_col0, a_col0 = columns
    slot = slots_ref[b]
    fresh = fresh_ref[b] != 0
    n_valid = valid_ref[b]
    kh = h // group
    v0 = j * block_v
    f32 = jnp.float32

    def conv(c0: int, n: int, owner) -> list[jax.Array]:
        """The conv + SiLU of channels c0 .. c0+n for every token; their new conv state is written
        by the `owner` program only (the q / k channels are shared by a key head's programs)."""
        taps = [compat.load(w_ref.at[compat.ds(c0, n), jnp.int32(i)]).astype(f32) for i in range(width)]
        window = [
            compat.load(conv_ref.at[slot, compat.ds(c0, n), jnp.int32(i)], mask=jnp.broadcast_to(~fresh, (n,)),
                        other=0.0).astype(f32)
            for i in range(width - 1)
        ]  # fmt: skip
        kept, outs = window, []
        for i in range(tokens):
            window = window + [compat.load(raw_ref.at[b, jnp.int32(i), compat.ds(raw_col0 + c0, n)]).astype(f32)]
            outs.append(_silu_rounded(sum(x * w for x, w in zip(window, taps)), raw_ref.dtype))
            window = window[1:]
            kept = [jnp.where(i < n_valid, x, y) for x, y in zip(window, kept)]

        @compat.when(owner)
        def _():
            for i, x in enumerate(kept):
                compat.store(conv_out_ref.at[b, compat.ds(c0, n), jnp.int32(i)], x.astype(conv_out_ref.dtype))

        return outs

    qk_owner = (h % group == 0) & (j == 0)
    qs = conv(kh * dk, dk, qk_owner)
    ks = conv(key_dim + kh * dk, dk, qk_owner)
    vs = conv(2 * key_dim + h * dv + v0, block_v, True)
    a_log, dt_bias = a_log_ref[h], dt_bias_ref[h]
    block = pool_ref.at[slot, h, slice(None), compat.ds(v0, block_v)]  # [Dk, block_v]
    state = compat.load(block, mask=jnp.broadcast_to(~fresh, (dk, block_v)), other=0.0)
    for i in range(tokens):
        t = jnp.int32(i)
        g, beta = _gates(b_ref[b, t, b_col0 + h], a_ref[b, t, a_col0 + h], a_log, dt_bias, i < n_valid)
        state, out = _recurrence_step(state, qs[i], ks[i], vs[i], g, beta, dk)
        compat.store(out_ref.at[b, t, h, compat.ds(v0, block_v)], out.astype(out_ref.dtype))

    @compat.when(slot != drop_slot)
    def _():
        compat.store(state_ref.at[slot, h, slice(None), compat.ds(v0, block_v)], state)


def _validate_window(mixed, pool, slots, fresh, key_heads: int, block_v: int) -> tuple[int, int, int]:
    """The checks both forms share (channels, heads, window, slots, tiles); returns (B, T, Hv)."""
    if mixed.ndim != 3:
        raise ValueError(f"mixed must be [B, T, C]; got shape {mixed.shape}")
    b, t, c = mixed.shape
    if pool.ndim != 4 or pool.dtype != jnp.float32:
        raise ValueError(f"pool must be float32 [S, Hv, Dk, Dv]; got {pool.dtype} {pool.shape}")
    _, hv, dk, dv = pool.shape
    if key_heads < 1 or hv % key_heads:
        raise ValueError(f"value heads ({hv}) must be a multiple of key_heads ({key_heads})")
    if c != 2 * key_heads * dk + hv * dv:
        raise ValueError(f"mixed has {c} channels; q | k | v needs 2 * {key_heads} * {dk} + {hv} * {dv}")
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"windows of 1..{MAX_TOKENS} tokens; got {t}")
    if slots.shape != (b,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be integer [{b}]; got {slots.dtype} {slots.shape}")
    if fresh.shape != (b,):
        raise ValueError(f"fresh must be [{b}]; got {fresh.shape}")
    for name, n in (("Dk", dk), ("Dv", dv), ("block_v", block_v)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two >= 16 (Triton tiles)")
    if dv % block_v:
        raise ValueError(f"block_v={block_v} must divide Dv={dv}")
    return b, t, hv


def validate_gated_delta_decode(mixed, g, beta, pool, slots, fresh, key_heads: int, block_v: int) -> None:
    """Raise ValueError for inputs the kernel does not take (shapes, dtypes, tile sizes)."""
    b, t, hv = _validate_window(mixed, pool, slots, fresh, key_heads, block_v)
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv) or x.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 [{b}, {t}, {hv}]; got {x.dtype} {x.shape}")


def validate_gated_delta_conv_decode(
    raw, b_in, a_in, conv_weight, a_log, dt_bias, conv_pool, pool, slots, fresh, n_valid, key_heads: int,
    block_v: int, columns: tuple[int, int, int] | None = None,
) -> None:  # fmt: skip
    """Raise ValueError for inputs the conv form does not take."""
    if columns is None:
        b, t, hv = _validate_window(raw, pool, slots, fresh, key_heads, block_v)
        c = raw.shape[2]
        for name, x in (("b_in", b_in), ("a_in", a_in)):
            if x.shape != (b, t, hv):
                raise ValueError(f"{name} must be [{b}, {t}, {hv}]; got {x.shape}")
    else:  # one array holds all three: q | k | v, b and a each within its last axis from its column
        c = conv_weight.shape[0] if conv_weight.ndim == 2 else -1
        view = jax.ShapeDtypeStruct((*raw.shape[:2], c), raw.dtype) if raw.ndim == 3 else raw
        b, t, hv = _validate_window(view, pool, slots, fresh, key_heads, block_v)
        for name, x, col, n in (("q | k | v", raw, columns[0], c), ("b", b_in, columns[1], hv),
                                ("a", a_in, columns[2], hv)):  # fmt: skip
            if x.ndim != 3 or x.shape[:2] != (b, t):
                raise ValueError(f"with columns, {name}'s array must be [{b}, {t}, C']; got {x.shape}")
            if not 0 <= col <= x.shape[2] - n:
                raise ValueError(f"{name} at column {col} does not fit its array's {x.shape[2]} columns ({n} wide)")
    if conv_weight.ndim != 2 or conv_weight.shape[0] != c or conv_weight.shape[1] < 2:
        raise ValueError(f"conv_weight must be [{c}, W >= 2]; got {conv_weight.shape}")
    width = conv_weight.shape[1]
    if conv_pool.shape != (pool.shape[0], c, width - 1):
        raise ValueError(f"conv_pool must be [{pool.shape[0]}, {c}, {width - 1}]; got {conv_pool.shape}")
    for name, x in (("a_log", a_log), ("dt_bias", dt_bias)):
        if x.shape != (hv,):
            raise ValueError(f"{name} must be [{hv}]; got {x.shape}")
    if n_valid.shape != (b,) or not jnp.issubdtype(n_valid.dtype, jnp.integer):
        raise ValueError(f"n_valid must be integer [{b}]; got {n_valid.dtype} {n_valid.shape}")


def supports(dk: int, dv: int, tokens: int) -> bool:
    """True for head sizes and windows the kernel takes (power-of-two heads >= 16, <= MAX_TOKENS)."""
    pow2 = lambda n: n >= 16 and not n & (n - 1)
    return pow2(dk) and pow2(dv) and 1 <= tokens <= MAX_TOKENS


@functools.partial(
    jax.jit,
    static_argnames=("key_heads", "block_v", "num_warps", "drop_slot", "out_dtype", "interpret"),
    donate_argnames=("pool",),
)
def gated_delta_decode(
    mixed: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    key_heads: int,
    block_v: int = DEFAULT_BLOCK_V,
    num_warps: int = DEFAULT_NUM_WARPS,
    drop_slot: int = 0,
    out_dtype=None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel: same contract as `reference_gated_delta_decode` (the pool is donated and
    updated in place)."""
    return gated_delta_decode_call(
        mixed, g, beta, pool, slots, fresh, key_heads=key_heads, block_v=block_v, num_warps=num_warps,
        drop_slot=drop_slot, out_dtype=out_dtype, interpret=interpret,
    )  # fmt: skip


def gated_delta_decode_call(
    mixed, g, beta, pool, slots, fresh, *, key_heads, block_v=DEFAULT_BLOCK_V, num_warps=DEFAULT_NUM_WARPS,
    drop_slot=0, out_dtype=None, interpret=False,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`gated_delta_decode` without the jit, for callers inside a traced program (whose own
    donation keeps the pool in place): block_v cut to Dv, the inputs validated, one pallas_call."""
    block_v = min(block_v, pool.shape[3])
    validate_gated_delta_decode(mixed, g, beta, pool, slots, fresh, key_heads, block_v)
    b, t, _ = mixed.shape
    _, hv, dk, dv = pool.shape
    kernel = functools.partial(
        _gated_delta_decode_kernel, tokens=t, group=hv // key_heads, key_dim=key_heads * dk, dk=dk,
        dv=dv, block_v=block_v, drop_slot=drop_slot,
    )  # fmt: skip
    out_dtype = mixed.dtype if out_dtype is None else out_dtype
    return compat.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, t, hv, dv), out_dtype),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ),
        grid=(b, hv, dv // block_v),
        input_output_aliases={5: 1},
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gated_delta_decode",
    )(slots.astype(jnp.int32), fresh.astype(jnp.int32), mixed, g, beta, pool)


@functools.partial(
    jax.jit,
    static_argnames=("key_heads", "block_v", "num_warps", "drop_slot", "out_dtype", "interpret", "columns"),
    donate_argnames=("pool",),
)
def gated_delta_conv_decode(
    raw: jax.Array,
    b_in: jax.Array,
    a_in: jax.Array,
    conv_weight: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    conv_pool: jax.Array,
    pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    n_valid: jax.Array,
    *,
    key_heads: int,
    block_v: int = DEFAULT_BLOCK_V,
    num_warps: int = DEFAULT_NUM_WARPS,
    drop_slot: int = 0,
    out_dtype=None,
    interpret: bool = False,
    columns: tuple[int, int, int] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The conv, the gates and the recurrence in one kernel: same contract as
    `reference_gated_delta_conv_decode` (the pool donated and updated in place; `columns`: see
    `gated_delta_conv_decode_call`)."""
    return gated_delta_conv_decode_call(
        raw, b_in, a_in, conv_weight, a_log, dt_bias, conv_pool, pool, slots, fresh, n_valid,
        key_heads=key_heads, block_v=block_v, num_warps=num_warps, drop_slot=drop_slot, out_dtype=out_dtype,
        interpret=interpret, columns=columns,
    )  # fmt: skip


def gated_delta_conv_decode_call(
    raw, b_in, a_in, conv_weight, a_log, dt_bias, conv_pool, pool, slots, fresh, n_valid, *, key_heads,
    block_v=DEFAULT_BLOCK_V, num_warps=DEFAULT_NUM_WARPS, drop_slot=0, out_dtype=None, interpret=False,
    columns=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """`gated_delta_conv_decode` without the jit (for traced programs, as `gated_delta_decode_call`).

    columns: (q | k | v, b, a) first columns when raw is one array [B, T, C'] holding all three
    (the GDN input projections' joined output, `weights.quant.matmuls_joined`; pass it as raw,
    b_in and a_in alike): the kernel reads each at its column, so no slice of it is made first."""
    block_v = min(block_v, pool.shape[3])
    validate_gated_delta_conv_decode(
        raw, b_in, a_in, conv_weight, a_log, dt_bias, conv_pool, pool, slots, fresh, n_valid, key_heads, block_v,
        columns,
    )  # fmt: skip
    b, t, _ = raw.shape
    _, hv, dk, dv = pool.shape
    kernel = functools.partial(
        _gated_delta_conv_kernel, tokens=t, group=hv // key_heads, key_dim=key_heads * dk, dk=dk, dv=dv,
        block_v=block_v, width=conv_weight.shape[1], drop_slot=drop_slot, columns=tuple(columns or (0, 0, 0)),
    )  # fmt: skip
    i32 = jnp.int32
    return compat.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, t, hv, dv), raw.dtype if out_dtype is None else out_dtype),
            jax.ShapeDtypeStruct((b, conv_weight.shape[0], conv_pool.shape[2]), conv_pool.dtype),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ),
        grid=(b, hv, dv // block_v),
        input_output_aliases={10: 2},
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gated_delta_conv_decode",
    )(slots.astype(i32), fresh.astype(i32), n_valid.astype(i32), raw, b_in, a_in, conv_weight, a_log, dt_bias,
      conv_pool, pool)  # fmt: skip
