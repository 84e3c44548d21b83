"""Run a function on several local ranks (spawned processes on this host, one process group).

For tests, experiments and examples that need a real multi-process torch.distributed job without a
launcher. Each rank joins a process group over the loopback interface, runs the function, and saves
what it returns. A rank that fails writes its traceback. :func:`run_on_ranks` waits until a
deadline, kills the remaining ranks when one fails or hangs, and raises with the ranks' tracebacks,
so no rank is left running. A rank whose result is saved ends with :func:`end_rank`.

Where the platform has it (Linux), ranks are forked from a *forkserver* that imported torch and this
module once (:data:`PRELOAD`, and whatever :func:`preload` added before the first job), not started as
fresh interpreters that each import them: 4 ranks of a trivial function took 5.8 s from a spawn on 2
cores, most of it each rank's ``import torch`` (1.9 s of CPU). A forked rank gets the caller's
environment of the moment as a spawned one does (the server's own is that of its start).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.osutil import free_port, on_a_free_port
from flexshard.runtime.host_memory import keep_freed_memory

__all__ = [
    "end_rank",
    "free_port",
    "never_started",
    "preload",
    "run_on_ranks",
    "start_ranks",
    "wait_for_ranks",
]

# the modules every rank needs, imported once in the forkserver
PRELOAD = ("torch", "torch.distributed", __name__)
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
_preloaded: list[str] = list(PRELOAD)


def preload(*modules: str) -> None:
    """Import ``modules`` (names) in the forkserver too, so that no rank imports them on its own (e.g. a
    heavy optional package every job of a test session uses). Takes effect only before the first job
    of this process starts the server; later calls change nothing."""
    _preloaded.extend(m for m in modules if m not in _preloaded)


def end_rank() -> NoReturn:
    """End a spawned rank whose results are saved: wait for every rank (barrier), destroy the process
    group, flush stdout and stderr, and leave with ``os._exit(0)``, skipping the interpreter's
    finalization.

    Why: ranks that built a TorchRec DMP model died by SIGABRT after their work, in about one run in
    10-20 under load, printing only "terminate called without an active exception". That message, right
    after the work, fits the interpreter's teardown racing gloo's worker threads (not traced to a
    frame): a worker drops its last reference to a
    finished collective (tensors that Python objects own, e.g. DDP's and TorchRec's buffers) after
    the caller was woken; if the main thread is finalizing by then, the worker's GIL acquire ends
    the thread by a forced unwind through a ``noexcept`` frame, which calls ``std::terminate``
    (upstream: pytorch/pytorch#65231, #190489; an atexit fix, #179291, was abandoned). Nothing of the
    rank's work is skipped: its result is on disk and every rank has passed the barrier."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> Any:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join=False)``: ``nprocs`` processes
    running ``fn(rank, *args)`` (a module-level function), forked from the forkserver where the platform
    has one (module docstring), else spawned; each runs with the caller's environment of the moment.
    Returns the processes' context (:func:`wait_for_ranks` joins it)."""
    if START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(_preloaded)
    return mp.start_processes(
        _in_environment,
        args=(dict(os.environ), fn, args),
        nprocs=nprocs,
        join=False,
        start_method=START_METHOD,
    )


def _in_environment(rank: int, environ: dict[str, str], fn: Callable[..., None], args: tuple) -> None:
    if os.environ != environ:  # a forked process: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(environ)
    fn(rank, *args)


def _rank_main(
    rank: int, world: int, port: int, backend: str, outdir: str, fn: Callable[..., Any], args: tuple
) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.set_num_threads(1)
        if backend == "gloo":
            keep_freed_memory()
        torch.save(fn(rank, world, *args), Path(outdir) / f"rank{rank}.pt")
        end_rank()
    except BaseException:
        (Path(outdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_on_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    label: str | None = None,
) -> list[Any]:
    """Start ``world`` ranks that each run ``fn(rank, world, *args)`` (a module-level function) inside
    an initialised process group (``backend``, one thread per rank), and return what they returned, in
    rank order. Raises ``RuntimeError`` with every failed rank's traceback when a rank fails, or after
    ``timeout_s`` seconds when one hangs; the remaining ranks are killed either way. A job that never
    started (:func:`never_started`: its rendezvous port was taken, or gloo's mesh failed to form) is
    started again on another port, up to ``RENDEZVOUS_TRIES`` times."""
    label = label or getattr(fn, "__name__", "ranks")

    def once(port: int) -> list[Any]:
        with tempfile.TemporaryDirectory(prefix="flexshard-ranks-") as outdir:
            ctx = start_ranks(_rank_main, (world, port, backend, outdir, fn, args), world)
            wait_for_ranks(ctx, timeout_s, outdir, label)
            return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]

    return on_a_free_port(once, lambda err: isinstance(err, RuntimeError) and never_started(str(err)))


def never_started(errors: str) -> bool:
    """Whether the ranks' tracebacks say that the job never started and may be started again on another
    port: rank 0's rendezvous could not listen on its port (another process bound it between
    :func:`free_port` and the listen), or gloo's mesh of connections between the ranks failed while
    ``init_process_group`` formed it (``connectFullMesh``: a peer's connection closed on loopback, a
    known gloo start-up flake; no collective had run)."""
    if "init_process_group" not in errors:
        return False
    return "EADDRINUSE" in errors or "connectFullMesh" in errors


def wait_for_ranks(ctx: Any, timeout_s: float, outdir: str | Path, label: str) -> None:
    """Join the processes of ``ctx`` (from ``torch.multiprocessing.start_processes(join=False)``)
    until ``timeout_s`` seconds have passed. When one fails or the time is up, kill the rest and raise
    ``RuntimeError`` with the text of every ``*.err`` file in ``outdir`` (the ranks' tracebacks)."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout_s:g} s")
    except Exception as exc:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        errs = [f"{f.name}:\n{f.read_text()}" for f in sorted(Path(outdir).glob("*.err"))]
        raise RuntimeError("\n".join(errs) or f"{label}: {exc}") from None
