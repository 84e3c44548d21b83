"""Faults under the real launcher (issue 13): a worker killed with SIGKILL mid-run under ``torchrun
--max-restarts 1 ... --resume`` is restarted, the run resumes from its last checkpoint and ends with the
final state of an uninterrupted run, bit for bit, with the static and the c10d rendezvous."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexshard import checkpoint
from flexshard.runtime.local import free_port

pytestmark = pytest.mark.slow  # real torchrun jobs

STEPS = 60  # the kill lands between step 10 and the end, with time to spare


def _launch(ckpt: Path, rendezvous: str) -> subprocess.Popen:
    port = str(free_port())
    rdzv = (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "1"]
        if rendezvous == "c10d"
        else ["--master-port", port]
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    train = ["-m", "flexshard.train", "--steps", str(STEPS), "--batch-size", "16", "--quiet"]
    resume = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--resume", "--timeout", "20"]
    argv = [*launcher, *rdzv, *train, *resume]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _workers(agent: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _final_state(ckpt: Path):
    return checkpoint.load_full(checkpoint.step_dir(ckpt, STEPS))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("straight") / "ckpt"
    job = _launch(ckpt, "static")
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err
    return _final_state(ckpt)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_killed_worker_is_restarted_and_the_run_ends_as_an_uninterrupted_one(
    tmp_path, uninterrupted, rendezvous
):
    ckpt = tmp_path / "ckpt"
    job = _launch(ckpt, rendezvous)
    deadline = time.monotonic() + 120
    while not checkpoint.step_dir(ckpt, 10).is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _workers(job.pid)
    assert workers, "no worker processes under the agent"
    os.kill(workers[-1], signal.SIGKILL)
    out, err = job.communicate(timeout=180)  # a hang fails here instead of blocking the suite
    assert job.returncode == 0, err
    assert any(line.startswith(f"resume: {ckpt}") for line in out.splitlines()), out  # the restart resumed
    got = _final_state(ckpt)
    for name, w in uninterrupted.weights.items():
        assert torch.equal(got.weights[name], w) and torch.equal(got.state[name], uninterrupted.state[name])
    for key, value in uninterrupted.dense.items():
        assert torch.equal(got.dense[key], value)
