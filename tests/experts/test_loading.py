"""Loading a model whose experts do not fit on the device: the routed expert stacks never go to
the device; from an artifact, only the experts placed in slots and RAM are read at start, and the
output equals the all-resident model's."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conversion.convert import convert
from conversion.recipes import parse_recipe
from infernix_jax.engine.llm import LLM
from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.experts.layout import layout_of
from infernix_jax.experts.offload import ExpertOffload, experts_at_load
from infernix_jax.loaded_model import load
from infernix_jax.weights.artifact import Artifact
from tests.conftest import HF_FIXTURES

SOURCE = HF_FIXTURES / "qwen3_next"  # 5 MoE layers of 8 experts, top-2
ENGINE = {
    "max_concurrency": 2,
    "max_context": 64,
    "kv_capacity": 6,
    "prefill_chunk": 32,
    "prefill_shape_override": ((1, 32),),
    "decode_batch_sizes": (2,),
    "decode_steps_per_dispatch": 4,
    "compilation_cache_dir": None,
    "progress": False,
    "prefix_cache": False,
    "structured_output": False,
    "scoring": False,
}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 64, 11]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SLOTS, IN_RAM = 2, 3  # experts per layer; the other 3 stay on disk


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("nvfp4") / "art"
    convert(SOURCE, out, parse_recipe("nvfp4"), progress=False)
    return str(out)


@pytest.fixture(scope="module")
def expert_bytes(artifact) -> int:
    model = load(artifact, experts="host")
    layout = layout_of(model.config, model.params)
    return layout.expert_bytes * len(layout.moe_layers)  # one expert in every MoE layer


@pytest.fixture(scope="module")
def resident(artifact) -> list[list[int]]:
    return [r.token_ids for r in LLM(artifact, **ENGINE).generate(PROMPTS, GREEDY)]


def test_host_loading_keeps_routed_experts_off_the_device():
    params = load(SOURCE, experts="host").params
    moe = params.layers[0].moe
    assert all(
        isinstance(a, np.ndarray) for a in jax.tree.leaves((moe.gate_proj, moe.up_proj, moe.down_proj))
    )
    assert isinstance(moe.router, jax.Array) and isinstance(params.embed, jax.Array)
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(params.mtp)), "the MTP head's experts stay"


def test_a_hugging_face_folder_cannot_leave_experts_on_disk():
    with pytest.raises(ValueError, match="converted artifact"):
        load(SOURCE, experts="artifact")


def test_where_experts_load_follows_the_budgets(artifact, tmp_path):
    assert experts_at_load(artifact, {}) == "device"
    assert experts_at_load(SOURCE, {"gpu_expert_budget": "1GiB", "host_expert_budget": 0}) == "host"
    assert experts_at_load(artifact, {"gpu_expert_budget": "1GiB"}) == "host"  # RAM holds them all
    options = {"gpu_expert_budget": "1GiB", "host_expert_budget": "2GiB"}
    assert experts_at_load(artifact, options) == "artifact"
    assert options["expert_artifact"] == artifact, "the model's artifact becomes the disk tier"
    other = {"gpu_expert_budget": "1GiB", "host_expert_budget": "2GiB", "expert_artifact": str(tmp_path)}
    assert experts_at_load(artifact, other) == "host"


def test_only_the_experts_placed_in_slots_and_ram_are_read(artifact, expert_bytes, monkeypatch):
    model = load(artifact, experts="artifact")
    reads = []
    read_expert = Artifact.read_expert
    monkeypatch.setattr(
        Artifact, "read_expert", lambda self, path, e: reads.append((path, e)) or read_expert(self, path, e)
    )
    offload = ExpertOffload.build(
        model.config, model.params, SLOTS * expert_bytes, IN_RAM * expert_bytes, artifact=artifact
    )
    placed = {(rank, e) for rank in range(5) for e in range(SLOTS + IN_RAM)}  # no profile: by id
    assert sorted(reads) == sorted(
        (f"layers.{r}.moe.{p}_proj", e) for r, e in placed for p in ("gate", "up", "down")
    )
    assert {(r, e) for r in range(5) for e in range(8) if offload.store.in_host(r, e)} == {
        (r, e) for r, e in placed if e >= SLOTS
    }
    offload.close()


def test_experts_left_in_the_artifact_need_it_named(artifact, expert_bytes):
    model = load(artifact, experts="artifact")
    with pytest.raises(ValueError, match="were not loaded"):
        ExpertOffload.build(model.config, model.params, SLOTS * expert_bytes, "all")


@pytest.mark.parametrize("host", ["all", IN_RAM])
def test_offloaded_loading_gives_the_resident_output(host, artifact, expert_bytes, resident):
    llm = LLM(
        artifact,
        **ENGINE,
        gpu_expert_budget=SLOTS * expert_bytes,
        host_expert_budget=host if host == "all" else host * expert_bytes,
    )
    offload = llm.core.experts
    placement = offload.placement
    assert (placement.slots_per_layer, placement.host_per_layer) == (SLOTS, 6 if host == "all" else IN_RAM)
    assert offload.store.has_disk == (host != "all"), "the model's artifact is the disk tier"
    for layer in llm.model.params.layers:  # nothing of the stacks reached the device
        stacks = jax.tree.leaves((layer.moe.gate_proj, layer.moe.up_proj, layer.moe.down_proj))
        assert not any(isinstance(a, jax.Array) for a in stacks)
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == resident
    stats = offload.stats
    assert stats.misses > 0
    assert (stats.disk_hits > 0) == (host != "all")
