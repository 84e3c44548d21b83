"""Modeled step time in the reports: the split of each strategy's step, collectives per step, and what
the tiers save over row_wise_group_dedup (or that the plan uses no replicas)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run

from flexshard.step_report import step_table, tier_savings

SMALL = ["--workload", "synthetic:6:2e6:1.0", "--topology", "h100:2x2"]


def _record(strategy: str, step_ms: float, hot: int = 0, warm: int = 0, collectives: int = 6) -> dict:
    return {
        "strategy": strategy,
        "budget_x": 2.0,
        "dedup": True,
        "feasible": True,
        "step_s": step_ms * 1e-3,
        "latency_s": 0.25e-3,
        "bandwidth_s": (step_ms - 0.5) * 1e-3,
        "local_s": 0.25e-3,
        "collectives": collectives,
        "hot_rows": hot,
        "warm_rows": warm,
    }


def test_step_table_splits_each_strategy():
    piped = {**_record("flexshard", 2.0, 10, collectives=10), "overlapped_s": 0.125e-3, "local_s": 0.375e-3}
    table = step_table([piped, _record("row_wise", 3.0, collectives=4)])
    lines = table.splitlines()
    assert lines[0].split() == [
        "budget",
        "strategy",
        "dedup",
        "step",
        "ms",
        "latency",
        "bandwidth",
        "local",
        "overlapped",
        "collectives",
    ]
    # pipelined: 2.000 = 0.250 + 1.500 + 0.375 - 0.125; a record without the field overlaps nothing
    assert lines[2].split() == ["2x", "*flexshard", "on", "2.000", "0.250", "1.500", "0.375", "-0.125", "10"]
    assert lines[3].split() == ["2x", "row_wise", "on", "3.000", "0.250", "2.500", "0.250", "0.000", "4"]


def test_step_table_prices_torchrecs_default_in_its_own_collectives():
    """The row-wise record without dedup is followed by its plan in TorchRec's collectives; one priced for
    the headline only (``extra``) closes its budget's rows, once."""
    off = {**_record("row_wise", 3.0, collectives=3), "dedup": False}
    theirs = {
        "torchrec_step_s": 3.5e-3,
        "torchrec_latency_s": 0.5e-3,
        "torchrec_bandwidth_s": 2.5e-3,
        "torchrec_local_s": 0.5e-3,
        "torchrec_collectives": 5,
    }
    row = ["2x", "torchrec_default", "off", "3.500", "0.500", "2.500", "0.500", "0.000", "5"]
    lines = step_table([_record("flexshard", 2.0), {**off, **theirs}]).splitlines()[2:]
    assert [line.split() for line in lines[1:]] == [
        ["2x", "row_wise", "off", "3.000", "0.250", "2.500", "0.250", "0.000", "3"],
        row,
    ]
    four = {**_record("flexshard", 2.0), "budget_x": 4.0}
    lines = step_table([_record("flexshard", 2.0), four], [{**off, **theirs}]).splitlines()[2:]
    assert [line.split()[:2] for line in lines] == [
        ["2x", "*flexshard"],
        ["2x", "torchrec_default"],
        ["4x", "*flexshard"],
    ]
    assert lines[1].split() == row


def test_tier_savings_name_the_saving_or_say_no_replicas():
    base = _record("row_wise_group_dedup", 4.0)
    saved = tier_savings([_record("flexshard", 3.0, hot=1200, warm=34, collectives=10), base])
    assert saved == [
        "Tiers of FlexShard at 2x, dedup on: the tiers (1,200 hot and 34 warm rows) save 1.000 ms (25.0%) "
        "of modeled step time over row_wise_group_dedup (3.000 vs 4.000 ms; 10 vs 6 collectives)"
    ]
    costly = tier_savings([_record("flexshard", 5.0, hot=5), base])
    assert "the tiers (5 hot and 0 warm rows) cost 1.000 ms (25.0%)" in costly[0]
    none = tier_savings([_record("flexshard", 4.0)], [base])  # the baseline priced for this line only
    assert none == [
        "Tiers of FlexShard at 2x, dedup on: the plan uses no replicas (no hot or warm rows), so the tiers "
        "save nothing over row_wise_group_dedup in modeled step time (4.000 vs 4.000 ms; any difference is "
        "the cold rows' fetch modes)"
    ]
    # budgets whose plans save the same share a line; each dedup setting and saving has its own
    at = [{**_record("flexshard", 4.0), "budget_x": x} for x in (1.0, 1.5, 2.0)]
    at.append({**_record("flexshard", 3.0, hot=1200), "budget_x": 4.0})
    bases = [{**base, "budget_x": x} for x in (1.0, 1.5, 4.0)]
    lines = tier_savings(at, [*bases, base])
    assert [line.split(":")[0] for line in lines] == [
        "Tiers of FlexShard at 1x, 1.5x and 2x, dedup on",
        "Tiers of FlexShard at 4x, dedup on",
    ]
    assert lines[0].endswith(none[0].split(": ", 1)[1]) and "(1,200 hot and 0 warm rows) save" in lines[1]


@pytest.mark.parametrize(("objective", "pipeline"), [("step", "on"), ("bytes", "on"), ("step", "off")])
def test_simulate_prints_the_step_table_and_the_tiers_line(capsys, objective, pipeline):
    flags = ["--objective", objective, "--pipeline", pipeline]
    rc, text, err = run(capsys, "simulate", *SMALL, "--budgets", "2", *flags)
    assert rc == 0, err
    assert "Modeled step time (ms, slowest rank): collective latency + bytes / bandwidth + local work" in text
    assert ("- overlapped (pipelined, --pipeline on)" in text) == (pipeline == "on")
    step_rows = text.split("Modeled step time (ms, slowest rank)")[1].splitlines()
    assert any(line.split()[:2] == ["2x", "*flexshard"] for line in step_rows if line.strip())
    tiers = [line for line in step_rows if line.startswith("Tiers of FlexShard at 2x, dedup on: ")]
    assert len(tiers) == 1 and "row_wise_group_dedup" in tiers[0]
    rc, doc, _ = run(capsys, "simulate", *SMALL, "--budgets", "2", *flags, "--json")
    records = json.loads(doc)
    for r in records:
        if r["feasible"]:
            parts = r["latency_s"] + r["bandwidth_s"] + r["local_s"] - r["overlapped_s"]
            assert r["step_s"] == pytest.approx(parts, rel=1e-12) and r["collectives"] >= 1
            replicas = r["hot_rows"] + r["warm_rows"] > 0  # only a replica sync overlaps anything
            assert (r["overlapped_s"] > 0) == (pipeline == "on" and replicas), r["strategy"]
    ours = next(r for r in records if r["strategy"] == "flexshard")
    feasible = [r for r in records if r["feasible"]]
    if objective == "step":  # chosen by modeled step: never above a feasible baseline
        assert ours["step_s"] <= min(r["step_s"] for r in feasible) * (1 + 1e-9)
    else:
        assert ours["modeled_time_s"] <= min(r["modeled_time_s"] for r in feasible) * (1 + 1e-9)


def test_plan_prints_the_step_split_and_the_tiers_line(capsys):
    rc, text, err = run(capsys, "plan", *SMALL, "--budget", "2")
    assert rc == 0, err
    step = next(line for line in text.splitlines() if line.startswith("Modeled step time: "))
    assert "collective latency" in step and "collectives: ids" in step and "local work" in step
    assert "latencies: NCCL figures" in text  # the h100 preset's figures
    assert "local work: assumed: H100 HBM roofline" in text
    assert any(line.startswith("Tiers: ") and "row_wise_group_dedup" in line for line in text.splitlines())


def test_gpu_host_measured_prices_the_runtime_host_work_in_plan_and_simulate(capsys):
    """--gpu-host measured: the report names the measured host work and every strategy's step carries it
    (step_s + table_s x tables + (stage_s + table_stage_s x tables) x collectives above the fused
    figure's local work, per strategy: 6 tables here); a bad value exits 2 naming it."""
    from solvers.time_types import H100_RUNTIME_RATES as R

    rc, text, err = run(capsys, "plan", *SMALL, "--budget", "2", "--gpu-host", "measured")
    assert rc == 0, err
    assert "local work: H100: value work at the HBM roofline (3.35 TB/s, assumed); host work measured" in text
    by = {}
    for host in ("fused", "measured"):
        rc, doc, err = run(capsys, "simulate", *SMALL, "--budgets", "2", "--gpu-host", host, "--json")
        assert rc == 0, err
        by[host] = {
            r["strategy"]: r for r in json.loads(doc) if r["feasible"] and r["strategy"] != "flexshard"
        }
    for name, fused in by["fused"].items():  # the baselines' plans do not depend on the rates
        measured = by["measured"][name]
        host = R.host_s(6, measured["collectives"])
        assert measured["local_s"] - fused["local_s"] == pytest.approx(host, rel=1e-6), name
    with pytest.raises(SystemExit) as exited:
        run(capsys, "plan", *SMALL, "--budget", "2", "--gpu-host", "slow")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --gpu-host: invalid choice: 'slow'" in err
