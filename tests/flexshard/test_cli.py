"""The command line: plan files, simulate records, and bad input (one line, exit 2, no output file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import fails, run

from core.errors import DataError
from flexshard.cli import main
from flexshard.plan_file import read_plan
from flexshard.workloads import load_stats
from solvers.planner import STRATEGIES
from topology import h100_cluster, write_json

SMALL = ["--workload", "synthetic:6:2e6:1.0", "--topology", "h100:2x4"]


def test_plan_writes_a_plan_file_that_reads_back(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc, text, _ = run(capsys, "plan", *SMALL, "--budget", "2", "--out", str(out))
    assert rc == 0
    assert "Bytes per iteration" in text and "inter_group" in text
    pf = read_plan(out)
    assert pf.world_size == 8 and pf.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(pf.plan.tables) == 6
    for tp in pf.plan.tables:
        assert tp.hot_rows + tp.warm_rows + tp.cold_rows > 0
        assert abs(tp.cold_share.sum() - 1) < 1e-9
    doc = json.loads(out.read_text())
    assert set(doc["fingerprints"]) == {"workload", "topology", "world"}
    assert doc["settings"] == {"dedup": True, "sync": "sparse", "wire": "fp32", "batch_size_per_gpu": 512}
    assert pf.batch_size_per_gpu == 512 and pf.plan.dedup and pf.overrides == {}
    assert doc["predicted"]["memory_per_gpu_bytes"] <= doc["budget_bytes"] * (1 + 1e-9)
    assert 0 <= doc["solver"]["gap"] <= 0.01


def test_plan_and_simulate_at_a_wire_precision(tmp_path, capsys):
    """--wire-dtype prices vectors in 2-byte elements: fewer bytes than fp32, recorded in the plan file;
    a file without the setting reads as fp32; a bad value in a file is one line naming it."""
    full, half = tmp_path / "fp32.json", tmp_path / "bf16.json"
    assert run(capsys, "plan", *SMALL, "--out", str(full))[0] == 0
    rc, _, _ = run(capsys, "plan", *SMALL, "--wire-dtype", "bf16", "--out", str(half))
    assert rc == 0 and read_plan(half).plan.wire.value == "bf16"
    doc_full, doc_half = json.loads(full.read_text()), json.loads(half.read_text())
    assert doc_half["predicted"]["inter_group_bytes"] < doc_full["predicted"]["inter_group_bytes"]
    del doc_half["settings"]["wire"]
    half.write_text(json.dumps(doc_half))
    assert read_plan(half).plan.wire.value == "fp32"
    doc_half["settings"]["wire"] = "fp8"
    half.write_text(json.dumps(doc_half))
    with pytest.raises(DataError, match="settings.wiredtype: unknown 'fp8'; choose one of fp32, bf16, fp16"):
        read_plan(half)
    rc, text, _ = run(capsys, "simulate", *SMALL, "--budgets", "2", "--wire-dtype", "fp16")
    assert rc == 0 and "fp16 vectors on the wire" in text


def test_simulate_json_records(capsys):
    rc, text, _ = run(capsys, "simulate", *SMALL, "--budgets", "1,2", "--dedup", "both", "--json")
    assert rc == 0
    records = json.loads(text)
    keys = {
        "strategy",
        "budget_x",
        "inter_group_bytes",
        "intra_group_bytes",
        "sync_bytes",
        "modeled_time_s",
        "memory_per_gpu_bytes",
        "dedup",
    }
    assert all(keys <= set(r) for r in records)
    assert len(records) == 2 * 2 * len(STRATEGIES)  # dedup x budgets x strategies
    assert {r["strategy"] for r in records} >= {"row_wise", "row_wise_group_dedup", "flexshard"}
    for dedup in (True, False):
        for x in (1.0, 2.0):
            group = [r for r in records if r["dedup"] == dedup and r["budget_x"] == x and r["feasible"]]
            ours = next(r for r in group if r["strategy"] == "flexshard")
            for r in group:  # the objective: the modeled step, pipelined as train runs it (--pipeline on)
                assert ours["step_s"] <= r["step_s"] * (1 + 1e-9), r["strategy"]


def test_simulate_table_is_printed(capsys):
    rc, text, _ = run(capsys, "simulate", *SMALL, "--budgets", "1.5", "--strategies", "flexshard,row_wise")
    assert rc == 0
    assert "inter vs row-wise" in text and "flexshard" in text and "row_wise" in text


def test_malformed_topology_json(tmp_path, capsys):
    topo = tmp_path / "topo.json"
    topo.write_text('{"nodes": [1, 2,')
    out = tmp_path / "plan.json"
    line = fails(capsys, "plan", "--workload", "synthetic:2:1e4", "--topology", str(topo), "--out", str(out))
    assert "topo.json" in line and "line 1" in line
    assert not out.exists()


def test_topology_without_gpus(tmp_path, capsys):
    topo = tmp_path / "empty.json"
    topo.write_text(
        json.dumps(
            {
                "directed": False,
                "multigraph": False,
                "graph": {"schema": "flexshard-topology/1", "name": "x"},
                "nodes": [{"id": "h0", "kind": "host", "name": "h0"}],
                "edges": [],
            }
        )
    )
    line = fails(capsys, "plan", "--workload", "synthetic:2:1e4", "--topology", str(topo))
    assert "GPU" in line or "gpu" in line


def test_unknown_presets(capsys):
    assert "nosuch" in fails(capsys, "plan", "--topology", "nosuch:3", "--workload", "synthetic:2:1e4")
    assert "nosuch" in fails(capsys, "plan", "--workload", "nosuch")


def test_infeasible_budget_names_the_smallest(tmp_path, capsys):
    out = tmp_path / "plan.json"
    line = fails(capsys, "plan", *SMALL, "--budget", "0.5", "--out", str(out))
    assert "budget" in line and "smallest feasible budget" in line
    assert not out.exists()


def test_bad_budget_value(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", *SMALL, "--budget", "nan"])
    assert e.value.code == 2
    assert "--budget" in capsys.readouterr().err


def test_stats_bad_counts_and_ids(tmp_path, capsys):
    out = tmp_path / "stats.npz"
    bad = tmp_path / "neg.csv"
    bad.write_text("0,1,3\n1,2,-3\n")
    line = fails(capsys, "stats", str(bad), "--out", str(out))
    assert "-3" in line and "count" in line
    nan = tmp_path / "nan.csv"
    nan.write_text("0,1,3\n1,2,nan\n")
    assert "nan" in fails(capsys, "stats", str(nan), "--out", str(out)).lower()
    seqs = tmp_path / "seqs.txt"
    seqs.write_text("1 5 6 7\n2 6 9\n")
    line = fails(capsys, "stats", str(seqs), "--num-rows", "item_id=8", "--out", str(out))
    assert "9" in line and "item_id" in line
    assert "--dim" in fails(capsys, "stats", str(seqs), "--dim", "0", "--out", str(out))
    assert not out.exists()


def test_stats_then_plan(tmp_path, capsys):
    seqs = tmp_path / "seqs.txt"
    seqs.write_text("1 5 6 7 5 5\n2 6 9 5\n3 5 1\n")
    stats = tmp_path / "stats.npz"
    rc, text, _ = run(capsys, "stats", str(seqs), "--dim", "16", "--out", str(stats))
    assert rc == 0 and stats.exists() and "item_id" in text
    rc, text, _ = run(capsys, "plan", "--workload", str(stats), "--topology", "h100:2x2", "--budget", "3")
    assert rc == 0 and "item_id" in text


def test_stats_measures_touch_rates_by_default(tmp_path, capsys):
    """One history file: touch rates measured for training's samples (window and negatives as train's
    defaults), recorded in the plan; --touch-rates off and several inputs price independent draws."""
    seqs = tmp_path / "seqs.txt"
    seqs.write_text("1 5 6 7 5 5\n2 6 9 5\n3 5 1\n4 9 9 9 9 6\n")
    stats, plain, plan = tmp_path / "m.npz", tmp_path / "i.npz", tmp_path / "plan.json"
    rc, text, _ = run(capsys, "stats", str(seqs), "--dim", "16", "--window", "3", "--out", str(stats))
    assert rc == 0 and "item_id measured (next-item, window 3, negatives 4; bucketing error" in text
    workload, _ = load_stats(stats)
    item = next(t for t in workload.tables if t.name == "item_id")
    # a sample: up to 3 history items, the target and 4 negatives (users 1-4 have 5, 3, 2, 5 items)
    history = np.mean([np.mean([min(c, 3) for c in range(1, n)]) for n in (5, 3, 2, 5)])
    assert item.ids_per_sample == pytest.approx(history + 1 + 4)
    rc, text, _ = run(capsys, "plan", "--workload", str(stats), "--topology", "h100:2x2", "--out", str(plan))
    assert rc == 0 and "Touch rates: item_id measured (next-item, window 3, negatives 4" in text
    assert read_plan(plan).tables[0].touch_rates == "next-item, window 3, negatives 4"
    rc, text, _ = run(capsys, "stats", str(seqs), "--touch-rates", "off", "--out", str(plain))
    assert rc == 0 and "Touch rates: independent draws" in text
    assert all(t.touch is None for t in load_stats(plain)[0].tables)
    rc, text, err = run(capsys, "stats", str(seqs), str(seqs), "--out", str(plain))
    assert rc == 0 and "note: touch rates not measured" in err and "note" not in text  # a log line, stderr
    line = fails(capsys, "stats", str(seqs), str(seqs), "--touch-rates", "history", "--out", str(plain))
    assert line.startswith("flexshard stats: error: --touch-rates history: needs one file of user histories")
    line = fails(capsys, "stats", str(seqs), "--window", "0", "--out", str(tmp_path / "x.npz"))
    assert "sampling.window: must be a positive integer, got 0" in line
    assert not (tmp_path / "x.npz").exists()
    inter = tmp_path / "toy.inter"  # RecBole: histories in timestamp order
    inter.write_text("user_id:token\titem_id:token\ttimestamp:float\na\tx\t2\na\ty\t1\nb\ty\t5\nb\tz\t6\n")
    rc, text, _ = run(capsys, "stats", str(inter), "--window", "3", "--out", str(tmp_path / "r.npz"))
    assert rc == 0 and "item_id measured (next-item, window 3, negatives 4" in text


def test_topology_command_exports_json(tmp_path, capsys):
    out = tmp_path / "topo.json"
    rc, text, _ = run(capsys, "topology", "--topology", "skewed:4", "--out", str(out))
    assert rc == 0 and out.exists() and "slow" in text.lower()
    rc, _, _ = run(capsys, "plan", "--workload", "synthetic:3:1e5", "--topology", str(out))
    assert rc == 0


def test_write_json_topology_roundtrip_plan(tmp_path, capsys):
    topo = tmp_path / "h.json"
    write_json(h100_cluster(2, 2), topo)
    rc, _, _ = run(capsys, "plan", "--workload", "synthetic:2:1e4", "--topology", str(topo), "--json")
    assert rc == 0
    assert Path(topo).exists()


def test_stats_non_positive_rows(tmp_path, capsys):
    seqs = tmp_path / "seqs.txt"
    seqs.write_text("1 5 6\n")
    out = tmp_path / "stats.npz"
    line = fails(capsys, "stats", str(seqs), "--num-rows", "item_id=0", "--out", str(out))
    assert "--num-rows" in line and "item_id=0" in line
    assert not out.exists()


def test_train_subcommand_runs_the_training_entry_point(capsys):
    rc, text, _ = run(capsys, "train", "--steps", "2", "--verify", "--quiet")
    assert rc == 0
    assert "verify: OK" in text


def test_batch_size_replaces_the_workloads_batch(capsys):
    """--batch-size keeps the row statistics and changes the per-GPU batch: the records equal those of
    the same workload built with that batch."""
    from flexshard import workloads
    from flexshard.cli import simulate_records
    from solvers.tier_program import OptimizerConfig
    from topology import cluster_view, load_topology

    rc, text, _ = run(capsys, "simulate", *SMALL, "--budgets", "2", "--batch-size", "4096", "--json")
    assert rc == 0
    got = {r["strategy"]: r for r in json.loads(text)}
    wl = workloads.synthetic_workload(6, 2_000_000, 1.0)
    wl = type(wl)(wl.name, wl.tables, 4096)
    want = {
        r["strategy"]: r
        for r in simulate_records(
            wl,
            cluster_view(load_topology("h100:2x4")),
            [2.0],
            [True],
            ["flexshard", "row_wise"],
            config=OptimizerConfig(overlap=True),  # simulate's --pipeline on
        )
    }
    for s in ("flexshard", "row_wise"):
        assert got[s]["inter_group_bytes"] == pytest.approx(want[s]["inter_group_bytes"], rel=1e-9)
    rc, base, _ = run(capsys, "simulate", *SMALL, "--budgets", "2", "--json")
    assert json.loads(base)[1]["inter_group_bytes"] != got["row_wise"]["inter_group_bytes"]
    with pytest.raises(SystemExit) as e:
        main(["simulate", *SMALL, "--batch-size", "0"])
    assert e.value.code == 2
    assert "--batch-size: must be positive, got '0'" in capsys.readouterr().err


def test_plan_for_some_of_the_tables(tmp_path, capsys):
    """``--tables`` plans the named tables alone, in their order (the tables a model looks up), as a plan
    of a workload of those tables would; a name not among them, named twice or none is a one-line error
    and writes nothing."""
    import dataclasses

    from flexshard import workloads
    from flexshard.cli import build_parser
    from flexshard.cli_common import optimizer_config
    from flexshard.plan_file import to_dict
    from solvers.planner import budget_bytes, make_plan
    from topology import cluster_view

    out = tmp_path / "plan.json"
    rc, _, _ = run(capsys, "plan", *SMALL, "--tables", "t3, t1", "-o", str(out))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [t["name"] for t in doc["tables"]] == ["t3", "t1"]
    workload, orders, _ = workloads.load_workload_full("synthetic:6:2e6:1.0")
    specs = {t.name: t for t in workload.tables}
    workload = dataclasses.replace(workload, tables=(specs["t3"], specs["t1"]))
    view = cluster_view(h100_cluster(2, 4))
    config = optimizer_config(build_parser().parse_args(["plan", *SMALL]))
    planned = make_plan(
        "flexshard", workload, view, budget_bytes(workload, view, 2.0), True, "sparse", config
    )
    expected = to_dict(planned.plan, workload, view, planned.report, workloads.fingerprint(workload), orders)
    assert doc["tables"] == json.loads(json.dumps(expected["tables"]))
    assert doc["predicted"]["intra_group_bytes"] == pytest.approx(expected["predicted"]["intra_group_bytes"])
    for value, message in (
        ("t1,t9", "--tables: no table 't9' in the workload; its tables: t0, t1, t2, t3, t4, t5"),
        ("t1,t1", "--tables: table 't1' named twice in 't1,t1'"),
        (",", "--tables: ',' names no table"),
    ):
        again = tmp_path / f"{value}.json"
        assert message in fails(capsys, "plan", *SMALL, "--tables", value, "--out", str(again))
        assert not again.exists()
