"""Issue 22: limits checked before work (a step's memory, the budget's cap) and messages that say what
happened (a NaN probability, a negative count, --verify's closest call; the probe's slow count is in
tests/topology/test_probe_slow_count.py).

The one-line refusals of flags and files through the CLIs are in test_bad_input_sweep.py; here are the
figures behind them (hand-computed), the memory refusal on a machine of a given size, and the lines whose
content depends on the run.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import run
from torchrun_jobs import run_torchrun

from core.errors import ConfigError, PlannerError
from flexshard.training import limits
from flexshard.training.data import SyntheticSource
from solvers.cost_model import evaluate, row_wise_memory_bytes
from solvers.planner import budget_bytes, everything_fits_bytes, make_plan
from solvers.types import Plan, RowHistogram, TablePlan
from topology.views import uniform_view

GiB = 2**30
CPU = torch.device("cpu")


# --- a step's memory ----------------------------------------------------------------------------------


def test_step_bytes_by_hand():
    # B 2, L 3, D 4, 1 negative (C 2), 1 sequence table and a user table: I = 1 x (3 + 2) + 1 = 6 ids
    # ids 8 x 6 x 6 = 288; vectors 4 x 4 x 2 x 6 = 192; dense 4 x (5x3x4 + 5x2x4 + 3x2x3) = 4 x 118 = 472
    assert limits.step_bytes(2, 3, 4, 1, 1, user_table=True) == 2 * (288 + 192 + 472)
    # two tables, no user table: I = 2 x 5 = 10; 480 + 320 + 472
    assert limits.step_bytes(2, 3, 4, 1, 2, user_table=False) == 2 * (480 + 320 + 472)


def test_step_bytes_is_linear_in_the_batch_and_grows_with_every_factor():
    base = limits.step_bytes(512, 20, 16, 4, 2, False)
    assert limits.step_bytes(1024, 20, 16, 4, 2, False) == 2 * base
    for bigger in [(512, 21, 16, 4), (512, 20, 17, 4), (512, 20, 16, 5)]:
        assert limits.step_bytes(*bigger, 2, False) > base


@pytest.fixture
def machine_of(monkeypatch):
    """Make this machine's physical memory ``n`` bytes for the memory check (and one local rank)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_memory(n: int | None) -> None:
        monkeypatch.setattr(limits, "physical_memory_bytes", lambda: n)

    return set_memory


def test_a_step_over_the_memory_is_refused_naming_the_flag(machine_of):
    machine_of(16 * GiB)
    need = limits.step_bytes(512, 20, 16, 100_000, 2, False)
    with pytest.raises(ConfigError) as err:
        limits.check_step_memory(512, 20, 16, 100_000, 2, False, CPU)
    assert str(err.value) == (
        f"--negatives: 100,000 (with --batch-size 512, --max-len 20, --dim 16) needs about "
        f"{need / GiB:,.1f} GiB per rank for one step, over this machine's memory (16.0 GiB); "
        "lower --negatives"
    )
    with pytest.raises(ConfigError, match=r"^--batch-size: 100,000,000,000 \(with --negatives 4, "):
        limits.check_step_memory(10**11, 20, 16, 4, 2, False, CPU)
    # both past the defaults, and either one back at its default fits: both named
    with pytest.raises(ConfigError, match=r"lower --negatives or --batch-size$"):
        limits.check_step_memory(20_000, 20, 16, 3_000, 2, False, CPU)
    limits.check_step_memory(512, 20, 16, 4, 2, False, CPU)  # the defaults fit
    machine_of(None)  # the system does not say: nothing to compare with
    limits.check_step_memory(10**11, 20, 16, 4, 2, False, CPU)


def test_the_limit_is_the_memory_shared_by_the_local_ranks_and_verify_counts_the_reference(
    machine_of, monkeypatch
):
    one_step = limits.step_bytes(512, 20, 16, 2_000, 2, False)
    machine_of(int(1.5 * one_step))
    limits.check_step_memory(512, 20, 16, 2_000, 2, False, CPU)  # fits one rank
    with pytest.raises(ConfigError, match=r"and its --verify reference, over this machine's memory"):
        limits.check_step_memory(512, 20, 16, 2_000, 2, False, CPU, replicas=3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"over this machine's .+ GiB shared by 2 local ranks \("):
        limits.check_step_memory(512, 20, 16, 2_000, 2, False, CPU)


def test_train_refuses_a_batch_past_the_memory_before_any_work(machine_of, capsys, monkeypatch, tmp_path):
    """One line, exit 2, and nothing made: no checkpoint folder, no source (the refusal comes before the
    synthetic source is built)."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    machine_of(4 * GiB)
    built = []
    monkeypatch.setattr("flexshard.training.loop.make_source", lambda *a: built.append(a))
    rc, out, err = run(capsys, "train", "--negatives", "100000", "--checkpoint-dir", str(tmp_path / "ck"))
    need = limits.step_bytes(512, 20, 16, 100_000, 2, False)
    assert (rc, out) == (2, "")
    assert err.strip() == (
        f"flexshard train: error: --negatives: 100,000 (with --batch-size 512, --max-len 20, --dim 16) needs "
        f"about {need / GiB:,.1f} GiB per rank for one step, over this machine's memory (4.0 GiB); lower "
        "--negatives"
    )
    assert built == [] and not (tmp_path / "ck").exists()


# --- the budget -------------------------------------------------------------------------------------


def test_a_budget_past_everything_is_capped_where_every_plan_fits():
    workload = SyntheticSource(16, 20, 4, 16, 0).workload()
    view = uniform_view(4, 2, 450e9, 50e9)
    cap = everything_fits_bytes(workload)
    # by hand: 50,000 + 5,000 rows of 16 float32 + 4 B of Adagrad state, + 12 B of routing each
    assert cap == 55_000 * (16 * 4 + 4 + 12)
    assert budget_bytes(workload, view, 1e308) == cap
    assert budget_bytes(workload, view, 2.0) == 2.0 * row_wise_memory_bytes(workload, view)
    for x in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ConfigError, match="budget: must be a positive multiple"):
            budget_bytes(workload, view, x)
    capped = make_plan("flexshard", workload, view, budget_bytes(workload, view, 1e308))
    at_cap = make_plan("flexshard", workload, view, cap)
    assert capped.report.modeled_time_s == at_cap.report.modeled_time_s
    assert capped.report.memory_per_gpu_bytes <= cap
    # the cap bounds every plan: every row hot on every GPU (one tier: no routing), and every row but
    # the coldest hot (the most routing entries)
    n, per_group = view.num_ranks, view.num_ranks // view.num_groups
    shares = np.full(n, 1 / per_group), np.full(n, 1 / n)
    for cold in (0, 1):
        tables = tuple(TablePlan(t.name, t.num_rows - cold, 0, cold, *shares) for t in workload.tables)
        memory = evaluate(workload, view, Plan("hand", tables, dedup=True)).memory_per_gpu_bytes
        assert memory <= cap
        if cold == 0:
            assert memory == 55_000 * (16 * 4 + 4)


def test_plan_with_a_huge_budget_says_it_was_capped(capsys, tmp_path):
    rc, out, err = run(
        capsys, "plan", "--budget", "1e308", "--topology", "h100:1x2", "--out", str(tmp_path / "p.json")
    )
    assert rc == 0, err
    assert re.search(
        r"; budget 1e\+308x row-wise, capped at [0-9.]+ [kMGT]?B per GPU \(everything fits\);", out
    )
    rc, out, err = run(capsys, "simulate", "--budgets", "1e308", "--topology", "h100:1x2", "--json")
    assert rc == 0, err


# --- messages ---------------------------------------------------------------------------------------


def test_a_histogram_names_the_bad_probability_and_count():
    with pytest.raises(PlannerError) as err:
        RowHistogram(np.array([1, 2]), np.array([float("nan"), 0.0]))
    assert str(err.value) == "histogram.prob: probabilities must be finite and >= 0, got nan (bucket 0)"
    with pytest.raises(PlannerError, match=r"got -0.5 \(bucket 1\)$"):
        RowHistogram(np.array([1, 1]), np.array([1.5, -0.5]))
    with pytest.raises(PlannerError, match=r"got inf \(bucket 0\)$"):
        RowHistogram(np.array([1]), np.array([float("inf")]))
    with pytest.raises(PlannerError) as err:
        RowHistogram.from_counts(np.array([3, 0, -5, 206]))
    assert str(err.value) == "counts: negative access count -5 (row 2)"
    with pytest.raises(PlannerError) as err:
        RowHistogram.from_counts(np.array([3.0, float("nan")]))
    assert str(err.value) == "counts: access counts must be finite, got nan (row 1)"


def test_verify_with_no_difference_says_so(capsys, monkeypatch):
    """One rank: every value equals the reference's, so there is no closest call to name (it printed
    '(, step 0)')."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = run(capsys, "train", "--steps", "2", "--batch-size", "16", "--quiet", "--verify")
    assert rc == 0, err
    verdict = [line for line in out.splitlines() if line.startswith("verify:")]  # the summary follows them
    assert verdict == [
        "verify: largest difference 0: every compared value equal to the reference's",
        "verify: OK (2 steps, all rows of all copies match)",
    ]


@pytest.mark.slow
def test_the_memory_refusal_is_one_line_under_torchrun(tmp_path):
    """Two workers (LOCAL_WORLD_SIZE 2: each gets half the machine): rank 0 prints the one line, both
    exit 2 (torchrun's summary), before any batch exists; torchrun itself exits 1."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "flexshard.train", "--negatives", str(10**9)]  # fmt: skip
    done = run_torchrun(argv, timeout=120, cwd=tmp_path, env=env)
    err = done.stderr
    assert done.returncode == 1
    ours = [ln for ln in err.splitlines() if ln.startswith("flexshard train")]
    assert len(ours) == 1, err
    assert re.fullmatch(
        r"flexshard train: error: --negatives: 1,000,000,000 \(with --batch-size 512, --max-len 20, "
        r"--dim 16\) needs about [0-9,.]+ GiB per rank for one step, over this machine's [0-9,.]+ GiB "
        r"shared by 2 local ranks \([0-9,.]+ GiB\); lower --negatives",
        ours[0],
    ), ours[0]
    assert err.count("exitcode  : 2") == 2
