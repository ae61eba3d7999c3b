"""The server's speculative-decoding flags reach EngineConfig's fields."""

from __future__ import annotations

import pytest

from infernix_jax import serve
from infernix_jax.engine.config import EngineConfig


def captured_options(monkeypatch, tmp_path, flags: list[str]) -> dict:
    import infernix_jax.engine as engine_package

    calls = []
    monkeypatch.setattr(
        engine_package, "create_engine", lambda *a, **kw: calls.append(kw) or "engine", raising=False
    )
    serve.build_engine(serve.build_parser().parse_args(["--model", str(tmp_path), *flags]))
    return calls[0]


def test_spec_flags_are_passed_to_the_engine(monkeypatch, tmp_path):
    options = captured_options(
        monkeypatch, tmp_path,
        ["--spec", "mtp+ngram", "--draft-tokens", "2", "--ngram-draft-tokens", "6", "--ngram-min-match", "3"],
    )  # fmt: skip
    assert options["spec"] == "mtp+ngram" and options["draft_tokens"] == 2
    assert options["ngram_draft_tokens"] == 6 and options["ngram_min_match"] == 3
    config = EngineConfig(
        **{
            k: v
            for k, v in options.items()
            if k in ("spec", "draft_tokens", "ngram_draft_tokens", "ngram_min_match")
        }
    )
    assert config.spec_window == 7 and config.spec_uses_mtp


def test_without_spec_no_speculative_options_are_sent(monkeypatch, tmp_path):
    assert "spec" not in captured_options(monkeypatch, tmp_path, [])


def test_unknown_drafter_and_oversized_windows_are_rejected():
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--spec", "eagle"])
    with pytest.raises(ValueError, match="draft tokens"):
        EngineConfig(spec="mtp", draft_tokens=16)
    assert EngineConfig(spec="ngram", ngram_draft_tokens=15).spec_window == 16
