"""Ctrl-C during training (issue 22, Deliver 6): one line, exit 130, with the step and the last checkpoint.

Real processes get a real SIGINT once a checkpoint is on disk: a single process; two ranks started by
hand in one process group (the group gets the signal, as from a terminal), each of whose exit status
is checked; and two workers under torchrun, whose own agent prints its ``SignalException`` traceback
and exits 1 (torchrun's, not ours: the workers' part is one line).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.osutil import free_port
from flexshard.training.interrupt import interrupted_line

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["-m", "flexshard.train", "--steps", "100000", "--batch-size", "16", "--quiet"]
LINE = re.compile(
    r"flexshard train: interrupted at step (\d+); last checkpoint: step (\d+); resume with --resume"
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _wait_for_checkpoint(ckpt: Path, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Until a complete checkpoint is in ``ckpt`` (and a little longer, so a step is under way)."""
    deadline = time.monotonic() + timeout_s
    while not any((p / "manifest.json").is_file() for p in ckpt.glob("step-*")):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.2)
    time.sleep(0.5)


def _saved_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / "manifest.json").is_file())


def test_the_line_names_the_step_and_the_newest_complete_checkpoint(tmp_path):
    assert (
        interrupted_line(7, None)
        == "flexshard train: interrupted at step 7; no checkpoint (no --checkpoint-dir)"
    )
    assert interrupted_line(0, str(tmp_path)) == (
        f"flexshard train: interrupted before the first step; no checkpoint in {tmp_path}"
    )
    for step in (3, 12):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "manifest.json").write_text("{}")
    (tmp_path / "step-00000015").mkdir()  # no manifest: incomplete, not a checkpoint
    assert interrupted_line(14, str(tmp_path)) == (
        "flexshard train: interrupted at step 14; last checkpoint: step 12; resume with --resume"
    )


def test_ctrl_c_of_one_process_is_one_line_and_exit_130(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, *TRAIN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
         "--metrics-out", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    _wait_for_checkpoint(ckpt, [proc])
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # --quiet: no log lines, and no traceback
    m = LINE.fullmatch(lines[0])
    assert m, lines[0]
    step, saved = int(m.group(1)), int(m.group(2))
    assert saved == _saved_steps(ckpt)[-1] and saved <= step
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    end = records[-1]
    assert (end["kind"], end["error"]) == ("end", "interrupted")
    assert end["steps"] in (step - 1, step)  # steps done: all but the one under way (or it, just done)
    assert len(steps) in (step - 1, step)


@pytest.mark.slow
def test_ctrl_c_of_two_ranks_is_one_line_from_rank_0_and_exit_130_everywhere(tmp_path):
    """Two ranks in one new process group (as a terminal's job), SIGINT to the group: rank 0 prints the
    line, rank 1 prints nothing, both exit 130."""
    ckpt, port = tmp_path / "ckpt", str(free_port())
    procs = []
    for rank in range(2):
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, *TRAIN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tmp_path,
                process_group=procs[0].pid if procs else 0,  # rank 1 joins rank 0's new group
            )  # fmt: skip
        )
    _wait_for_checkpoint(ckpt, procs)
    os.killpg(procs[0].pid, signal.SIGINT)
    outputs = [p.communicate(timeout=60) for p in procs]
    results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
    assert [r[0] for r in results] == [130, 130], [r[2] for r in results]
    lines = results[0][2].strip().splitlines()
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), results[0][2]
    assert int(LINE.fullmatch(lines[0]).group(2)) == _saved_steps(ckpt)[-1]
    assert results[1][2].strip() == ""


@pytest.mark.slow
def test_ctrl_c_under_torchrun_leaves_one_line_from_the_workers(tmp_path):
    """SIGINT to torchrun's process group (a terminal's Ctrl-C): the workers' part of stderr is the one
    line; torchrun itself logs that it forwards the signal, prints its SignalException traceback and
    exits 1 (its own behaviour; the workers' 130 is not passed on)."""
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *TRAIN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
        process_group=0,
    )  # fmt: skip
    _wait_for_checkpoint(ckpt, [proc])
    os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    ours = [ln for ln in err.splitlines() if ln.startswith("flexshard train")]
    assert len(ours) == 1 and LINE.fullmatch(ours[0]), err
    assert int(LINE.fullmatch(ours[0]).group(2)) == _saved_steps(ckpt)[-1]
    assert "KeyboardInterrupt" not in err and "[rank" not in err  # no worker traceback
    assert "SignalException" in err  # torchrun's own


def test_a_ctrl_c_inside_a_checkpoint_write_stays_a_ctrl_c(tmp_path, monkeypatch):
    """torch.save's zip writer turned a KeyboardInterrupt raised in our hashing writer into its own
    RuntimeError ('unexpected pos'), so about one Ctrl-C in three during a save lost the run's end
    record: the interrupt comes out as itself, and no rank file is left."""
    import torch

    from flexshard import checkpoint
    from flexshard.checkpoint_manifest import HashingWriter

    calls = {"n": 0}
    write = HashingWriter.write

    def interrupted(self, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return write(self, data)

    monkeypatch.setattr(HashingWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._atomic_torch_save({"rows": torch.zeros(1000, 8)}, tmp_path / "rank0.pt")
    assert calls["n"] >= 3 and not (tmp_path / "rank0.pt").exists()
