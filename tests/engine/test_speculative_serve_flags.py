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


def test_tree_flags_are_passed_and_size_the_window(monkeypatch, tmp_path):
    options = captured_options(
        monkeypatch, tmp_path, ["--spec", "ngram", "--ngram-draft-tokens", "4", "--spec-tree-width", "3"]
    )
    assert options["spec_tree_width"] == 3 and options["spec_tree_nodes"] is None
    config = EngineConfig(spec="ngram", ngram_draft_tokens=4, spec_tree_width=3)
    assert config.spec_tree and config.spec_window == 13  # three branches of 4, and the pending token
    assert EngineConfig(spec="mtp", draft_tokens=3, spec_tree_width=3).spec_window == 6  # chain + 2 siblings
    assert EngineConfig(spec="ngram", spec_tree_width=4, spec_tree_nodes=6).spec_window == 7
    assert EngineConfig(spec="ngram", ngram_draft_tokens=8, spec_tree_width=4).spec_window == 16  # capped
    assert not EngineConfig(spec="ngram").spec_tree
    with pytest.raises(ValueError, match="spec_tree_nodes"):
        EngineConfig(spec="ngram", spec_tree_width=2, spec_tree_nodes=16)
    with pytest.raises(ValueError, match="spec_tree_width"):
        EngineConfig(spec="ngram", spec_tree_width=0)
