"""``train --pipeline on`` (flexshard.training.pipeline) computes what ``--pipeline off`` does, bit for bit:
the same loss at every step and the same final checkpoint (every row of every shard of every rank, its
optimizer state, the dense parameters and their optimizer state), fp32, with dedup on and off, with a
FlexShard plan that has hot, warm and group-fetched cold rows, with a row-wise plan and with sample
placement; ``--verify``
passes with the pipeline; a bad batch under the pipeline is one error on every rank, at the same step as
without it; a run resumed mid-way with the pipeline equals the uninterrupted one, also when the first
half ran without it.

4 spawned gloo ranks in 2 groups of 2 (train_workers.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from train_workers import run_main

from flexshard import checkpoint

FOUR = ["--groups", "2", "--batch-size", "32"]  # at 32 per rank the plan fetches cold rows per group
STEPS = 4
VARIANTS = {  # name: extra flags ({plan}: the plan file of _write_plan)
    "dedup": ["--plan", "{plan}"],
    "no_dedup": ["--plan", "{plan}", "--no-dedup", "--override-plan", "--optimizer", "sgd"],
    "row_wise": ["--strategy", "row_wise"],
    "placement": ["--plan", "{plan}", "--sample-placement", "owner"],  # samples moved when prefetched
}


def _write_plan(path: Path) -> None:
    """The plan train makes on the fly for FOUR on the synthetic data (hot, warm and group-fetched cold
    rows, made with dedup on; planned with dedup off it would have no warm rows)."""
    from flexshard.plan_file import to_dict, write_plan
    from flexshard.training.config import DEFAULT_DIM
    from flexshard.training.data import SyntheticSource
    from flexshard.workloads import DEFAULT_NEGATIVES, DEFAULT_WINDOW, fingerprint
    from solvers.planner import budget_bytes, make_plan
    from solvers.tier_program import OptimizerConfig
    from topology.presets import h100_cluster
    from topology.views import cluster_view

    source = SyntheticSource(DEFAULT_DIM, DEFAULT_WINDOW, DEFAULT_NEGATIVES, 32, 0)
    workload, view = source.workload(), cluster_view(h100_cluster(2, 2))
    budget = budget_bytes(workload, view, 2.0)
    bytes_objective = OptimizerConfig(step_time=False)  # as train plans on the fly (training/planning.py)
    planned = make_plan("flexshard", workload, view, budget, True, "sparse", bytes_objective)
    doc = to_dict(planned.plan, workload, view, planned.report, fingerprint(workload), source.orders)
    write_plan(path, doc)


def _run(root: Path, name: str, mode: str, extra: list[str], steps: int = STEPS) -> list[str]:
    out = root / f"{name}_{mode}"
    out.mkdir(exist_ok=True)
    argv = [*FOUR, *extra, "--steps", str(steps), "--pipeline", mode]
    argv += ["--checkpoint-dir", str(out / "ckpt"), "--metrics-out", str(out / "metrics.jsonl")]
    return argv


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    _write_plan(root / "plan.json")
    calls = []
    for name, flags in VARIANTS.items():
        extra = [f.format(plan=root / "plan.json") for f in flags]
        calls.append((_run(root, name, "off", extra), None))
        calls.append((_run(root, name, "on", [*extra, "--verify"]), None))
    # resume: 6 steps straight, and 3 steps then (in new processes) resumed to 6, all pipelined
    calls.append((_run(root, "straight", "on", ["--checkpoint-every", "3"], 6), None))
    calls.append((_run(root, "resumed", "on", ["--checkpoint-every", "3"], 3), None))
    for mode in ("off", "on"):  # rank 2's batch of step 3 is bad
        calls.append(([*FOUR, "--steps", "5", "--pipeline", mode], "bad_batch_at_step_3"))
    # 3 steps unpipelined, resumed to 6 with the pipeline (one folder: the resume switches the mode)
    calls.append((_run(root, "switched", "off", ["--checkpoint-every", "3"], 3), None))
    first = run_main(4, calls, root / "run1", timeout_s=600.0)
    resume = _run(root, "resumed", "on", ["--checkpoint-every", "3", "--resume"], 6)
    switched = _run(root, "switched", "off", ["--checkpoint-every", "3", "--resume"], 6)
    switched[switched.index("--pipeline") + 1] = "on"
    second = run_main(4, [(resume, None), (switched, None)], root / "run2", timeout_s=120.0)
    return {"root": root, "first": first, "second": second}


def _calls(results, i):
    return [rank_results[i] for rank_results in results]


def _losses(folder: Path) -> list[float]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "step"]


def _assert_same(x, y, where: str) -> None:
    """Nested checkpoint payloads equal bit for bit (tensors by torch.equal, the rest by ==)."""
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            _assert_same(x[k], y[k], f"{where}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            _assert_same(a, b, f"{where}/{i}")
    else:
        assert x == y, where


def _assert_same_checkpoint(a: Path, b: Path, step: int) -> None:
    x, y = checkpoint.step_dir(a, step), checkpoint.step_dir(b, step)
    for r in range(4):
        px = torch.load(x / f"rank{r}.pt", weights_only=True)
        py = torch.load(y / f"rank{r}.pt", weights_only=True)
        assert set(px) >= {"rows"}, set(px)
        _assert_same(px, py, f"rank {r}")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pipelined_run_equals_unpipelined_bit_for_bit(runs, variant):
    i = list(VARIANTS).index(variant) * 2
    off, on = _calls(runs["first"], i), _calls(runs["first"], i + 1)
    for calls in (off, on):
        assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
    assert "pipeline on" in on[0]["err"] and "pipeline off" in off[0]["err"]
    plan_line = next(ln for ln in on[0]["err"].splitlines() if ln.startswith("plan ("))
    if variant == "row_wise":
        assert plan_line.startswith("plan (row_wise):") and "hot/warm/cold 0/0/" in plan_line
    else:  # hot, warm and group-fetched cold rows
        assert plan_line.startswith("plan (flexshard):") and "(group fetch)" in plan_line, plan_line
        hot_warm = re.findall(r"hot/warm/cold (\d+)/(\d+)/", plan_line)
        assert any(int(h) > 0 for h, _w in hot_warm) and any(int(w) > 0 for _h, w in hot_warm)
    assert f"dedup {'off' if variant == 'no_dedup' else 'on'}" in plan_line
    assert f"sample placement {'owner' if variant == 'placement' else 'off'}" in plan_line
    assert f"verify: OK ({STEPS} steps, all rows of all copies match)" in on[0]["out"].splitlines()
    root = runs["root"]
    a, b = root / f"{variant}_off", root / f"{variant}_on"
    losses = _losses(a)
    assert len(losses) == STEPS and losses == _losses(b)
    assert len(set(losses)) == STEPS  # training moved
    _assert_same_checkpoint(a / "ckpt", b / "ckpt", STEPS)


@pytest.mark.slow
def test_resume_with_the_pipeline_equals_the_uninterrupted_run(runs):
    n = 2 * len(VARIANTS)
    straight, first_half = _calls(runs["first"], n), _calls(runs["first"], n + 1)
    resumed = _calls(runs["second"], 0)
    for calls in (straight, first_half, resumed):
        assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
    assert "resume:" in resumed[0]["err"] and "(step 3)" in resumed[0]["err"]
    root = runs["root"]
    a, b = root / "straight_on", root / "resumed_on"
    assert _losses(a) == _losses(b) and len(_losses(a)) == 6  # the resumed log appends steps 4-6
    for step in (3, 6):
        _assert_same_checkpoint(a / "ckpt", b / "ckpt", step)


@pytest.mark.slow
def test_a_run_resumes_with_the_other_pipeline_setting(runs):
    first_half = _calls(runs["first"], 2 * len(VARIANTS) + 4)
    resumed = _calls(runs["second"], 1)
    for calls in (first_half, resumed):
        assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
    assert "pipeline off" in first_half[0]["err"] and "pipeline on" in resumed[0]["err"]
    assert "resume:" in resumed[0]["err"] and "(step 3)" in resumed[0]["err"]
    a, b = runs["root"] / "straight_on", runs["root"] / "switched_off"
    assert _losses(a) == _losses(b)
    _assert_same_checkpoint(a / "ckpt", b / "ckpt", 6)


@pytest.mark.slow
def test_a_bad_batch_under_the_pipeline_is_one_error_on_every_rank(runs):
    n = 2 * len(VARIANTS) + 2
    off, on = _calls(runs["first"], n), _calls(runs["first"], n + 1)
    for calls in (off, on):
        assert [c["rc"] for c in calls] == [2, 2, 2, 2], [c["err"] for c in calls]
        assert [c["err"] for c in calls[1:]] == ["", "", ""]  # rank 0 reports it
    message = on[0]["err"].strip().splitlines()[-1]
    assert re.fullmatch(
        r"bad input on rank 2: table '\w+': id 1000000000 out of range \[0, \d+\)",
        message.split("error: ")[-1],
    ), message
    assert message == off[0]["err"].strip().splitlines()[-1]
    steps = [[ln.split()[1] for ln in c[0]["err"].splitlines() if ln.startswith("step ")] for c in (off, on)]
    assert steps[0] == steps[1] == ["1/5", "2/5"]  # steps 1 and 2 done, step 3 refused
