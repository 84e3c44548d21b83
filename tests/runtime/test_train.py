"""``flexshard.train``: multi-process training with ``--verify`` against the unsharded reference, a
deliberately wrong reference, sharded checkpoint / resume, a real-data run, ``--strategy`` (every
strategy the runtime accepts trains and verifies), ``--metrics-out``, and argument errors.

Ranks are spawned gloo processes that call ``main(argv)`` with the launcher's environment set (as
torchrun would); see ``train_workers.py``."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrun_jobs import run_torchrun
from train_workers import run_main

from flexshard import checkpoint
from flexshard.train import main
from flexshard.workloads import data_root

BEAUTY = data_root() / "amazon-yelp-sequences" / "Beauty.txt"
SMALL = ["--batch-size", "16"]
# the 4-rank runs: at 32 samples per rank the planner fetches a table's cold rows once per group (at 16 the
# group fetch's per-rank ids across the fabric make the flat fetch as cheap, and the plan takes it)
FOUR = ["--batch-size", "32"]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """4 ranks as 2 groups of 2: verify runs, a replica made to diverge, and checkpoints A (6 steps
    straight) and B (3 steps); then, in new processes, B resumed to 6 steps with --verify."""
    root = tmp_path_factory.mktemp("train4")
    a, b = root / "ckpt_a", root / "ckpt_b"
    calls = [
        (["--groups", "2", "--steps", "5", "--verify", *FOUR], None),
        (
            [
                "--groups",
                "2",
                "--steps",
                "3",
                "--verify",
                "--no-dedup",
                "--optimizer",
                "sgd",
                "--objective",
                "click",
                *FOUR,
            ],
            None,
        ),  # fmt: skip
        (["--groups", "2", "--steps", "5", "--verify", *FOUR], "diverge_replica"),
        (
            ["--groups", "2", "--steps", "6", "--checkpoint-dir", str(a), "--checkpoint-every", "3", *FOUR],
            None,
        ),
        (
            ["--groups", "2", "--steps", "3", "--checkpoint-dir", str(b), "--checkpoint-every", "3", *FOUR],
            None,
        ),
        (["--groups", "2", "--steps", "4", "--verify", "--wire-dtype", "bf16", *FOUR], None),
    ]
    first = run_main(4, calls, root / "run1")
    shutil.copytree(b / "step-00000003", root / "b_step3_before_resume")
    resume = [
        (
            [
                "--groups",
                "2",
                "--steps",
                "6",
                "--checkpoint-dir",
                str(b),
                "--checkpoint-every",
                "3",
                "--resume",
                "--verify",
                *FOUR,
            ],
            None,
        ),  # fmt: skip
    ]
    second = run_main(4, resume, root / "run2")
    return {"root": root, "a": a, "b": b, "first": first, "second": second}


def _call(results, i):
    return [rank_results[i] for rank_results in results]


def _verified(out: str, steps: int) -> bool:
    """Whether a run's results (stdout) say it verified ``steps`` steps (the summary follows that line)."""
    return f"verify: OK ({steps} steps, all rows of all copies match)" in out.splitlines()


@pytest.mark.slow
def test_verify_passes_on_every_rank(four):
    for i in (0, 1):
        calls = _call(four["first"], i)
        assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
        steps = 5 if i == 0 else 3
        out = calls[0]["out"].splitlines()  # results: the verdict, then the summary
        ok = out.index(f"verify: OK ({steps} steps, all rows of all copies match)")
        closest = re.fullmatch(  # the closest call over every rank, step and check
            r"verify: largest difference ([0-9.]+) of the 16 unit roundoffs allowed \((.+), step (\d+)\)",
            out[ok - 1],
        )
        assert closest and 0 < float(closest[1]) < 16 and 1 <= int(closest[3]) <= steps, calls[0]["out"]
        assert out[ok + 1].startswith(f"summary: {steps} steps (steps 1-{steps}), final loss ")
        lines = calls[0]["err"].splitlines()  # the log: the run, the plan, the steps
        assert "world 4 (2 groups of 2)" in lines[0]
        # the plan made on the fly fetches some table's cold rows once per group, and verifies
        assert lines[1].startswith("plan (flexshard):") and "(group fetch)" in lines[1], lines[1]
        step_lines = [ln for ln in lines if ln.startswith("step ")]
        assert len(step_lines) == steps
        assert all("loss" in ln and "samples/s" in ln and "intra_group" in ln for ln in step_lines)
        # two groups and a plan with warm and cold rows: traffic on both link classes
        assert "inter_group 0 B" not in step_lines[0] and "intra_group 0 B" not in step_lines[0]
        assert all(c["out"] == "" and "loss" not in c["err"] for c in calls[1:])  # only rank 0 logs, reports


@pytest.mark.slow
def test_bf16_on_the_wire_trains_and_verifies_within_its_stated_tolerance(four):
    calls = _call(four["first"], 5)
    assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
    lines = calls[0]["err"].splitlines()
    assert (
        "verify: each step against an unsharded reference from the same state; normwise tolerance "
        "0.062 = 16 x the bf16 unit roundoff 2^-8"
    ) in lines
    assert _verified(calls[0]["out"], 4)
    fp32 = _call(four["first"], 0)[0]["err"].splitlines()

    def link_bytes(out: list[str]) -> int:  # intra + inter bytes of step 1 (same batches in both runs)
        words = [ln for ln in out if ln.startswith("step 1/")][0].split()
        return sum(int(words[i].replace(",", "")) for i in (7, 10))

    # vectors at 2 bytes per element: the vectors' bytes halve, the ids do not
    assert link_bytes(lines) < 0.75 * link_bytes(fp32)


@pytest.mark.slow
def test_a_diverged_replica_fails_on_every_rank(four):
    calls = _call(four["first"], 2)
    assert [c["rc"] for c in calls] == [1, 1, 1, 1]
    message = calls[0]["err"].strip().splitlines()[-1]  # every rank stops on the same mismatch; rank 0
    # reports it, after its log lines
    assert [c["err"] for c in calls[1:]] == ["", "", ""]
    assert re.fullmatch(
        r"verify: FAILED at step 2: rank 1's copy of table 'item' hot row \d+ differs from the row's other "
        r"copy \(replicas must stay bitwise equal\)",
        message,
    ), message
    assert "verify: OK" not in calls[0]["out"]


@pytest.mark.slow
def test_checkpoint_resume_equals_straight_training(four):
    a, b = four["a"], four["b"]
    resumed = _call(four["second"], 0)
    assert [c["rc"] for c in resumed] == [0, 0, 0, 0], [c["err"] for c in resumed]
    assert "resume:" in resumed[0]["err"] and "(step 3)" in resumed[0]["err"]
    assert [ln for ln in resumed[0]["err"].splitlines() if ln.startswith("step ")][0].startswith("step 4/6")
    assert _verified(resumed[0]["out"], 3)
    assert "summary: 3 steps (steps 4-6), final loss " in resumed[0]["out"]
    assert checkpoint.latest(a).name == checkpoint.latest(b).name == "step-00000006"
    for step in (3, 6):
        x = checkpoint.load_full(checkpoint.step_dir(a, step))  # every row saved exactly once (checked)
        y = checkpoint.load_full(checkpoint.step_dir(b, step))
        assert x.step == y.step == step
        for name in x.weights:
            torch.testing.assert_close(x.weights[name], y.weights[name], rtol=0, atol=1e-6)
            torch.testing.assert_close(x.states[name], y.states[name], rtol=0, atol=1e-6)
        assert x.states["item"]["momentum1"].abs().sum() > 0  # rowwise_adagrad's state is saved
        for key in x.dense:
            torch.testing.assert_close(x.dense[key], y.dense[key], rtol=0, atol=1e-6)
        assert x.dense_optimizer is not None and x.dense_optimizer["kind"] == "adagrad"
        assert any(s.abs().sum() > 0 for s in x.dense_optimizer["sums"])
    # training moved the rows between the two checkpoints
    w3 = checkpoint.load_full(checkpoint.step_dir(a, 3)).weights["item"]
    w6 = checkpoint.load_full(checkpoint.step_dir(a, 6)).weights["item"]
    assert not torch.equal(w3, w6)


@pytest.mark.slow
def test_checkpoint_files_hold_each_row_once(four):
    ckpt = checkpoint.step_dir(four["a"], 6)
    manifest = checkpoint.read_manifest(ckpt)
    assert manifest.world_size == 4 and manifest.groups == [[0, 1], [2, 3]]
    tiers = {}
    for r in range(4):
        payload = torch.load(ckpt / f"rank{r}.pt", weights_only=True)
        tiers[r] = {tier for table in payload["rows"].values() for tier in table}
        assert ("dense" in payload) == (r == 0)
    assert tiers[0] == {"hot", "warm", "cold"}
    assert tiers[1] == {"warm", "cold"}  # group 0: warm shard, no hot rows
    assert tiers[2] == tiers[3] == {"cold"}  # group 1: cold rows only


@pytest.mark.slow
def test_interrupted_save_is_never_loaded(four, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(four["a"], ckpt)
    # a save of step 9 that died after writing one shard, and a folder without a manifest
    partial = ckpt / ".tmp-step-00000009"
    partial.mkdir()
    (partial / "rank0.pt").write_bytes(b"partial")
    (ckpt / "step-00000012").mkdir()
    assert checkpoint.latest(ckpt).name == "step-00000006"
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.read_manifest(ckpt / "step-00000012")
    # a shard missing from a published checkpoint is reported, not silently zero
    broken = ckpt / "step-00000003"
    (broken / "rank3.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="rank3.pt: cannot read"):
        checkpoint.load_full(broken)


@pytest.mark.slow
def test_two_ranks_real_data_and_a_resize_of_another_run(four, tmp_path):
    calls = [  # 4 ranks' checkpoint resumed by 2 (a resize, test_resize.py) with another seed: refused
        (["--steps", "8", "--checkpoint-dir", str(four["a"]), "--resume", "--seed", "1", *SMALL], None),
    ]
    if BEAUTY.is_file():
        real = ["--data", str(BEAUTY), "--groups", "2", "--steps", "3", "--verify", "--batch-size", "256"]
        calls.append((real, None))
        # the user guide's path: flexshard stats -> flexshard plan -> train --plan (the stats file also
        # has an item_attribute table, which the model does not use)
        from flexshard.cli import main as cli

        npz, plan = tmp_path / "beauty.npz", tmp_path / "plan.json"
        assert cli(["stats", str(BEAUTY), "--dim", "16", "--out", str(npz)]) == 0
        make = [
            "plan",
            "--workload",
            str(npz),
            "--topology",
            "h100:2x1",
            "--batch-size",
            "64",
            "--out",
            str(plan),
        ]
        assert cli(make) == 0
        guide = ["--data", str(BEAUTY), "--plan", str(plan), "--steps", "2", "--verify"]
        calls.append((guide, None))
    results = run_main(2, calls, tmp_path / "run")
    mismatch = _call(results, 0)
    assert [c["rc"] for c in mismatch] == [2, 2]
    assert "flexshard train: error: --resume: " in mismatch[0]["err"]
    assert "was saved by another run (seed: '0' there, '1' here)" in mismatch[0]["err"]
    assert mismatch[1]["err"] == ""  # the same error on every rank: rank 0 reports it
    assert checkpoint.latest(four["a"]).name == "step-00000006"  # nothing written
    if not BEAUTY.is_file():
        pytest.skip(f"real data absent: {BEAUTY} (set FLEXSHARD_DATA); the resize check ran")
    real = _call(results, 1)
    assert [c["rc"] for c in real] == [0, 0], [c["err"] for c in real]
    assert "Beauty.txt (item_id 12,102 x 16, user_id 22,364 x 16)" in real[0]["err"]
    assert "world 2 (2 groups of 1)" in real[0]["err"]
    assert "item_id hot/warm/cold 0/" not in real[0]["err"]  # the plan replicates the hottest items
    assert _verified(real[0]["out"], 3)
    guide = _call(results, 2)
    assert [c["rc"] for c in guide] == [0, 0], [c["err"] for c in guide]
    assert "plan (flexshard): item_id hot/warm/cold" in guide[0]["err"]
    # the plan's prediction prices item_attribute too: said at the start and in the summary, not compared
    left_out = (
        "it also prices the tables item_attribute, which this run does not look up (make the plan with "
        "--tables item_id,user_id to price these alone)"
    )
    assert f"--plan: {left_out}" in guide[0]["err"]
    assert f"the plan's prediction does not apply: {left_out}" in guide[0]["out"]
    assert "item_attribute hot/warm/cold" not in guide[0]["err"]
    assert _verified(guide[0]["out"], 2)


def _summary_of(records: list[dict], world: int, batch: int) -> list[str]:
    """The end-of-run summary a run with these --metrics-out records prints, worked from the records:
    the last step's loss, samples over the steps' summed time (the slowest rank's), and per link class the
    mean over the steps of the busiest rank's bytes beside the header's predicted bytes."""
    steps = [r for r in records if r["kind"] == "step"]
    predicted = records[0]["plan"]["predicted"]
    seconds = 0.0
    for r in steps:
        seconds += r["elapsed_s"]
    samples = len(steps) * world * batch
    first, last = steps[0]["step"], steps[-1]["step"]
    lines = [
        f"summary: {len(steps)} steps (steps {first}-{last}), final loss {steps[-1]['loss']:.6f}, "
        f"{samples / seconds:,.0f} samples/s ({samples:,} samples in {seconds:.3f} s of steps, the slowest "
        "rank's)"
    ]
    rows = [["bytes per step", "measured (busiest rank, mean)", "plan's prediction", "measured vs plan"]]
    for link in ("intra_group", "inter_group"):
        total = 0.0
        for r in steps:
            total += r["bytes"][link]["max"]
        measured, want = total / len(steps), predicted[f"{link}_bytes"]
        rel = f"{measured / want - 1:+.1%}" if want > 0 else "-" if measured <= 0 else "none predicted"
        rows.append([link, f"{measured:,.0f} B", f"{want:,.0f} B", rel])
    from flexshard.report import format_table

    return lines + format_table(rows[0], rows[1:]).splitlines()


def test_single_process_without_launcher_quiet_still_summarises(monkeypatch, capsys, tmp_path):
    """--quiet: nothing on stderr, and the results on stdout: the verdict and the summary, whose figures
    are the run's own (its --metrics-out records)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    metrics = tmp_path / "m.jsonl"
    assert main(["--steps", "2", "--verify", "--quiet", "--metrics-out", str(metrics), *SMALL]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # --quiet = --log-level warning: no log lines
    lines = out.splitlines()
    assert lines[0].startswith("verify: largest difference ")
    assert lines[1] == "verify: OK (2 steps, all rows of all copies match)"
    assert lines[2:] == _summary_of(_records(metrics), world=1, batch=16)
    assert lines[-2].startswith("intra_group  ") and lines[-1].startswith("inter_group  ")
    assert not torch.distributed.is_initialized()


def test_deterministic_turns_on_torchs_deterministic_algorithms_and_trains_the_same(monkeypatch, tmp_path):
    """--deterministic: torch's deterministic algorithms are on for the run (every op of the step has a
    deterministic form: none raises), the cuBLAS workspace variable is set, and on the CPU, which is
    deterministic anyway, the losses are those of the run without it, bit for bit."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    plain, strict = tmp_path / "plain.jsonl", tmp_path / "strict.jsonl"
    assert main(["--steps", "3", "--quiet", "--metrics-out", str(plain), *SMALL]) == 0
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        assert main(["--steps", "3", "--quiet", "--deterministic", "--metrics-out", str(strict), *SMALL]) == 0
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    losses = [[r["loss"] for r in _records(p) if r.get("kind") == "step"] for p in (plain, strict)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_train_log_level(monkeypatch, capsys):
    """info (the default) logs the run and one line per step on stderr; debug adds each step's bytes by
    component; warning hides them; the summary prints at every level."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    seen = {}
    for level in ("debug", "info", "warning"):
        assert main(["--steps", "1", "--log-level", level, *SMALL]) == 0
        seen[level] = capsys.readouterr()
    assert seen["info"].err.splitlines()[0].startswith("train: world 1 (1 groups of 1)")
    (step,) = [ln for ln in seen["info"].err.splitlines() if ln.startswith("step ")]
    assert step.startswith("step 1/1 loss ") and step.endswith(" B (max over ranks), 0 s left")
    assert "debug" not in seen["info"].err
    debug = [ln for ln in seen["debug"].err.splitlines() if ln.startswith("debug: ")]
    assert debug == [ln for ln in debug if ln.startswith("debug: step 1: rank 0 bytes by component: ")]
    assert len(debug) == 1 and ": intra_group ids " in debug[0] and ", sync 0 B; inter_group ids " in debug[0]
    assert seen["warning"].err == ""
    for level in seen:
        assert seen[level].out.startswith("summary: 1 steps (steps 1-1), final loss ")


def test_plan_file_option(monkeypatch, capsys, tmp_path):
    """--plan: a plan file for this job's tables and world size trains and verifies; one for another
    world size is refused with the module's message."""
    from flexshard.plan_file import to_dict, write_plan
    from flexshard.training.data import SyntheticSource
    from solvers.planner import budget_bytes, make_plan
    from topology.views import uniform_view

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    workload = SyntheticSource(16, 20, 4, 16, 0).workload()
    for world in (1, 4):
        view = uniform_view(1, world, 450e9, 50e9)
        planned = make_plan("flexshard", workload, view, budget_bytes(workload, view, 2.0))
        write_plan(tmp_path / f"w{world}.json", to_dict(planned.plan, workload, view, planned.report, "t"))
    assert main(["--plan", str(tmp_path / "w1.json"), "--steps", "2", "--verify", *SMALL]) == 0
    assert "verify: OK (2 steps" in capsys.readouterr().out
    assert main(["--plan", str(tmp_path / "w4.json"), "--steps", "2", *SMALL]) == 2
    assert "the plan is for 4 ranks, this job has 1: launch 4 ranks" in capsys.readouterr().err
    # a plan for another embedding dim
    assert main(["--plan", str(tmp_path / "w1.json"), "--steps", "1", "--dim", "32", *SMALL]) == 2
    assert capsys.readouterr().err.strip() == (
        "flexshard train: error: table 'item': the plan was made for dim 16, the model has dim 32: train "
        "with --dim 16, or make the plan with flexshard stats --dim 32, then flexshard plan"
    )
    # a plan priced at float32 on the wire is not run at bf16 unless on purpose
    assert main(["--plan", str(tmp_path / "w1.json"), "--steps", "1", "--wire-dtype", "bf16", *SMALL]) == 2
    assert "wire: the plan was made with wire fp32, this run asks for bf16;" in capsys.readouterr().err
    argv = ["--plan", str(tmp_path / "w1.json"), "--steps", "1", "--wire-dtype", "bf16", "--override-plan"]
    assert main([*argv, *SMALL]) == 0
    out, err = capsys.readouterr()
    assert "override: wire bf16 (the plan was made with fp32;" in err
    assert "the plan's prediction does not apply: this run overrides its wire" in out  # the summary


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps: must be positive"),
        (["--resume"], "--resume, --checkpoint-every, --overwrite and --keep need --checkpoint-dir"),
        (["--groups", "3"], "--groups: 3 groups do not divide 1 ranks evenly"),
        (["--data", "/nonexistent/x.txt"], "--data: /nonexistent/x.txt: no such file"),
        (["--plan", "p.json", "--strategy", "row_wise"], "--strategy and --plan are exclusive"),
        (["--metrics-out", "/nonexistent/dir/m.jsonl"], "--metrics-out: '/nonexistent/dir/m.jsonl': folder"),
        (["--override-plan"], "--override-plan needs --plan"),
        (["--batch-size", "-3"], "--batch-size: must be positive, got -3"),
    ],
)
def test_bad_arguments(monkeypatch, capsys, argv, message):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexshard train: error:") and message in err
    assert err.count("\n") == 1  # one line


def test_synthetic_batches_are_deterministic():
    from flexshard.training.data import SyntheticSource

    src = SyntheticSource(16, 20, 4, 8, seed=3)
    x, y = src.batch(5, 1), src.batch(5, 1)
    assert np.array_equal(x.lengths, y.lengths) and np.array_equal(x.history["item"], y.history["item"])
    assert x.candidates["item"].shape == (8, 5)
    assert np.array_equal(x.history["creator"], x.history["item"] // 10)
    assert not np.array_equal(src.batch(5, 2).history["item"][:5], x.history["item"][:5])


# --- --strategy and --metrics-out ------------------------------------------------------------------


@pytest.fixture(scope="module")
def strategies(tmp_path_factory):
    """4 ranks as 2 groups of 2, 3 steps each: row-wise and FlexShard with --metrics-out, every other
    strategy with --verify, and a failing verify run with --metrics-out (keeps the steps it did)."""
    from solvers.planner import STRATEGIES

    root = tmp_path_factory.mktemp("strategies")
    base = ["--groups", "2", "--steps", "3", *SMALL]
    calls = [
        ([*base, "--strategy", "row_wise", "--verify", "--metrics-out", str(root / "rw.jsonl")], None),
        ([*base, "--metrics-out", str(root / "fs.jsonl")], None),
        ([*base, "--verify", "--metrics-out", str(root / "bad.jsonl")], "skew_update"),
    ]
    calls.append(
        ([*base, "--layout", "compact", "--verify", "--checkpoint-dir", str(root / "compact")], None)
    )
    others = [s for s in STRATEGIES if s not in ("row_wise", "flexshard")]
    for s in others:  # table-wise puts a whole table on one rank: it needs the larger budget
        calls.append(([*base, "--strategy", s, "--verify", "--budget", "5"], None))
    results = run_main(4, calls, root / "run", timeout_s=180.0)
    return {"root": root, "results": results, "others": others}


def _records(path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_row_wise_strategy_is_all_cold_and_verifies(strategies):
    calls = _call(strategies["results"], 0)
    assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
    out = calls[0]["out"]
    assert "plan (row_wise): item hot/warm/cold 0/0/50000, creator hot/warm/cold 0/0/5000" in calls[0]["err"]
    assert _verified(out, 3)
    header = _records(strategies["root"] / "rw.jsonl")[0]
    assert header["plan"]["strategy"] == "row_wise" and header["config"]["strategy"] == "row_wise"
    for t in header["plan"]["tables"]:
        assert t["hot_rows"] == t["warm_rows"] == 0 and t["cold_rows"] > 0
    assert header["plan"]["predicted"]["sync_bytes"] == 0.0  # nothing replicated


@pytest.mark.slow
def test_metrics_out_matches_printed_steps(strategies):
    for i, name in ((0, "rw.jsonl"), (1, "fs.jsonl")):
        out = _call(strategies["results"], i)[0]["err"]  # the step lines are log lines
        records = _records(strategies["root"] / name)
        summary = _call(strategies["results"], i)[0]["out"].splitlines()
        assert summary[-5:] == _summary_of(records, world=4, batch=16)  # the summary, from the same figures
        assert [r["kind"] for r in records] == ["header", "step", "step", "step", "end"]
        assert records[0]["world"] == 4 and records[0]["groups"] == [[0, 1], [2, 3]]
        assert set(records[0]["plan"]["predicted"]) >= {"inter_group_bytes", "intra_group_bytes"}
        assert records[-1] == {"kind": "end", "steps": 3, "verify": "OK" if i == 0 else None}
        lines = [ln.split() for ln in out.splitlines() if ln.startswith("step ")]
        for rec, words in zip(records[1:-1], lines, strict=True):
            assert words[1] == f"{rec['step']}/3"
            assert words[3] == f"{rec['loss']:.6f}"
            assert words[7] == f"{rec['bytes']['intra_group']['max']:,.0f}"
            assert words[10] == f"{rec['bytes']['inter_group']['max']:,.0f}"
            assert rec["elapsed_s"] > 0
            for link in ("intra_group", "inter_group"):
                b = rec["bytes"][link]
                assert 0 <= b["mean"] <= b["max"]
                comp = rec["bytes_by_component"][link]
                assert set(comp) == {"ids", "forward", "backward", "sync"}
                assert all(0 <= v["mean"] <= v["max"] for v in comp.values())
                assert sum(v["max"] for v in comp.values()) >= b["max"]  # max(send, recv) per part
        assert not list(strategies["root"].glob(f".{name}.*"))  # no temporary file left
    # the row-wise plan replicates nothing; FlexShard's does, and learns the same losses
    rw, fs = (_records(strategies["root"] / n) for n in ("rw.jsonl", "fs.jsonl"))
    assert all(r["bytes_by_component"]["inter_group"]["sync"]["max"] == 0 for r in rw[1:-1])
    assert any(r["bytes_by_component"]["intra_group"]["sync"]["max"] > 0 for r in fs[1:-1])
    for a, b in zip(rw[1:-1], fs[1:-1], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-5)


@pytest.mark.slow
def test_a_failed_run_keeps_its_steps_and_its_error_in_the_metrics(strategies):
    calls = _call(strategies["results"], 2)
    assert [c["rc"] for c in calls] == [1, 1, 1, 1]
    message = calls[0]["err"].strip().splitlines()[-1]  # after rank 0's log lines
    assert message.startswith("verify: FAILED at step 3: table item's update of the touched rows differs"), (
        message
    )
    assert "tolerance 9.5e-07 = 16 x the fp32 unit roundoff 2^-24" in message
    records = _records(strategies["root"] / "bad.jsonl")  # flushed step by step
    assert [r["kind"] for r in records] == ["header", "step", "step", "step", "end"]
    assert records[-1] == {"kind": "end", "steps": 2, "error": message}  # steps 1-2 passed the check


@pytest.mark.slow
def test_every_runtime_strategy_verifies(strategies):
    for i, name in enumerate(strategies["others"], start=4):
        calls = _call(strategies["results"], i)
        assert [c["rc"] for c in calls] == [0, 0, 0, 0], (name, [c["err"] for c in calls])
        assert f"plan ({name}):" in calls[0]["err"]
        assert _verified(calls[0]["out"], 3)


@pytest.mark.slow
def test_compact_layout_trains_like_the_reference_and_checkpoints(strategies):
    """The compact routing layout (replicated rows listed, cold rows dealt by id) gives the same training
    as the unsharded reference, and its sharded checkpoint holds every row once."""
    calls = _call(strategies["results"], 3)
    assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
    assert "layout compact" in calls[0]["err"]
    assert _verified(calls[0]["out"], 3)
    full = checkpoint.load_full(checkpoint.latest(strategies["root"] / "compact"))
    assert sorted(full.weights) == ["creator", "item"]
    assert full.weights["item"].shape == (50_000, 16)


def test_plan_restricted_to_the_model_tables():
    """A plan made from the whole data set (three tables) is cut to the model's two, in its order."""
    from core.ranks import RankLayout
    from flexshard.plan_file import PlanFile, PlannedTable
    from solvers.types import Plan, TablePlan

    def table(name: str, rows: int) -> TablePlan:
        return TablePlan(name, 1, 0, rows - 1, np.full(2, 0.5), np.full(2, 0.5))

    tables = (table("item_id", 10), table("item_attribute", 5), table("user_id", 7))
    metas = tuple(PlannedTable(t.name, t.hot_rows + t.cold_rows, 16, 4, 4, "fp") for t in tables)
    plan_file = PlanFile(Plan("flexshard", tables, True), RankLayout.consecutive(2, 2), 64, metas, {}, {})
    cut = plan_file.restricted_to(["user_id", "item_id"])
    assert [t.name for t in cut.plan.tables] == ["user_id", "item_id"]
    assert [t.name for t in cut.tables] == ["user_id", "item_id"]
    assert cut.plan.tables[1] is tables[0] and cut.groups == plan_file.groups
    assert cut.left_out == ("item_attribute",) and plan_file.left_out == ()
    assert [t.name for t in plan_file.plan.tables] == ["item_id", "item_attribute", "user_id"]  # unchanged
    assert plan_file.restricted_to(["item_id", "item_attribute", "user_id"]) is plan_file
    assert plan_file.restricted_to(["item_id", "genre"]) is plan_file  # the run's check names the table


def _histories(path: Path, seed: int) -> Path:
    """40 users' histories over 50 items (Zipf-like), the largest ids present so every file has the same
    table sizes; another seed gives other counts, so other hotness orders."""
    rng = np.random.default_rng(seed)
    lines = [" ".join(map(str, [u, *(rng.zipf(1.3, rng.integers(3, 12)) % 50)])) for u in range(40)]
    path.write_text("\n".join([*lines, "39 49 0"]) + "\n")
    return path


@pytest.mark.slow
def test_plan_contract_under_torchrun(tmp_path):
    """A plan used with other data, other dedup or another batch stops every rank, with one line from rank
    0; an explicit --override-plan runs the other dedup and says so."""
    from flexshard.cli import main as cli

    a, b = _histories(tmp_path / "a.txt", 1), _histories(tmp_path / "b.txt", 2)
    plan = tmp_path / "plan.json"
    assert cli(["stats", str(a), "--dim", "16", "--out", str(tmp_path / "a.npz")]) == 0
    make = ["plan", "--workload", str(tmp_path / "a.npz"), "--topology", "h100:1x2", "--batch-size", "16"]
    assert cli([*make, "--out", str(plan)]) == 0
    base = ["--plan", str(plan), "--steps", "2"]
    calls = [
        ([*base, "--data", str(a), "--verify"], None),
        ([*base, "--quiet", "--data", str(b)], None),
        ([*base, "--quiet", "--data", str(a), "--no-dedup"], None),
        ([*base, "--data", str(a), "--no-dedup", "--override-plan", "--verify"], None),
        ([*base, "--quiet", "--data", str(a), "--batch-size", "8"], None),
    ]
    same, other_data, other_dedup, overridden, other_batch = (
        _call(run_main(2, calls, tmp_path / "run"), i) for i in range(5)
    )
    assert [c["rc"] for c in same] == [0, 0], [c["err"] for c in same]
    assert "batch 16 per rank" in same[0]["err"]  # the plan's batch, no --batch-size given (a log line)
    for result, message in (
        (other_data, "table 'item_id': the plan was made from other data (hotness order"),
        (other_dedup, "dedup: the plan was made with dedup on, this run asks for off;"),
        (
            other_batch,
            "batch_size_per_gpu: the plan was made with batch_size_per_gpu 16, this run asks for 8",
        ),
    ):
        assert [c["rc"] for c in result] == [2, 2]  # every rank stops; rank 0 prints the one line
        assert result[0]["err"].startswith(f"flexshard train: error: {message}"), result[0]["err"]
        assert result[0]["err"].count("\n") == 1 and result[1]["err"] == ""
    assert [c["rc"] for c in overridden] == [0, 0], [c["err"] for c in overridden]
    err = overridden[0]["err"]
    assert "dedup off" in err and "override: dedup off (the plan was made with on;" in err
    assert _verified(overridden[0]["out"], 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--steps", "0"], "flexshard train: error: --steps: must be positive, got 0"),
        (
            ["--data", "/nonexistent/h.txt"],
            "flexshard train: error: --data: /nonexistent/h.txt: no such file",
        ),
        (
            ["--groups", "3"],
            "flexshard train: error: --groups: 3 groups do not divide 2 ranks evenly; choose a divisor",
        ),
    ],
)
def test_one_error_line_under_torchrun(tmp_path, flags, line):
    """Under the real launcher, an error every rank meets is printed once (by rank 0) and every worker
    exits 2; torchrun itself exits 1 and summarises the failed workers."""
    import sys

    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "flexshard.train", *flags]  # fmt: skip
    done = run_torchrun(argv, timeout=120, cwd=tmp_path)
    err = done.stderr
    assert done.returncode == 1
    assert err.count("flexshard train: error:") == 1, err
    assert line in err.splitlines()
    assert err.count("exitcode  : 2") == 2  # torchrun's summary: both workers exited 2


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_with_the_rank_and_the_phase(tmp_path):
    """Rank 1 stops answering after its step 1 update; with --timeout 3 every rank ends within seconds
    with exit status 3 and one line naming itself and the phase it waited in (rank 0: the step's figures,
    the next collective), instead of hanging."""
    calls = [(["--steps", "3", "--timeout", "3", "--quiet", *SMALL], "stall_rank_1")]
    results = _call(run_main(2, calls, tmp_path / "run", timeout_s=90.0), 0)
    assert [c["rc"] for c in results] == [3, 3], [c["err"] for c in results]
    first = results[0]["err"].strip()
    assert re.fullmatch(
        r"flexshard train: error: rank 0: a collective failed in step 1: step figures \(Timed out .+\); "
        r"another rank stopped, died, or did not arrive within --timeout 3 s",
        first,
    ), first
    assert results[1]["err"].startswith("flexshard train: error: rank 1: a collective failed in ")
    assert results[0]["s"] < 30  # not the default 600 s


@pytest.mark.slow
def test_a_corrupt_rank_file_on_resume_is_one_line_from_rank_0(tmp_path):
    """Only rank 1 reads its own rank file: the load agrees on its error, so rank 0 prints rank 1's line
    (once, under a launcher), rank 1 stays quiet, and both exit 2. The line names the older checkpoint
    that would load. Two cases: a file of another size (refused by the manifest's record before reading),
    and garbage whose own hash the manifest records (refused by the unpickler, as one line too)."""
    import hashlib
    import json

    a, b = tmp_path / "a", tmp_path / "b"
    first = run_main(2, [([*f, "--steps", "2"], None) for f in _resume_flags(a, b)], tmp_path / "r1")
    assert [c["rc"] for r in first for c in r] == [0, 0, 0, 0]
    (a / "step-00000002" / "rank1.pt").write_bytes(b"garbage" * 50)
    size = json.loads((a / "step-00000002" / "manifest.json").read_text())["files"][1]["bytes"]
    garbage = b"\x80\x02garbage" * 50
    (b / "step-00000002" / "rank1.pt").write_bytes(garbage)
    doc = json.loads((b / "step-00000002" / "manifest.json").read_text())
    doc["files"][1].update(bytes=len(garbage), sha256=hashlib.sha256(garbage).hexdigest())
    (b / "step-00000002" / "manifest.json").write_text(json.dumps(doc))
    second = run_main(
        2, [([*f, "--steps", "3", "--resume"], None) for f in _resume_flags(a, b)], tmp_path / "r2"
    )
    for i, (ckpt, reason) in enumerate(
        [
            (a, f"rank1.pt: 350 bytes, the manifest records {size} (truncated, damaged, or a file of another "
                "checkpoint)"),
            (b, "cannot read rank1.pt (not a FlexShard rank file: UnpicklingError)"),
        ]
    ):  # fmt: skip
        results = _call(second, i)
        assert [c["rc"] for c in results] == [2, 2]
        newest = ckpt / "step-00000002"
        assert results[0]["err"].strip() == (
            f"flexshard train: error: checkpoint '{newest}': {reason}; step-00000001 would load (its "
            "manifest and rank file hashes verify): to resume from it, move the refused one aside (mv "
            f"{newest} {ckpt / 'refused-step-00000002'}) and --resume again"
        )
        assert results[1]["err"] == ""


def _resume_flags(*folders: Path) -> list[list[str]]:
    return [["--checkpoint-dir", str(f), "--checkpoint-every", "1", "--quiet", *SMALL] for f in folders]
