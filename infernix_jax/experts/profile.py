"""Routing profiles: how often each expert of each MoE layer is chosen over sample prompts.

A profile decides the placement at start (hottest experts in device slots, the next in RAM).
Record one with

    python -m infernix_jax.experts.profile --model DIR --prompts prompts.txt --out profile.json \
        [--max-tokens 64]

which runs the prompts (one per line) through the engine with every expert in a slot and the
cache's routing counter on, and writes {"format": "infernix-routing-profile", "num_experts": E,
"layers": [[count per expert], ...]} with one row per MoE layer (in layer order).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_NAME = "infernix-routing-profile"


@dataclass
class RoutingProfile:
    counts: np.ndarray  # i64 [MoE layers, E]: tokens routed to each expert

    def check(self, num_layers: int, num_experts: int) -> None:
        if self.counts.shape != (num_layers, num_experts):
            raise ValueError(
                f"the routing profile covers {self.counts.shape[0]} layers x {self.counts.shape[1]} experts; "
                f"this model has {num_layers} MoE layers x {num_experts} experts"
            )

    def save(self, path: str | Path) -> None:
        data = {
            "format": FORMAT_NAME,
            "num_experts": int(self.counts.shape[1]),
            "layers": self.counts.tolist(),
        }
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"{path} is not a routing profile (format {data.get('format')!r})")
        return cls(np.asarray(data["layers"], np.int64))


def record_profile(llm, prompts: list, max_tokens: int = 32) -> RoutingProfile:
    """Run `prompts` through an `LLM` with expert offload on (the command uses gpu_expert_budget="all")
    and return the routing counts of that run.

    The counts include the padding rows of the engine's fixed-shape programs (the MoE block does
    not see positions), which route like any token; long prompts and many of them dilute that."""
    from infernix_jax.engine.protocol import SamplingParams

    experts = llm.core.experts
    if experts is None:
        raise ValueError("record_profile needs an engine with expert offload on (a gpu_expert_budget)")
    experts.reset_stats()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return RoutingProfile(experts.routing_counts())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m infernix_jax.experts.profile", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", required=True, help="model folder (HF checkpoint or artifact)")
    parser.add_argument("--prompts", required=True, help="text file, one prompt per line")
    parser.add_argument("--out", required=True, help="profile JSON to write")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--max-context", type=int, default=2048)
    args = parser.parse_args(argv)
    from infernix_jax.engine.llm import LLM

    prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    llm = LLM(args.model, max_context=args.max_context, gpu_expert_budget="all", progress=False)
    profile = record_profile(llm, prompts, args.max_tokens)
    profile.save(args.out)
    print(f"routing profile of {len(prompts)} prompts: {profile.counts.shape[0]} MoE layers -> {args.out}")


if __name__ == "__main__":
    main()
