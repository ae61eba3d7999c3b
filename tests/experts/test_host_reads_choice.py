"""`expert_host_reads="auto"`: copies inside the program on a GPU when no expert is on disk."""

import jax
import pytest

from infernix_jax.engine.config import EngineConfig
from infernix_jax.experts.offload import resolve_host_reads


def test_auto_is_the_default_and_keeps_callbacks_on_the_cpu():
    assert EngineConfig().expert_host_reads == "auto"
    assert jax.default_backend() == "cpu"
    assert resolve_host_reads("auto", disk_experts=0) == "callback"


@pytest.mark.parametrize("mode", ["callback", "program"])
def test_an_explicit_choice_is_kept(mode):
    assert resolve_host_reads(mode, disk_experts=0) == mode


def test_unknown_modes_are_refused():
    with pytest.raises(ValueError, match="expert_host_reads must be auto, callback or program"):
        EngineConfig(expert_host_reads="dma")
