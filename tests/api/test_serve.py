"""The command line: grouped --help, flags into ServerConfig, and the engine seam."""

from __future__ import annotations

import pytest

from infernix_jax import serve


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """The options each `serve.build_engine` call hands `create_engine` (patched: nothing loads)."""
    import infernix_jax.engine as engine_package

    made: list[dict] = []
    monkeypatch.setattr(
        engine_package, "create_engine", lambda *a, **kw: made.append(kw) or "engine", raising=False
    )
    return made


def test_help_is_grouped_by_category(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--help"])
    text = capsys.readouterr().out
    for group in ("model:", "engine:", "server:", "tools and reasoning:"):
        assert group in text
    for flag in (
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--api-key",
        "--max-concurrency",
        "--max-context",
        "--kv-dtype",
        "--prefill-chunk",
        "--tool-call-parser",
        "--tolerant-tool-calls",
        "--reasoning-budget",
        "--reasoning-loop",
    ):
        assert flag in text


def test_flags_become_server_config(tmp_path):
    args = serve.build_parser().parse_args(
        [
            "--model",
            str(tmp_path / "Qwen3-Next-80B"),
            "--api-key",
            "k",
            "--tool-call-parser",
            "qwen3_coder",
            "--tolerant-tool-calls",
            "--reasoning-budget",
            "512",
            "--reasoning-loop",
            "--max-waiting",
            "4",
        ]
    )
    config = serve.server_config(args)
    assert config.served_model_name == "Qwen3-Next-80B" and config.api_key == "k"
    assert config.tool_call_parser == "qwen3_coder" and config.tolerant_tool_calls
    assert config.reasoning_budget == 512 and config.reasoning_loop and config.max_waiting == 4


def test_build_engine_passes_engine_flags_to_create_engine(tmp_path, monkeypatch):
    import infernix_jax.engine as engine_package

    calls = []
    monkeypatch.setattr(
        engine_package, "create_engine", lambda *a, **kw: calls.append((a, kw)) or "engine", raising=False
    )
    args = serve.build_parser().parse_args(
        ["--model", str(tmp_path), "--max-concurrency", "4", "--max-context", "1024", "--kv-dtype", "fp8"]
    )
    assert serve.build_engine(args) == "engine"
    assert calls == [
        (
            (str(tmp_path),),
            {"max_concurrency": 4, "max_context": 1024, "kv_dtype": "fp8", "prefill_chunk": None},
        )
    ]


def test_prefix_cache_flags_reach_the_engine(tmp_path, calls):
    path = str(tmp_path / "prefix.cache")
    argv = ["--prefix-cache-file", path, "--prefix-cache-save-mins", "5", "--prefix-cache-host-mem", "8GiB"]
    serve.build_engine(serve.build_parser().parse_args(argv + ["--prefix-cache-snapshot-blocks", "0"]))
    serve.build_engine(serve.build_parser().parse_args(["--no-prefix-cache"]))
    assert calls[0]["prefix_cache_file"] == path
    assert calls[0]["prefix_cache_save_mins"] == 5.0
    assert calls[0]["prefix_cache_host_mem"] == "8GiB"
    assert calls[0]["prefix_cache_snapshot_blocks"] == 0
    assert "prefix_cache" not in calls[0]
    assert calls[1]["prefix_cache"] is False


def test_constrained_decode_reaches_the_engine_only_when_given(calls):
    serve.build_engine(serve.build_parser().parse_args(["--constrained-decode", "check"]))
    serve.build_engine(serve.build_parser().parse_args([]))
    assert calls[0]["constrained_decode"] == "check"
    assert "constrained_decode" not in calls[1]
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--constrained-decode", "fast"])


def test_decode_steps_reach_the_engine_only_when_given(calls):
    serve.build_engine(serve.build_parser().parse_args(["--decode-steps", "16"]))
    serve.build_engine(serve.build_parser().parse_args([]))
    assert calls[0]["decode_steps_per_dispatch"] == 16
    assert "decode_steps_per_dispatch" not in calls[1]
    for bad in ("0", "-2", "eight"):
        with pytest.raises(SystemExit):
            serve.build_parser().parse_args(["--decode-steps", bad])


def test_expert_prefetch_flags_reach_the_engine_only_when_given(calls):
    serve.build_engine(
        serve.build_parser().parse_args(
            ["--expert-prefetch", "--expert-prefetch-blocks", "16", "--expert-prefetch-guesses", "5"]
        )
    )
    serve.build_engine(serve.build_parser().parse_args([]))
    assert calls[0]["expert_prefetch"] is True and calls[0]["expert_prefetch_blocks"] == 16
    assert calls[0]["expert_prefetch_guesses"] == 5
    assert "expert_prefetch_blocks" not in calls[1]


def test_memory_is_logged_from_the_engine(caplog, tokenizer):
    import logging

    from tests.api.conftest import FakeEngine

    class DescribedEngine(FakeEngine):
        def describe(self) -> str:
            return "weights 1.0 GiB on gpu:0\nKV pool 2.0 GiB (256 blocks)"

    with caplog.at_level(logging.INFO, logger="infernix_jax.serve"):
        serve.log_engine_memory(FakeEngine(tokenizer, max_context=1024))
        serve.log_engine_memory(DescribedEngine(tokenizer))
    messages = [r.getMessage() for r in caplog.records]
    assert "engine: context 1024 tokens, KV pool 256 blocks (0 in use)" in messages
    assert "KV pool 2.0 GiB (256 blocks)" in messages
