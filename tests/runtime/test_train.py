"""``flexshard.train``: multi-process training with ``--verify`` against the unsharded reference, a
deliberately wrong reference, sharded checkpoint / resume, a real-data run, and argument errors.

Ranks are spawned gloo processes that call ``main(argv)`` with the launcher's environment set (as
torchrun would); see ``train_workers.py``."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from train_workers import run_main

from flexshard import checkpoint
from flexshard.train import main
from flexshard.workloads import data_root

BEAUTY = data_root() / "amazon-yelp-sequences" / "Beauty.txt"
SMALL = ["--batch-size", "16"]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """4 ranks as 2 groups of 2: verify runs, a corrupted reference, and checkpoints A (6 steps
    straight) and B (3 steps); then, in new processes, B resumed to 6 steps with --verify."""
    root = tmp_path_factory.mktemp("train4")
    a, b = root / "ckpt_a", root / "ckpt_b"
    calls = [
        (["--groups", "2", "--steps", "5", "--verify", *SMALL], None),
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
                *SMALL,
            ],
            None,
        ),  # fmt: skip
        (["--groups", "2", "--steps", "5", "--verify", *SMALL], "corrupt_reference"),
        (
            ["--groups", "2", "--steps", "6", "--checkpoint-dir", str(a), "--checkpoint-every", "3", *SMALL],
            None,
        ),
        (
            ["--groups", "2", "--steps", "3", "--checkpoint-dir", str(b), "--checkpoint-every", "3", *SMALL],
            None,
        ),
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
                *SMALL,
            ],
            None,
        ),  # fmt: skip
    ]
    second = run_main(4, resume, root / "run2")
    return {"root": root, "a": a, "b": b, "first": first, "second": second}


def _call(results, i):
    return [rank_results[i] for rank_results in results]


def test_verify_passes_on_every_rank(four):
    for i in (0, 1):
        calls = _call(four["first"], i)
        assert [c["rc"] for c in calls] == [0, 0, 0, 0], [c["err"] for c in calls]
        steps = 5 if i == 0 else 3
        assert calls[0]["out"].rstrip().splitlines()[-1] == (
            f"verify: OK ({steps} steps, all rows of all copies match)"
        )
        lines = calls[0]["out"].splitlines()
        assert "world 4 (2 groups of 2)" in lines[0]
        step_lines = [ln for ln in lines if ln.startswith("step ")]
        assert len(step_lines) == steps
        assert all("loss" in ln and "samples/s" in ln and "intra_group" in ln for ln in step_lines)
        # two groups and a plan with warm and cold rows: traffic on both link classes
        assert "inter_group 0 B" not in step_lines[0] and "intra_group 0 B" not in step_lines[0]
        assert all(c["out"] == "" for c in calls[1:])  # only rank 0 logs


def test_corrupted_reference_fails_on_every_rank(four):
    calls = _call(four["first"], 2)
    assert [c["rc"] for c in calls] == [1, 1, 1, 1]
    messages = {c["err"].strip() for c in calls}
    assert len(messages) == 1  # every rank reports the same first mismatch
    message = messages.pop()
    assert message.startswith("verify: FAILED at step 3:") and "differ from the reference" in message
    assert "verify: OK" not in calls[0]["out"]


def test_checkpoint_resume_equals_straight_training(four):
    a, b = four["a"], four["b"]
    resumed = _call(four["second"], 0)
    assert [c["rc"] for c in resumed] == [0, 0, 0, 0], [c["err"] for c in resumed]
    assert "resume:" in resumed[0]["out"] and "(step 3)" in resumed[0]["out"]
    assert [ln for ln in resumed[0]["out"].splitlines() if ln.startswith("step ")][0].startswith("step 4/6")
    assert resumed[0]["out"].rstrip().endswith("verify: OK (3 steps, all rows of all copies match)")
    assert checkpoint.latest(a).name == checkpoint.latest(b).name == "step-00000006"
    for step in (3, 6):
        x = checkpoint.load_full(checkpoint.step_dir(a, step))  # every row saved exactly once (checked)
        y = checkpoint.load_full(checkpoint.step_dir(b, step))
        assert x.step == y.step == step
        for name in x.weights:
            torch.testing.assert_close(x.weights[name], y.weights[name], rtol=0, atol=1e-6)
            torch.testing.assert_close(x.state[name], y.state[name], rtol=0, atol=1e-6)
        assert x.state["item"].abs().sum() > 0  # adagrad state is saved
        for key in x.dense:
            torch.testing.assert_close(x.dense[key], y.dense[key], rtol=0, atol=1e-6)
        assert x.dense_optimizer is not None and x.dense_optimizer["kind"] == "adagrad"
        assert any(s.abs().sum() > 0 for s in x.dense_optimizer["sums"])
    # training moved the rows between the two checkpoints
    w3 = checkpoint.load_full(checkpoint.step_dir(a, 3)).weights["item"]
    w6 = checkpoint.load_full(checkpoint.step_dir(a, 6)).weights["item"]
    assert not torch.equal(w3, w6)


def test_checkpoint_files_hold_each_row_once(four):
    ckpt = checkpoint.step_dir(four["a"], 6)
    manifest = checkpoint.read_manifest(ckpt)
    assert manifest["world_size"] == 4 and manifest["groups"] == [[0, 1], [2, 3]]
    tiers = {}
    for r in range(4):
        payload = torch.load(ckpt / f"rank{r}.pt", weights_only=True)
        tiers[r] = {tier for table in payload["rows"].values() for tier in table}
        assert ("dense" in payload) == (r == 0)
    assert tiers[0] == {"hot", "warm", "cold"}
    assert tiers[1] == {"warm", "cold"}  # group 0: warm shard, no hot rows
    assert tiers[2] == tiers[3] == {"cold"}  # group 1: cold rows only


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
    with pytest.raises(checkpoint.CheckpointError, match="cannot read rank3.pt"):
        checkpoint.load_full(broken)


def test_two_ranks_real_data_and_world_size_mismatch(four, tmp_path):
    calls = [
        (["--steps", "8", "--checkpoint-dir", str(four["a"]), "--resume", *SMALL], None),
    ]
    if BEAUTY.is_file():
        real = ["--data", str(BEAUTY), "--groups", "2", "--steps", "3", "--verify", "--batch-size", "256"]
        calls.append((real, None))
    results = run_main(2, calls, tmp_path / "run")
    mismatch = _call(results, 0)
    assert [c["rc"] for c in mismatch] == [2, 2]
    for c in mismatch:
        assert "flexshard train: error: checkpoint" in c["err"]
        assert "was saved by 4 ranks, this job has 2" in c["err"]
    if not BEAUTY.is_file():
        pytest.skip(f"real data absent: {BEAUTY} (set FLEXSHARD_DATA); the world-size check ran")
    real = _call(results, 1)
    assert [c["rc"] for c in real] == [0, 0], [c["err"] for c in real]
    assert "Beauty.txt (item_id 12,102 x 16, user_id 22,364 x 16)" in real[0]["out"]
    assert "world 2 (2 groups of 1)" in real[0]["out"]
    assert "item_id hot/warm/cold 0/" not in real[0]["out"]  # the plan replicates the hottest items
    assert real[0]["out"].rstrip().endswith("verify: OK (3 steps, all rows of all copies match)")


def test_single_process_without_launcher(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--steps", "2", "--verify", "--quiet", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "world 1 (1 groups of 1)" in out
    assert out.rstrip().endswith("verify: OK (2 steps, all rows of all copies match)")
    assert not torch.distributed.is_initialized()


def test_plan_file_option(monkeypatch, capsys, tmp_path):
    """--plan: a plan file for this job's tables and world size trains and verifies; one for another
    world size is refused with the module's message."""
    from flexshard.plan_file import to_dict, write_plan
    from flexshard.train import SyntheticSource
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
    assert "plan is for world size 4, this job has 1 ranks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps: must be positive"),
        (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir"),
        (["--groups", "3"], "3 groups do not divide world size 1"),
        (["--data", "/nonexistent/x.txt"], "--data: /nonexistent/x.txt: no such file"),
    ],
)
def test_bad_arguments(monkeypatch, capsys, argv, message):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexshard train: error:") and message in err


def test_synthetic_batches_are_deterministic():
    from flexshard.train import SyntheticSource

    src = SyntheticSource(16, 20, 4, 8, seed=3)
    x, y = src.batch(5, 1), src.batch(5, 1)
    assert np.array_equal(x.lengths, y.lengths) and np.array_equal(x.history["item"], y.history["item"])
    assert x.candidates["item"].shape == (8, 5)
    assert np.array_equal(x.history["creator"], x.history["item"] // 10)
    assert not np.array_equal(src.batch(5, 2).history["item"][:5], x.history["item"][:5])
