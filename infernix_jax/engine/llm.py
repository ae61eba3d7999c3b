"""The offline batch API: `LLM(path, **engine_options).generate(prompts, SamplingParams(...))`.

Runs the same `EngineCore` as the server, synchronously in the caller's thread: every prompt is
queued at once and the engine batches them (up to max_concurrency at a time, the rest waiting).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore, EngineMetrics
from infernix_jax.engine.protocol import (
    FINISH_ERROR,
    GenerationRequest,
    SamplingParams,
    ScoreError,
    ScoreRequest,
    ScoreResult,
)
from infernix_jax.experts.offload import experts_at_load
from infernix_jax.loaded_model import GenerationResult, Model, load

Prompt = str | Sequence[int]


class LLM:
    """A loaded model and an engine over it, for scripts and offline batches."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        model: Model | None = None,
        dtype=None,
        **engine_options,
    ):
        """`path`: a checkpoint directory (or pass an already loaded `model`). `engine_options`:
        EngineConfig fields (max_concurrency, max_context, kv_dtype, kv_capacity, prefill_chunk, ...);
        max_context defaults to the smaller of the model's context and 8192."""
        if model is None:
            experts = experts_at_load(path, engine_options)
            model = load(path, dtype=dtype, max_context=engine_options.get("max_context"), experts=experts)
        engine_options.setdefault("max_context", model.max_context)
        self.model = model
        self.tokenizer = model.tokenizer
        self.config = EngineConfig(**engine_options)
        self.core = EngineCore(
            model.config, model.params, self.config, model.tokenizer, model.eos_token_ids()
        )
        self._next_id = 0

    @property
    def metrics(self) -> EngineMetrics:
        return self.core.metrics

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids); one result per prompt, in order.

        `sampling` is one SamplingParams for all prompts or one per prompt. A prompt that cannot be
        served (empty, longer than the context) raises ValueError naming it.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling is None:
            sampling = SamplingParams()
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        results: dict[str, GenerationResult] = {}
        for prompt, p in zip(prompts, params):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            tokens = self.model.encode(prompt)
            ids.append(request_id)
            results[request_id] = GenerationResult([], "", "", prompt_tokens=len(tokens))
            for event in self.core.add_request(GenerationRequest(request_id, tokens, p)):
                self._collect(results[request_id], event)
        while self.core.has_work():
            for event in self.core.step():
                self._collect(results[event.request_id], event)
        return [results[i] for i in ids]

    def score(self, prompt: Prompt, candidates: Sequence[Prompt]) -> ScoreResult:
        """The logprob of every token of each candidate continuation of `prompt` (text or token
        ids; candidates are tokenized on their own), read in one scoring pass after the prompt's
        prefill (engine/scoring.py). Raises ScoreError when the request cannot be served."""
        request_id = f"llm-score-{self._next_id}"
        self._next_id += 1
        ids = [tuple(self.model.encode(c)) for c in candidates]
        request = ScoreRequest(request_id, self.model.encode(prompt), tuple(ids))
        final = [e for e in self.core.add_score_request(request) if e.request_id == request_id]
        while not final and self.core.has_work():
            final = [e for e in self.core.step() if e.request_id == request_id and e.finished]
        if not final or final[0].score is None:
            raise ScoreError(final[0].error if final else "the score request ended without a result")
        return final[0].score

    @staticmethod
    def _collect(result: GenerationResult, event) -> None:
        if event.finish_reason == FINISH_ERROR:
            raise ValueError(f"prompt rejected: {event.error}")
        result.token_ids.extend(event.token_ids)
        result.text += event.text
        if event.finished:
            result.finish_reason = event.finish_reason
