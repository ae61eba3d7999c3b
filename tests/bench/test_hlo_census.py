"""The HLO census names the project lines a compiled program's launches come from, per step."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.hlo_census import _site, census, main, parse, time_by_site


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _program(x, w):
    def step(i, carry):
        h = _norm(carry) @ w  # a dot and a norm in the loop body: launches of the body's own
        return jnp.sort(h, axis=-1)

    return jax.lax.fori_loop(0, 3, step, x)


def _dump(tmp_path) -> str:
    # the compiled text carries the stack frames as XLA's dump does
    text = jax.jit(_program).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text()
    path = tmp_path / "program.after_optimizations.txt"
    path.write_text(text)
    return str(path)


def test_the_loop_body_counts_its_launches_by_source_line(tmp_path):
    rows = census(parse(Path(_dump(tmp_path)).read_text()))
    body = [r for r in rows if r["reached"].startswith("loop body")]
    assert len(body) == 1
    sites = {s["site"].split(" ")[-1]: s for s in body[0]["sites"]}
    assert "_program.<locals>.step" in sites  # the sort and the dot of step()
    assert sum(s["launches"] for s in body[0]["sites"]) == body[0]["launches"] > 0
    step_site = next(s for s in body[0]["sites"] if s["site"].endswith("step"))
    assert "_program" in step_site["chain"]


def test_the_command_prints_each_step_computation(tmp_path, capsys):
    main([_dump(tmp_path), "--top", "3", "--json", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert "launches" in out and "loop body" in out
    assert glob.glob(str(tmp_path / "c.json"))


def test_profiled_kernels_add_up_by_the_site_of_their_fusion(tmp_path, capsys):
    module = parse(Path(_dump(tmp_path)).read_text())
    body = next(r for r in census(module) if r["reached"].startswith("loop body"))
    step_names = [
        ins.name
        for ins in module.computations[body["computation"]]
        if ins.opcode == "fusion" and "step" in _site(module, ins)[0]
    ]
    kernels = [{"name": n.replace(".", "_"), "ms": 1.5, "count": 3} for n in step_names]
    kernels.append({"name": "my_kernel__2", "ms": 0.5, "count": 1})
    rows = {r["site"]: r for r in time_by_site(module, kernels)}
    step_rows = [r for site, r in rows.items() if site.endswith("step")]
    assert sum(r["ms"] for r in step_rows) == 1.5 * len(step_names) > 0
    assert rows["kernel my_kernel"]["count"] == 1
    record = [{"name": "decode x", "details": {"profile": {"devices": [{"top": kernels}]}}}]
    (tmp_path / "r.json").write_text(json.dumps(record))
    main([_dump(tmp_path), "--profile", str(tmp_path / "r.json")])
    assert "kernel my_kernel" in capsys.readouterr().out
