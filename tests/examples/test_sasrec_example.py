"""docs/examples/sasrec_torchrec.py under torchrun: 4 gloo ranks in 2 emulated groups, 4 steps with
TorchRec's row-wise sharding and 4 with FlexShardSharder, on the same batches from the same weights.

* losses: equal bit for bit at step 0 (same weights, both shardings gather copied rows), then within
  ``1e-5`` relative per rank and step: the fused row-wise Adagrad sums a row's gradient terms in another
  order (FlexShard adds a rank's duplicates before sending, TorchRec's owner adds every lookup's), a float32
  rounding difference (about 1e-7 relative) carried into later steps;
* bytes (inter-group, the busiest rank's larger of sent and received, mean over steps, counted by
  ``flexshard.bench.recorder``): FlexShard's within 3% of its plan's prediction, TorchRec's within 3% of
  the cost model's row-wise prediction, and the measured ratio FlexShard / TorchRec within 5% of the
  predicted ratio (the saving is what the plan says it is);
* ``--write-plan`` then ``--plan`` runs the plan made on the fly: the same losses and bytes, bit for bit;
* ``--stats FILE`` takes each table from the file's table of its name (item_id, item_attribute, user_id,
  in any order among others): rows, popularity and order; run at 2 ranks in 2 groups for 3 steps: losses
  within 1e-5 and bytes, each within 3% of its prediction.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from torchrun_jobs import run_torchrun

pytest.importorskip("torchrec", reason="torchrec is an optional peer (scripts/setup_torchrec.sh)")

pytestmark = pytest.mark.slow  # launches torchrun jobs of 4 ranks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "sasrec_torchrec.py"
WORLD, GROUPS, STEPS = 4, 2, 4


def launch(sharding: str, out: Path, *extra: str, steps: int = STEPS, world: int = WORLD) -> tuple[dict, str]:
    """(the example's --json record, its stdout) of one torchrun job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += [str(EXAMPLE), "--sharding", sharding, "--groups", str(GROUPS), "--steps", str(steps)]
    cmd += ["--json", str(out), *extra]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = run_torchrun(cmd, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return (json.loads(out.read_text()) if out.exists() else {}), proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, str]]:
    tmp = tmp_path_factory.mktemp("sasrec")
    return {s: launch(s, tmp / f"{s}.json") for s in ("torchrec", "flexshard")}


def test_both_shardings_train_to_the_same_losses(runs):
    ours, theirs = runs["flexshard"][0]["steps"], runs["torchrec"][0]["steps"]
    assert len(ours) == len(theirs) == STEPS
    assert ours[0]["rank_losses"] == theirs[0]["rank_losses"]  # identical start
    for a, b in zip(ours, theirs, strict=True):
        assert len(a["rank_losses"]) == WORLD
        np.testing.assert_allclose(a["rank_losses"], b["rank_losses"], rtol=1e-5, atol=0)
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.05  # it trained


def test_flexshard_moves_the_plans_bytes_and_saves_what_it_predicts(runs):
    (ours, our_out), (theirs, their_out) = runs["flexshard"], runs["torchrec"]
    plan = ours["predicted_inter_bytes"]["flexshard_plan"]
    row_wise = theirs["predicted_inter_bytes"]["torchrec_row_wise"]
    assert ours["predicted_inter_bytes"]["torchrec_row_wise"] == row_wise
    got, base = ours["measured_inter_bytes"], theirs["measured_inter_bytes"]
    assert got == pytest.approx(np.mean([s["inter_bytes"] for s in ours["steps"]]))
    assert got == pytest.approx(plan, rel=0.03), (got, plan)
    assert base == pytest.approx(row_wise, rel=0.03), (base, row_wise)
    assert got / base == pytest.approx(plan / row_wise, rel=0.05), (got / base, plan / row_wise)
    assert plan < 0.8 * row_wise  # a saving worth showing, not noise
    assert f"FlexShard's plan predicts {plan:,.0f}" in our_out
    assert f"{base:,.0f} measured; TorchRec row-wise predicted {row_wise:,.0f}" in their_out


def test_each_run_counts_its_collectives(runs):
    """TorchRec's row-wise step issues its 5 all-to-alls; FlexShard's (tiers and the group fetch) at most
    the 9 its schedule allows, its replicas' sync among them."""
    (ours, our_out), (theirs, their_out) = runs["flexshard"], runs["torchrec"]
    assert all(s["collectives"] == {"all_to_all_single": 5} for s in theirs["steps"])
    last = ours["steps"][-1]["collectives"]
    assert sum(last.values()) <= 9 and last.get("all_reduce", 0) >= 1
    assert (
        "torchrec: collectives in the last step (DDP's own all-reduce not seen): all_to_all_single 5"
        in their_out
    )
    calls = ", ".join(f"{kind} {n}" for kind, n in last.items())
    assert f"flexshard: collectives in the last step (DDP's own all-reduce not seen): {calls}" in our_out


def test_a_written_plan_file_runs_the_same_plan(runs, tmp_path):
    plan = tmp_path / "plan.json"
    _none, said = launch("flexshard", tmp_path / "none.json", "--write-plan", str(plan))
    assert f"wrote {plan}" in said
    document = json.loads(plan.read_text())
    assert document["world"] == {"size": WORLD, "groups": [[0, 1], [2, 3]]}
    item = document["tables"][0]
    assert item["name"] == "item" and item["hot_rows"] > 0 and item["fetch"] == "group"  # tiers, group fetch
    again, out = launch("flexshard", tmp_path / "again.json", "--plan", str(plan), steps=2)
    assert again["steps"] == runs["flexshard"][0]["steps"][:2]
    assert again["predicted_inter_bytes"] == runs["flexshard"][0]["predicted_inter_bytes"]
    assert "plan: item: " in out


def _stats_file(tmp_path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """A stats file whose tables are not in the example's order (the user table first, an extra table
    between): the example must take each by name. Its users: 50 of 700 rows touched."""
    from flexshard.workloads import save_stats, zipf_table
    from solvers.types import RowHistogram, TableSpec, Workload

    rng = np.random.default_rng(3)
    counts = np.zeros(700, dtype=np.int64)
    counts[:50] = rng.integers(1, 20, 50)
    users = TableSpec("user_id", 700, 8, 1.0, RowHistogram.from_counts(counts))
    tables = (
        users,
        zipf_table("item_attribute", 90, 8, 30.0, 1.2),
        zipf_table("tag", 40, 8, 5.0, 1.1),
        zipf_table("item_id", 3000, 8, 10.0, 1.05, 0.02),
    )
    orders = {
        "user_id": rng.permutation(700)[:50],  # the touched users, hottest first
        "item_attribute": rng.permutation(90),
        "tag": rng.permutation(40),
        "item_id": rng.permutation(3000)[:2500],  # touched ids
    }
    return str(save_stats(tmp_path / "stats.npz", Workload("test", tables, 512), orders)), orders


def _example():
    """The example as a module (its functions, without torchrun)."""
    spec = importlib.util.spec_from_file_location("sasrec_torchrec", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_each_table_takes_its_own_table_of_the_stats_file_by_name(tmp_path):
    from flexshard.runtime.routing import complete_order
    from flexshard.workloads import load_stats

    stats, orders = _stats_file(tmp_path)
    example = _example()
    data = example.make_data(16, 0, stats)
    saved = {t.name: t for t in load_stats(stats)[0].tables}
    item, category = data.workload.tables
    assert (item.name, item.num_rows, category.name, category.num_rows) == ("item", 3000, "category", 90)
    assert data.user_rows == 700
    for hist, name in ((data.history, "item_id"), (category.hist, "item_attribute")):
        np.testing.assert_array_equal(hist.rows, saved[name].hist.rows)
        np.testing.assert_array_equal(hist.prob, saved[name].hist.prob)
    np.testing.assert_array_equal(data.orders["item"], complete_order(orders["item_id"], 3000))
    np.testing.assert_array_equal(data.orders["category"], complete_order(orders["item_attribute"], 90))
    batch = data.make_batch(0, 0)
    users = batch.users.values().numpy()
    assert users.size == 16 and set(users) <= set(orders["user_id"].tolist())  # only touched users
    with pytest.raises(SystemExit, match=r"--stats-tables: .* has no table 'genre' \(its tables: user_id, "):
        example.make_data(16, 0, stats, "item_id,genre,user_id")


def test_a_stats_files_tables(tmp_path):
    stats, _orders = _stats_file(tmp_path)
    ours, _ = launch("flexshard", tmp_path / "ours.json", "--stats", stats, steps=3, world=2)
    theirs, _ = launch("torchrec", tmp_path / "theirs.json", "--stats", stats, steps=3, world=2)
    assert ours["table_rows"] == theirs["table_rows"] == {"item": 3000, "category": 90, "user": 700}
    plan = ours["predicted_inter_bytes"]["flexshard_plan"]
    row_wise = theirs["predicted_inter_bytes"]["torchrec_row_wise"]
    got, base = ours["measured_inter_bytes"], theirs["measured_inter_bytes"]
    assert got == pytest.approx(plan, rel=0.03), (got, plan)
    assert base == pytest.approx(row_wise, rel=0.03), (base, row_wise)
    assert plan < row_wise
    for a, b in zip(ours["steps"], theirs["steps"], strict=True):
        np.testing.assert_allclose(a["rank_losses"], b["rank_losses"], rtol=1e-5, atol=0)
