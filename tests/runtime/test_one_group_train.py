"""Training on a one-group plan made from a probed one-host topology (issue 22): ``flexshard stats``,
``flexshard plan --topology <probe file>``, then ``flexshard train --plan`` on 2 and 4 spawned ranks
(gloo, as torchrun would launch them) with ``--verify`` against the unsharded reference. The 4-rank
probe measured unequal links, so its plan's cold owner shares are balanced (uneven); nothing crosses
groups, in the plan or in the bytes the runtime counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from train_workers import run_main

from flexshard.cli import main as cli

FIXTURES = Path(__file__).resolve().parents[1] / "topology" / "fixtures"


def _histories(path: Path) -> Path:
    rng = np.random.default_rng(7)
    lines = [" ".join(map(str, [u, *(rng.zipf(1.3, rng.integers(3, 12)) % 60)])) for u in range(48)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("world", "fixture"), [(2, "probe_one_host.json"), (4, "probe_one_group_4.json")])
def test_train_verifies_on_a_one_group_plan_from_a_probed_host(tmp_path, world, fixture):
    data = _histories(tmp_path / "h.txt")
    stats, plan, metrics = tmp_path / "h.npz", tmp_path / "plan.json", tmp_path / "m.jsonl"
    assert cli(["stats", str(data), "--dim", "16", "--out", str(stats)]) == 0
    # the bytes objective balances owners by the probed links (uneven shares for the runtime to run)
    make = ["plan", "--workload", str(stats), "--topology", str(FIXTURES / fixture), "--batch-size", "16",
            "--objective", "bytes"]  # fmt: skip
    assert cli([*make, "--budget", "1.5", "--out", str(plan)]) == 0
    doc = json.loads(plan.read_text())
    assert doc["world"]["groups"] == [list(range(world))] and doc["predicted"]["inter_group_bytes"] == 0.0
    cold_share = doc["tables"][0]["cold_share"]
    if world == 4:
        assert doc["solver"]["placement"] == "balanced" and max(cold_share) > 1.05 * min(cold_share)
    argv = ["--plan", str(plan), "--data", str(data), "--steps", "3", "--verify"]
    results = run_main(world, [([*argv, "--metrics-out", str(metrics)], None)], tmp_path / "run", 120.0)
    calls = [rank_results[0] for rank_results in results]
    assert [c["rc"] for c in calls] == [0] * world, [c["err"] for c in calls]
    out = calls[0]["out"]
    assert f"world {world} (1 groups of {world})" in calls[0]["err"]  # the log
    assert "verify: OK (3 steps, all rows of all copies match)\n" in out
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert len(steps) == 3
    for record in steps:
        assert record["bytes"]["inter_group"] == {"max": 0, "mean": 0}
        assert record["bytes"]["intra_group"]["max"] > 0
