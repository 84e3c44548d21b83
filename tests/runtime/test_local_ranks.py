"""run_on_ranks: results come back in rank order and the ranks leave without the interpreter's teardown
(end_rank: no atexit handler runs); ranks forked from one server run in the caller's environment; a
failing or hanging rank ends every rank with its traceback, within the deadline; a job whose rendezvous
port was taken starts again on another."""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flexshard.runtime.local import START_METHOD, run_on_ranks

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks


def _sum_of_ranks(rank: int, world: int, offset: int, folder: str) -> tuple[int, int]:
    atexit.register((Path(folder) / f"teardown{rank}").touch)  # runs only if the interpreter finalizes
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, int(t)


def _rank1_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 cannot go on")
    dist.barrier()  # rank 0 would wait here forever


def _rank1_hangs(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def _environment(rank: int, world: int) -> tuple[str | None, str | None, int]:
    return os.environ.get("FLEXSHARD_TEST_SET"), os.environ.get("FLEXSHARD_TEST_UNSET"), os.getppid()


def test_ranks_run_in_the_callers_environment_of_the_moment(monkeypatch):
    # each job's ranks see the caller's environment at its start (the second's: one variable set, the
    # other gone), not that of the server that forks them (started by this job or an earlier test's)
    monkeypatch.setenv("FLEXSHARD_TEST_UNSET", "at the start")
    before = run_on_ranks(_environment, 2)
    assert [r[:2] for r in before] == [(None, "at the start")] * 2
    monkeypatch.setenv("FLEXSHARD_TEST_SET", "now")
    monkeypatch.delenv("FLEXSHARD_TEST_UNSET")
    after = run_on_ranks(_environment, 2)
    assert [r[:2] for r in after] == [("now", None)] * 2
    if START_METHOD == "forkserver":  # forked by one server that outlives the jobs, not by this process
        assert len({r[2] for r in before + after}) == 1 and after[0][2] != os.getpid()


def test_results_in_rank_order_and_no_interpreter_teardown(tmp_path):
    assert run_on_ranks(_sum_of_ranks, 3, 10, str(tmp_path)) == [(0, 33), (1, 33), (2, 33)]
    assert list(tmp_path.iterdir()) == []  # os._exit after the barrier: gloo's teardown race avoided


def test_a_failing_rank_ends_every_rank_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 cannot go on") as info:
        run_on_ranks(_rank1_fails, 2, timeout_s=60.0)
    assert "rank1.err" in str(info.value) and time.monotonic() - start < 50


def test_a_hanging_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="^hang: ranks did not finish within 3 s$"):
        run_on_ranks(_rank1_hangs, 2, timeout_s=3.0, label="hang")
    assert time.monotonic() - start < 30


def test_a_job_whose_port_another_process_holds_starts_again_on_another(monkeypatch, tmp_path):
    import socket

    from core import osutil
    from core.osutil import free_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:  # another job listening on it
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        handed = []

        def ports() -> int:
            handed.append(taken if not handed else free_port())
            return handed[-1]

        monkeypatch.setattr(osutil, "free_port", ports)  # what on_a_free_port calls
        assert run_on_ranks(_sum_of_ranks, 2, 1, str(tmp_path)) == [(0, 3), (1, 3)]
    assert len(handed) == 2 and handed[0] == taken  # the first try failed to listen, the second ran


def test_only_a_job_that_never_started_is_started_again():
    from flexshard.runtime.local import never_started

    assert never_started("rank0.err:\n  dist.init_process_group(...)\nDistNetworkError: ... EADDRINUSE ...")
    assert not never_started("rank1.err:\nValueError: rank 1 cannot go on")  # the job's own error
    assert not never_started("rank0.err:\n  in my_fn\nOSError: EADDRINUSE")  # the job's own bind, after init
    mesh = "RuntimeError: Gloo connectFullMesh failed with [...] Connection closed by peer [127.0.0.1]:5352"
    assert never_started(f"rank0.err:\n  dist.init_process_group(...)\n{mesh}")  # gloo's start-up flake
    mid_run = "rank0.err:\n  in all_to_all\nRuntimeError: Connection closed by peer"
    assert not never_started(mid_run)  # a peer lost after the start: the job's own failure
