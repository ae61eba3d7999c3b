"""The MTP head as a drafter: chained for several tokens over its own KV (pure, jittable).

The checkpoint's MTP layer(s) read a token x_{i+1} and the target's final hidden h_i at the target's
position i and predict x_{i+2} (model/forward.py, `mtp_forward`). Keeping their KV right needs one
MTP pass over every committed position, with the next token beside each hidden state: the
programs run it over each prefill chunk and each verified window (`shifted_mtp_pass`), so the MTP
cache always holds every committed position. The last entry of that pass reads the newest token
(the one the next window starts with) and gives the first draft; `chain_drafts` then feeds each
draft back with the MTP's own hidden state, one position further each time, for the rest. The
chain's own KV writes land past the committed length and are overwritten when the real tokens
arrive (as in verify rollback), or are dropped past the row's blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from infernix_jax.cache.sequence import SequenceCache
from infernix_jax.config import ModelConfig
from infernix_jax.model.forward import mtp_forward
from infernix_jax.model.params import Params


def shifted_mtp_pass(
    params: Params,
    next_tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    last: jax.Array,
    cache: SequenceCache,
    cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array, SequenceCache]:
    """MTP over a window whose target hiddens [b, t, D] sit at positions [b, t] (-1 = padding), each
    paired with the token that follows it, next_tokens [b, t]. Writes the MTP KV of every valid
    position. Returns the logits f32 [b, V] and MTP hidden [b, D] at window index last [b]."""
    logits, mtp_hidden, cache = mtp_forward(params, next_tokens, hidden, positions, cache, cfg)
    at = lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return at(logits), at(mtp_hidden), cache


def chain_drafts(
    params: Params,
    first_logits: jax.Array,
    first_hidden: jax.Array,
    position: jax.Array,
    active: jax.Array,
    cache: SequenceCache,
    cfg: ModelConfig,
    steps: int,
    branches: int = 0,
) -> tuple[jax.Array, SequenceCache]:
    """Greedy MTP drafts i32 [b, steps]: the argmax of first_logits [b, V] (the MTP output at the
    newest committed position, position [b]), then steps - 1 chained MTP steps at position + j.
    Rows with active [b] False feed padding (no KV writes).

    branches > 0 (tree drafting): the result is [b, steps + branches], the chain followed by the
    next `branches` most likely first tokens (the chain's first token is the most likely one);
    they become siblings of the chain's first node."""
    first = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)
    alternatives = jax.lax.top_k(first_logits, branches + 1)[1][:, 1:].astype(jnp.int32)
    if steps == 1:
        return jnp.concatenate([first[:, None], alternatives], axis=1), cache

    def step(carry, j):
        token, hidden, cache = carry
        pos = jnp.where(active, position + j, -1)[:, None]
        logits, out, cache = mtp_forward(params, token[:, None], hidden[:, None], pos, cache, cfg)
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (nxt, out[:, 0], cache), nxt

    (_, _, cache), rest = jax.lax.scan(step, (first, first_hidden, cache), jnp.arange(1, steps))
    return jnp.concatenate([first[:, None], rest.T, alternatives], axis=1), cache
