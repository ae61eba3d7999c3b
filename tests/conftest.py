"""Shared test fixtures: paths to the tiny Hugging Face reference checkpoints, and a per-module
release of compiled programs."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
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


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs() -> Iterator[None]:
    """Drop every compiled program once a test module is done.

    On the CPU each live executable keeps a few LLVM code and data mappings; a pytest worker that
    keeps every program of the suite reaches the kernel's `vm.max_map_count` (65530) about two
    thirds of the way through, and jaxlib then dies with SIGSEGV or "Cannot allocate memory" in
    whatever test compiles next (docs/model_config.md). Clearing JAX's caches after each module
    holds a worker at a few thousand mappings.
    """
    yield
    jax.clear_caches()
    gc.collect()


HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"
HF_VARIANTS = sorted(p.name for p in HF_FIXTURES.iterdir() if (p / "config.json").exists())


@pytest.fixture(scope="session")
def hf_fixtures() -> Path:
    return HF_FIXTURES
