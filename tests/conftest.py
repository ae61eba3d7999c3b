"""Shared test fixtures: paths to the tiny Hugging Face reference checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

# Tests run on the CPU with float32 unless a test says otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# No test writes JAX's persistent compilation cache, even when an engine is built with its default
# `compilation_cache_dir`: the cache is shared with every other process of the machine, and twice a
# test worker crashed (SIGSEGV inside jaxlib 0.10.2's CPU compiler) compiling or serializing an
# n-gram memory engine's programs into it, in a process where an earlier test had enabled it.
jax.config.update("jax_enable_compilation_cache", False)

HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"
HF_VARIANTS = sorted(p.name for p in HF_FIXTURES.iterdir() if (p / "config.json").exists())


@pytest.fixture(scope="session")
def hf_fixtures() -> Path:
    return HF_FIXTURES
