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
        q = q * (jax.lax.rsqrt(jnp.sum(q * q) + NORM_EPS) * dk**-0.5)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + NORM_EPS)
        state = state * jnp.exp(g_ref[b, t, h])
        read = jnp.sum(state * k[:, None], axis=0)  # [block_v]
        delta = (v - read) * beta_ref[b, t, h]
        state = state + k[:, None] * delta[None, :]
        out = jnp.sum(state * q[:, None], axis=0)
        compat.store(out_ref.at[b, t, h, compat.ds(v0, block_v)], out.astype(out_ref.dtype))

    @compat.when(slot != drop_slot)
    def _():
        compat.store(state_ref.at[slot, h, slice(None), compat.ds(v0, block_v)], state)


def validate_gated_delta_decode(mixed, g, beta, pool, slots, fresh, key_heads: int, block_v: int) -> None:
    """Raise ValueError for inputs the kernel does not take (shapes, dtypes, tile sizes)."""
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
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv) or x.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 [{b}, {t}, {hv}]; got {x.dtype} {x.shape}")
    if slots.shape != (b,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be integer [{b}]; got {slots.dtype} {slots.shape}")
    if fresh.shape != (b,):
        raise ValueError(f"fresh must be [{b}]; got {fresh.shape}")
    for name, n in (("Dk", dk), ("Dv", dv), ("block_v", block_v)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two >= 16 (Triton tiles)")
    if dv % block_v:
        raise ValueError(f"block_v={block_v} must divide Dv={dv}")


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
