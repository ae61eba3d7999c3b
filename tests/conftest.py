"""Shared test fixtures: paths to the tiny Hugging Face reference checkpoints, and a per-module
release of compiled programs."""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

# Tests run on the CPU with float32 unless a test says otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's time goes mostly into XLA compiling tiny engines' programs, which then run for
# milliseconds: on the CPU, LLVM's optimisation level 0 compiles them about a quarter faster
# (docs/engine.md, "Test suite time"). INFERNIX_TEST_XLA_OPT=default keeps XLA's own level.
if os.environ["JAX_PLATFORMS"] == "cpu" and os.environ.get("INFERNIX_TEST_XLA_OPT", "0") != "default":
    flag = f"--xla_backend_optimization_level={os.environ.get('INFERNIX_TEST_XLA_OPT', '0')}"
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax
import numpy as np
import pytest

pytest.register_assert_rewrite("tests.run_guard")
from tests.run_guard import runs_tests

# Per-test hang limit, a rerun for a test whose xdist worker died, and a stall watch (tests/run_guard.py).
pytest_plugins = ("tests.run_guard",)

# JAX's persistent compilation cache, for one test run only: a directory in the run's pytest
# basetemp (an xdist worker's basetemp is `<the run's basetemp>/popen-gwN`, so the workers of a run
# share it), removed when the run ends. Tests of different modules and workers build the same tiny
# engines, and `_release_compiled_programs` below drops every in-memory program after each module,
# so without it a run compiled the same programs many times over. Nothing else is written, even by
# an engine built with its default `compilation_cache_dir`: the first compilation, in
# `pytest_configure`, fixes the cache's directory for the process. (The suite used to keep the
# cache off: it was then the machine-wide one, and twice a worker died in jaxlib's CPU compiler while
# writing it, most likely at the `vm.max_map_count` limit that `_release_compiled_programs` now keeps
# workers under: docs/model_config.md.) In jax 0.10.2 a program loaded from the cache still counts
# as a compilation for the tests that assert none after warm-up:
# `/jax/core/compile/backend_compile_duration` times the whole `compile_or_get_cached` call, cache
# hits included (docs/engine.md). JAX writes an entry in place (jax/_src/lru_cache.py), so a worker
# reading an entry that the other is still writing gets "Error reading persistent compilation cache
# entry ... truncated stream": a warning, and that program is compiled instead.
# INFERNIX_TEST_COMPILATION_CACHE=0 turns it off.
CACHE_DIR_NAME = "jax-compilation-cache"


def _run_temp_dir(config: pytest.Config) -> Path:
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return base.parent if hasattr(config, "workerinput") else base


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin has set up the run's basetemp
def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("INFERNIX_TEST_COMPILATION_CACHE", "1") == "0" or not runs_tests(config):
        jax.config.update("jax_enable_compilation_cache", False)
        return
    directory = _run_temp_dir(config) / CACHE_DIR_NAME
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # The first compilation decides, once per process, whether and where the cache lives.
    jax.jit(lambda x: x + 1)(np.int32(0)).block_until_ready()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(_run_temp_dir(config) / CACHE_DIR_NAME, ignore_errors=True)


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
