"""`infernix_jax.load(path)`: a loaded model for scripts, research and the command lines.

`Model` runs one sequence at a time on the pure `forward`: prompts are prefilled in chunks whose
lengths come from a fixed set of buckets (the last chunk padded), decoding runs one token per
step, and the cache has a fixed capacity, so after `warmup()` no prompt length triggers a new
compilation. The serving engine (engine/) batches many requests; this is the simple path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.cache.sequence import SequenceCache, init_cache
from infernix_jax.chat.detokenizer import IncrementalDetokenizer
from infernix_jax.chat.tokenizer import Tokenizer
from infernix_jax.config import ModelConfig
from infernix_jax.jit import jit
from infernix_jax.model.forward import forward
from infernix_jax.model.params import Params
from infernix_jax.weights.artifact import is_artifact, load_artifact_params
from infernix_jax.weights.hf import load_params

PREFILL_BUCKETS = (16, 64, 256, 1024)  # chunk lengths; a prompt is cut into chunks of these sizes


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (the stop token or string is not included)
    text: str
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length"
    prompt_tokens: int = 0


def default_dtype() -> jnp.dtype:
    """bfloat16 on accelerators, float32 on the CPU (exact checks, and CPUs lack fast bf16 matmul)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def chunk_plan(length: int, buckets: Sequence[int] = PREFILL_BUCKETS) -> list[tuple[int, int]]:
    """Split `length` prompt tokens into (valid tokens, bucket) chunks: full largest buckets, then the
    smallest bucket that holds the rest."""
    plan, left, largest = [], length, max(buckets)
    while left > largest:
        plan.append((largest, largest))
        left -= largest
    if left:
        plan.append((left, min(b for b in buckets if b >= left)))
    return plan


def _last_logits(params: Params, tokens: jax.Array, positions: jax.Array, cache: SequenceCache, cfg: ModelConfig,
                 last_index: jax.Array):
    """One chunk of one sequence: the float32 logits of its last valid token, and the cache."""
    logits, _, cache = forward(params, tokens, positions, cache, cfg, logit_indices=last_index)
    return logits[:, 0], cache


def _chunk_logits(params, tokens, positions, cache, cfg, index):
    """One chunk of one sequence: the float32 logits at `index`, and the cache."""
    logits, _, cache = forward(params, tokens, positions, cache, cfg, logit_indices=index)
    return logits, cache


_step = jit(_last_logits, static_argnums=(4,), donate_argnums=(3,))
_all_logits = jit(_chunk_logits, static_argnums=(4,), donate_argnums=(3,))


class Model:
    """A model, its tokenizer and a fixed-capacity single-sequence cache."""

    def __init__(self, cfg: ModelConfig, params: Params, tokenizer: Tokenizer | None, max_context: int,
                 path: Path | None = None):
        self.config = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.path = path
        self.dtype = params.final_norm.dtype

    # ---- low level ----------------------------------------------------------------------------
    def new_cache(self) -> SequenceCache:
        return init_cache(self.config, 1, self.max_context, self.dtype)

    def prefill(self, token_ids: Sequence[int], cache: SequenceCache | None = None, start: int = 0,
                return_all_logits: bool = False):
        """Feed tokens at positions start.. in bucketed chunks.

        Returns (logits of the last token [V] — or of every token [T, V] with return_all_logits —, cache).
        """
        ids = np.asarray(token_ids, dtype=np.int32)
        if start + len(ids) > self.max_context:
            raise ValueError(f"{start + len(ids)} tokens exceed the context of {self.max_context}")
        if len(ids) == 0:
            raise ValueError("no tokens to prefill")
        cache = self.new_cache() if cache is None else cache
        outputs, pos = [], start
        for n_valid, bucket in chunk_plan(len(ids)):
            chunk = np.zeros((1, bucket), np.int32)
            chunk[0, :n_valid] = ids[pos - start : pos - start + n_valid]
            positions = np.full((1, bucket), -1, np.int32)
            positions[0, :n_valid] = np.arange(pos, pos + n_valid)
            if return_all_logits:
                index = np.arange(bucket, dtype=np.int32)[None]
                logits, cache = _all_logits(self.params, jnp.asarray(chunk), jnp.asarray(positions), cache,
                                            self.config, jnp.asarray(index))
                outputs.append(np.asarray(logits[0, :n_valid]))
            else:
                last = np.array([[n_valid - 1]], np.int32)
                logits, cache = _step(self.params, jnp.asarray(chunk), jnp.asarray(positions), cache,
                                      self.config, jnp.asarray(last))
                outputs = [logits[0]]
            pos += n_valid
        if return_all_logits:
            return np.concatenate(outputs, axis=0), cache
        return outputs[0], cache

    def decode_step(self, token_id: int, position: int, cache: SequenceCache):
        """Feed one token; returns (logits [V] on the device, cache)."""
        if position >= self.max_context:
            raise ValueError(f"position {position} is past the context of {self.max_context}")
        logits, cache = _step(self.params, jnp.full((1, 1), token_id, jnp.int32),
                              jnp.full((1, 1), position, jnp.int32), cache, self.config,
                              jnp.zeros((1, 1), jnp.int32))
        return logits[0], cache

    def warmup(self) -> None:
        """Compile every prefill bucket and the decode step, so later calls never compile."""
        cache = self.new_cache()
        for bucket in PREFILL_BUCKETS:
            if bucket <= self.max_context:
                _, cache = self.prefill([0] * bucket, cache)
        _, cache = self.decode_step(0, 0, cache)
        jax.block_until_ready(cache)

    # ---- high level ---------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [T, vocab] of every position, as one causal forward would give them."""
        logits, _ = self.prefill(token_ids, return_all_logits=True)
        return logits

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: Sequence[str] | None = None, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, stream=None) -> GenerationResult:
        """Generate a continuation. `stream`, if given, is called with each new piece of text."""
        ids = self.encode(prompt)
        max_new_tokens = min(max_new_tokens, self.max_context - len(ids))
        eos = set() if ignore_eos else set(self.eos_token_ids())
        eos.update(stop_token_ids)
        rng = np.random.default_rng(seed)
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        stops = [s for s in (stop or []) if s]
        hold = max((len(s) for s in stops), default=1) - 1  # text that may still become a stop string
        logits, cache = self.prefill(ids)
        out: list[int] = []
        text, emitted, finish = "", 0, "length"
        for i in range(max(max_new_tokens, 0)):
            token = sample_token(np.asarray(logits, np.float32), temperature, top_p, top_k, rng)
            if token in eos:
                finish = "stop"
                break
            out.append(token)
            if detok is not None:
                text += detok.add([token])
                hit = min((text.find(s) for s in stops if s in text), default=-1)
                if hit >= 0:
                    text, finish = text[:hit], "stop"
                    break
                if stream and len(text) - hold > emitted:
                    stream(text[emitted : len(text) - hold])
                    emitted = len(text) - hold
            if i + 1 < max_new_tokens:
                logits, cache = self.decode_step(token, len(ids) + i, cache)
        if detok is not None and finish == "length":
            text += detok.flush()
        if stream and len(text) > emitted:
            stream(text[emitted:])
        return GenerationResult(token_ids=out, text=text, finish_reason=finish, prompt_tokens=len(ids))

    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.config.eos_token_ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> str:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template")
        return self.tokenizer.chat_template.render(messages, tools=tools,
                                                   add_generation_prompt=add_generation_prompt, **template_kwargs)


def sample_token(logits: np.ndarray, temperature: float, top_p: float, top_k: int,
                 rng: np.random.Generator) -> int:
    """Greedy when temperature is 0; otherwise temperature, then top-k, then top-p (nucleus)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k > 0:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]
        mask = np.zeros_like(p, bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(len(p), p=p))


def demo_model_dir() -> Path:
    """The bundled demo checkpoint, used when no model is given."""
    path = Path(__file__).parent / "demo" / "model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the bundled demo model is missing from {path}; pass a model directory instead")
    return path


def load(
    path: str | os.PathLike | None = None, dtype=None, max_context: int | None = None, experts: str = "device"
) -> Model:
    """Load a model folder: a Hugging Face checkpoint (config.json, safetensors, tokenizer files;
    ModelOpt NVFP4 / FP8 included) or an artifact written by `python -m conversion` (recognised by
    its metadata record). Quantized weights keep their format; other weights take `dtype`.

    experts: where the routed expert stacks go: "device", "host" (RAM, for experts beyond device
    memory) or "artifact" (not read: an artifact's experts are read one by one when placed)."""
    path = demo_model_dir() if path is None else Path(path)
    cfg = ModelConfig.from_hf_config(path)
    dtype = default_dtype() if dtype is None else dtype
    loader = load_artifact_params if is_artifact(path) else load_params
    params = loader(path, cfg, dtype, experts=experts)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, 8192)
    return Model(cfg, params, tokenizer, max_context, path)
