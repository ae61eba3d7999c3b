"""Shared test fixtures: paths to the tiny Hugging Face reference checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

# Tests run on the CPU with float32 unless a test says otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"
HF_VARIANTS = sorted(p.name for p in HF_FIXTURES.iterdir() if (p / "config.json").exists())


@pytest.fixture(scope="session")
def hf_fixtures() -> Path:
    return HF_FIXTURES
