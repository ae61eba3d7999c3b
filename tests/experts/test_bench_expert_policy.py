"""The swap policy simulation's quick run: the gate keeps the placement where routing has no
locality, and the dynamic cache moves fewer bytes than static placement where it has."""

from __future__ import annotations

from bench.expert_policy import main
from bench.record import read_records


def test_quick_policy_simulation_records_what_each_policy_copies(tmp_path):
    out = tmp_path / "policy.json"
    main(["--quick", "--batches", "1", "--out", str(out)])
    records = {(r["details"]["trace"], r["details"]["policy"]): r for r in read_records(out)}
    assert len(records) == 9
    uniform = {policy: records["uniform", policy]["details"] for policy in ("static", "gated", "ungated")}
    # no locality: the gate makes (nearly) no swap and copies what static placement copies; every
    # ungated swap is a copy that buys nothing
    assert uniform["gated"]["promotions"] <= uniform["ungated"]["promotions"] // 20
    assert uniform["gated"]["copies_per_layer_step"] <= uniform["static"]["copies_per_layer_step"] * 1.01
    assert uniform["ungated"]["copies_per_layer_step"] > uniform["static"]["copies_per_layer_step"]
    for trace in ("hot", "shifting"):  # a hot set: the cache finds it, and moves it when it moves
        gated, static = records[trace, "gated"], records[trace, "static"]
        assert gated["details"]["hit_rate"] > static["details"]["hit_rate"] + 0.3
        assert gated["fraction"] > 1.5 and static["fraction"] == 1.0
        assert gated["details"]["promotions"] > 0 and static["details"]["promotions"] == 0
