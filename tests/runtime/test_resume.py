"""Safe resume (one process, no launcher): a checkpoint records its run's identity; --resume refuses
another run's checkpoint with one line; a fresh run refuses a folder that holds another run's checkpoints
unless --overwrite (which removes them); --keep prunes all but the newest; the checkpoint folder is
checked before any work."""

from __future__ import annotations

import json

import pytest

from flexshard import checkpoint
from flexshard.train import main

SMALL = ["--batch-size", "8", "--quiet", "--dim", "8"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _train(ckpt, *flags: str) -> int:
    return main(["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", *SMALL, *flags])


def test_the_manifest_records_the_run_and_resume_refuses_another(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "2", "--seed", "0") == 0
    run = json.loads((checkpoint.latest(ckpt) / "manifest.json").read_text())["run"]
    assert run["seed"] == "0" and run["optimizer"] == "rowwise_adagrad, lr 0.05, eps 1e-08"
    assert set(run) == {"world", "plan", "data", "seed", "optimizer", "model", "batch", "exchange"}
    capsys.readouterr()
    assert _train(ckpt, "--steps", "4", "--seed", "1", "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"flexshard train: error: --resume: {ckpt / 'step-00000002'} was saved by another run (seed: '0' "
        "there, '1' here); resume with that run's settings, or start this run in another --checkpoint-dir "
        "(or over this one with --overwrite)"
    )
    assert _train(ckpt, "--steps", "4", "--lr", "0.1", "--resume") == 2
    assert (
        "(optimizer: 'rowwise_adagrad, lr 0.05, eps 1e-08' there, 'rowwise_adagrad, lr 0.1, eps 1e-08' here)"
        in (capsys.readouterr().err)
    )
    assert checkpoint.latest(ckpt).name == "step-00000002"  # nothing was written by the refused runs
    loud = ["--checkpoint-dir", str(ckpt), "--batch-size", "8", "--dim", "8", "--steps", "3", "--resume"]
    assert main(loud) == 0  # the same run continues (not --quiet: its resume line is a log line)
    out, err = capsys.readouterr()
    assert f"resume: {ckpt / 'step-00000002'} (step 2)" in err.splitlines()
    assert out.startswith("summary: 1 steps (steps 3-3), final loss ")
    assert checkpoint.latest(ckpt).name == "step-00000003"


def test_a_fresh_run_refuses_another_runs_folder_unless_overwrite(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "3") == 0
    capsys.readouterr()
    assert _train(ckpt, "--steps", "1", "--seed", "5") == 2
    assert capsys.readouterr().err.strip() == (
        f"flexshard train: error: --checkpoint-dir: {ckpt} holds 3 checkpoint(s) of another run (latest "
        "step-00000003); --resume to continue it, --overwrite to replace it, or another folder"
    )
    assert _train(ckpt, "--steps", "1", "--seed", "5", "--overwrite") == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001"]  # the old run's steps are gone
    manifest = json.loads((ckpt / "step-00000001" / "manifest.json").read_text())
    assert manifest["run"]["seed"] == "5"


def test_keep_prunes_all_but_the_newest(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "4", "--keep", "2") == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003", "step-00000004"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--keep", "-1"], "--keep: must be >= 0, got -1"),
        (["--resume", "--overwrite"], "--resume and --overwrite are exclusive"),
    ],
)
def test_bad_checkpoint_flags(tmp_path, capsys, flags, message):
    assert _train(tmp_path / "c", "--steps", "1", *flags) == 2
    assert message in capsys.readouterr().err


def test_an_unusable_checkpoint_folder_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["--checkpoint-dir", str(blocker / "ckpt"), "--steps", "1", *SMALL]) == 2
    err = capsys.readouterr()
    assert err.err.startswith(f"flexshard train: error: --checkpoint-dir: cannot create {blocker / 'ckpt'}")
    assert "step 1/" not in err.out
