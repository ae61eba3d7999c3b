"""Run constrained requests through an `EngineCore` and gather what each one produced."""

from __future__ import annotations

from dataclasses import dataclass

from infernix_jax.engine.protocol import GenerationRequest, SamplingParams


@dataclass
class Output:
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None


def generate(core, requests: list[GenerationRequest]) -> dict[str, Output]:
    """Queue every request at once (the engine batches them), step until all are done."""
    texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: dict[str, Output] = {}

    def take(events) -> None:
        for event in events:
            texts[event.request_id].append(event.text)
            tokens[event.request_id].extend(event.token_ids)
            if event.finished:
                rid = event.request_id
                done[rid] = Output("".join(texts[rid]), tokens[rid], event.finish_reason, event.error)

    for request in requests:
        take(core.add_request(request))
    while core.has_work():
        take(core.step())
    return done


def sampled_requests(
    name: str, prompt: list[int], constraint, count: int, max_tokens: int, temperature: float = 1.0, **options
) -> list[GenerationRequest]:
    """count requests of one prompt and constraint, seeds 0..count-1."""
    return [
        GenerationRequest(
            f"{name}-{i}",
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, **options),
            constraint=constraint,
        )
        for i in range(count)
    ]
