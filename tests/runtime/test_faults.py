"""Faults under the real launcher (issue 13). A worker killed with SIGKILL under ``torchrun --max-restarts 1
... --resume`` (mid-step, inside an all-to-all, or halfway through writing a checkpoint), or stopped with
SIGSTOP past ``--timeout``, is restarted with the others; the run resumes from its last complete
checkpoint and ends with the final state of an uninterrupted run, bit for bit (static and c10d
rendezvous). A killed agent takes its workers with it, and a new launch with ``--resume`` finishes the
run the same way. The deterministic faults are installed by ``fault_entry.py``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.osutil import process_alive
from flexshard import checkpoint
from flexshard.runtime.local import free_port

pytestmark = pytest.mark.slow  # real torchrun jobs

STEPS = 60  # the kill lands between step 10 and the end, with time to spare


FAULT_ENTRY = str(Path(__file__).with_name("fault_entry.py"))


def _launch(
    ckpt: Path,
    rendezvous: str = "static",
    fault: tuple[str, int] | None = None,
    restarts: int = 1,
    timeout_s: float = 20,
) -> subprocess.Popen:
    """``torchrun`` with 2 workers training STEPS steps (checkpoint every 5, ``--resume``), under
    ``fault_entry.py`` when ``fault`` is ``(name, step)``."""
    port = str(free_port())
    rdzv = (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "1"]
        if rendezvous == "c10d"
        else ["--master-port", port]
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--max-restarts", str(restarts)]
    entry = [FAULT_ENTRY, fault[0], str(fault[1])] if fault else ["-m", "flexshard.train"]
    train = [*entry, "--steps", str(STEPS), "--batch-size", "16"]  # info: the resume lines (stderr)
    resume = [
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "5",
        "--resume",
        "--timeout",
        str(timeout_s),
    ]
    argv = [*launcher, *rdzv, *train, *resume]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _workers(agent: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _final_state(ckpt: Path):
    return checkpoint.load_full(checkpoint.step_dir(ckpt, STEPS))


def _wait_for_checkpoint(ckpt: Path, step: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not checkpoint.step_dir(ckpt, step).is_dir():
        assert time.monotonic() < deadline, f"no checkpoint of step {step} after {timeout_s} s"
        time.sleep(0.05)


def _assert_same_state(got, expected) -> None:
    for name, w in expected.weights.items():
        assert torch.equal(got.weights[name], w) and got.states[name].keys() == expected.states[name].keys()
        assert all(torch.equal(got.states[name][k], s) for k, s in expected.states[name].items())
    for key, value in expected.dense.items():
        assert torch.equal(got.dense[key], value)


def _resumed_steps(err: str, ckpt: Path) -> list[int]:
    """The steps the run resumed from, from its ``resume: <dir>/step-N (step N)`` log lines (stderr)."""
    return [
        int(line.rsplit("(step ", 1)[1].split(")")[0])
        for line in err.splitlines()
        if line.startswith(f"resume: {ckpt}/")
    ]


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
    _wait_for_checkpoint(ckpt, 10)
    workers = _workers(job.pid)
    assert workers, "no worker processes under the agent"
    os.kill(workers[-1], signal.SIGKILL)
    out, err = job.communicate(timeout=180)  # a hang fails here instead of blocking the suite
    assert job.returncode == 0, err
    assert _resumed_steps(err, ckpt), err  # the restart resumed
    _assert_same_state(_final_state(ckpt), uninterrupted)


@pytest.mark.parametrize(
    ("fault", "resumed"),
    [
        (("killed_inside_all_to_all", 12), 10),  # killed in step 13's first all-to-all
        (("peer_inside_all_to_all", 12), 10),  # rank 0 inside it when rank 1 is killed
        (("mid_checkpoint", 15), 10),  # the half-written step 15 is not a checkpoint
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) else str(v),
)
def test_a_worker_killed_inside_a_collective_or_a_checkpoint_write_is_recovered(
    tmp_path, uninterrupted, fault, resumed
):
    ckpt = tmp_path / "ckpt"
    job = _launch(ckpt, fault=fault)
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err
    assert _resumed_steps(err, ckpt) == [resumed], err  # the restart's; the first attempt found none
    assert "failed (exitcode: -9) local_rank: 1" in err, err  # the agent saw the kill and restarted both
    assert not list(ckpt.glob(".tmp-*")), list(ckpt.iterdir())  # the interrupted write was cleared
    _assert_same_state(_final_state(ckpt), uninterrupted)


def test_a_stopped_worker_times_out_and_the_restarted_run_ends_as_an_uninterrupted_one(
    tmp_path, uninterrupted
):
    """SIGSTOP, not a sleep: rank 0 waits --timeout (5 s), ends with one line naming itself and the phase,
    and the agent stops the frozen worker and restarts both."""
    ckpt = tmp_path / "ckpt"
    job = _launch(ckpt, timeout_s=5)
    _wait_for_checkpoint(ckpt, 10)
    workers = _workers(job.pid)
    os.kill(workers[-1], signal.SIGSTOP)
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err
    assert re.search(
        r"flexshard train: error: rank 0: a collective failed in step \d+: [a-z ]+ \(.+\); another rank "
        r"stopped, died, or did not arrive within --timeout 5 s",
        err,
    ), err
    assert len(_resumed_steps(err, ckpt)) == 1, err
    _assert_same_state(_final_state(ckpt), uninterrupted)


def test_a_killed_agent_takes_its_workers_and_a_new_launch_resumes(tmp_path, uninterrupted):
    """torchrun starts workers in sessions of their own: without ``end_with_agent`` they went on training
    as orphans after the agent was killed (and would have shared the folder with a relaunched job)."""
    ckpt = tmp_path / "ckpt"
    job = _launch(ckpt, restarts=0)
    _wait_for_checkpoint(ckpt, 10)
    workers = _workers(job.pid)
    assert len(workers) == 2
    job.kill()
    job.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "workers outlived their agent"
        time.sleep(0.05)
    assert not checkpoint.step_dir(ckpt, STEPS).exists()  # they stopped before the end
    again = _launch(ckpt, restarts=0)
    out, err = again.communicate(timeout=180)
    assert again.returncode == 0, err
    assert _resumed_steps(err, ckpt)[0] >= 10, err
    _assert_same_state(_final_state(ckpt), uninterrupted)
