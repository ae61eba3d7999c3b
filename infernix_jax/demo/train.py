"""python -m infernix_jax.demo.train: train the bundled demo model with the project's own forward.

    python -m infernix_jax.demo.data --corpus build/demo/corpus --out build/demo/tokens   # once
    python -m infernix_jax.demo.train --tokens build/demo/tokens --out build/demo/trained --minutes 8

The model is a small Qwen3-Next (Gated DeltaNet and gated attention at 3:1, a MoE with a shared
expert, one MTP layer, tied embeddings) sized so that its bfloat16 weights stay under ~30 MB. The
loss is next-token cross-entropy plus `mtp_weight` times the MTP head's next-next-token
cross-entropy (the MTP head reads the true next token and the trunk's hidden state, as at
inference). Training stops after `--steps` or `--minutes` of stepping, whichever comes first; the
checkpoint with the best held-out loss is written in Hugging Face layout with the tokenizer, plus
`training_log.json` (the loss curve) and, where matplotlib exists, `loss_curve.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from infernix_jax.cache.sequence import init_cache
from infernix_jax.config import ModelConfig
from infernix_jax.demo import MODEL_DIR
from infernix_jax.demo.data import (
    WindowSampler,
    eval_windows,
    heldout_token_ids,
    load_token_file,
)
from infernix_jax.demo.special_tokens import VOCAB_SIZE
from infernix_jax.model.forward import forward, mtp_forward
from infernix_jax.model.params import Params, count_params, init_params
from infernix_jax.weights.hf_export import save_hf

ENDOFTEXT_ID = 16358
IM_END_ID = 16360

# The demo model's config.json (Qwen3-Next layout, read by transformers' Qwen3NextForCausalLM).
DEMO_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "full_attention_interval": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 96,
    "shared_expert_intermediate_size": 192,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "dtype": "bfloat16",
}


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32
    seq_len: int = 512
    steps: int = 6000
    minutes: float = 8.0  # wall-clock budget for stepping (compilation excluded)
    peak_lr: float = 3e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    eval_every: int = 250
    seed: int = 0
    shard: int = 0  # 1: write shards of at most 15 MiB (for transports that limit file size)


def initial_params(cfg: ModelConfig, seed: int) -> Params:
    """Declared random init, with the embedding (also the tied output matrix) at std 0.02."""
    params = init_params(cfg, jax.random.PRNGKey(seed), jnp.float32)
    return dataclasses.replace(params, embed=params.embed * 0.02)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def losses(params: Params, batch: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(next-token loss, next-next-token MTP loss) on [B, T + 2] windows, through the one forward."""
    inputs, targets, targets2 = batch[:, :-2], batch[:, 1:-1], batch[:, 2:]
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    cache = init_cache(cfg, b, t, params.final_norm.dtype, with_mtp=True)
    logits, hidden, cache = forward(params, inputs, positions, cache, cfg)
    main = cross_entropy(logits, targets)
    mtp_logits, _, _ = mtp_forward(params, targets, hidden, positions, cache, cfg)
    return main, cross_entropy(mtp_logits, targets2)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW whose learning rate the host sets every step (see `learning_rate`)."""
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=tc.peak_lr, b1=0.9, b2=0.95, weight_decay=tc.weight_decay),
    )


def learning_rate(tc: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warm-up, then cosine decay to 5% over whichever budget (steps or minutes) runs out first."""
    if step < tc.warmup_steps:
        return tc.peak_lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, max(step / tc.steps, elapsed / (tc.minutes * 60)))
    return tc.peak_lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


@partial(jax.jit, static_argnums=(4, 5), donate_argnums=(0, 1))
def train_step(params, opt_state, batch, lr, cfg: ModelConfig, tc: TrainConfig):
    def loss_fn(p):
        main, mtp = losses(p, batch, cfg)
        return main + tc.mtp_weight * mtp, (main, mtp)

    (_, (main, mtp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    clip, adam = opt_state
    adam = adam._replace(hyperparams={**adam.hyperparams, "learning_rate": lr})
    updates, opt_state = make_optimizer(tc).update(grads, (clip, adam), params)
    return optax.apply_updates(params, updates), opt_state, main, mtp


@partial(jax.jit, static_argnums=(2,))
def eval_step(params, batch, cfg: ModelConfig):
    return losses(params, batch, cfg)


def evaluate(params: Params, windows: np.ndarray, cfg: ModelConfig, batch_size: int) -> tuple[float, float]:
    """Mean held-out (next-token, MTP) loss over whole batches of windows."""
    n = (len(windows) // batch_size) * batch_size
    totals = np.zeros(2)
    for i in range(0, n, batch_size):
        main, mtp = eval_step(params, jnp.asarray(windows[i : i + batch_size]), cfg)
        totals += [float(main), float(mtp)]
    return tuple(totals / max(n // batch_size, 1))


def write_checkpoint(params: Params, cfg: ModelConfig, out: Path, shard: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_hf(params, cfg, out, dtype=jnp.bfloat16, max_shard_bytes=15 * 2**20 if shard else None)
    (out / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
                    "pad_token_id": ENDOFTEXT_ID}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, out / name)


def plot(log: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in log["train"]]
    ax.plot(steps, [r["loss"] for r in log["train"]], label="train next-token")
    ax.plot(steps, [r["mtp_loss"] for r in log["train"]], label="train MTP (next-next)", alpha=0.7)
    ax.plot([r["step"] for r in log["eval"]], [r["loss"] for r in log["eval"]], "o-", label="held-out next-token")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("demo model training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def train(token_dir: Path, out: Path, tc: TrainConfig) -> dict:
    cfg = ModelConfig.from_hf_config(DEMO_CONFIG)
    params = initial_params(cfg, tc.seed)
    opt_state = make_optimizer(tc).init(params)
    sampler = WindowSampler(load_token_file(token_dir), tc.batch_size, tc.seq_len, tc.seed)
    windows = eval_windows(heldout_token_ids(), tc.seq_len)
    log = {"config": DEMO_CONFIG, "train_config": tc.__dict__, "params": count_params(params),
           "device": str(jax.devices()[0]), "train": [], "eval": []}
    print(f"{log['params'] / 1e6:.2f}M parameters on {log['device']}; {len(windows)} held-out windows")

    t0 = time.time()
    lr0 = jnp.float32(learning_rate(tc, 0, 0.0))
    params, opt_state, main, mtp = train_step(params, opt_state, jnp.asarray(sampler.batch(0)), lr0, cfg, tc)
    jax.block_until_ready(main)
    log["compile_seconds"] = time.time() - t0
    best = (math.inf, None, 0)
    start = time.time()
    bar = tqdm(range(1, tc.steps), desc="training", unit="step")
    step = 0
    for step in bar:
        lr = jnp.float32(learning_rate(tc, step, time.time() - start))
        params, opt_state, main, mtp = train_step(params, opt_state, jnp.asarray(sampler.batch(step)), lr, cfg, tc)
        if step % 50 == 0:
            log["train"].append({"step": step, "loss": float(main), "mtp_loss": float(mtp),
                                 "seconds": time.time() - start})
            bar.set_postfix(loss=f"{float(main):.3f}", mtp=f"{float(mtp):.3f}")
        done = time.time() - start > tc.minutes * 60
        if step % tc.eval_every == 0 or done or step == tc.steps - 1:
            ev_main, ev_mtp = evaluate(params, windows, cfg, tc.batch_size)
            log["eval"].append({"step": step, "loss": ev_main, "mtp_loss": ev_mtp,
                                "perplexity": math.exp(ev_main)})
            tqdm.write(f"step {step}: held-out loss {ev_main:.4f} (ppl {math.exp(ev_main):.1f}), MTP {ev_mtp:.4f}")
            if ev_main < best[0]:
                best = (ev_main, jax.device_get(params), step)
        if done:
            break
    log["steps"] = step
    log["train_seconds"] = time.time() - start
    log["best_step"] = best[2]
    log["best_heldout_loss"] = best[0]
    write_checkpoint(best[1], cfg, out, shard=tc.shard)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot(log, out / "loss_curve.png")
    return log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infernix_jax.demo.train", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", required=True, type=Path, help="folder written by python -m infernix_jax.demo.data")
    p.add_argument("--out", required=True, type=Path, help="where to write the checkpoint")
    defaults = TrainConfig()
    for field, value in defaults.__dict__.items():
        p.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    args = p.parse_args(argv)
    tc = TrainConfig(**{f: getattr(args, f) for f in defaults.__dict__})
    log = train(args.tokens, args.out, tc)
    print(f"best held-out loss {log['best_heldout_loss']:.4f} at step {log['best_step']} "
          f"({log['steps']} steps in {log['train_seconds']:.0f} s, compile {log['compile_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
