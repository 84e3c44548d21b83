"""Spawned ranks for the ``flexshard.train`` tests: each rank sets the launcher's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and calls ``flexshard.train.main(argv)`` once per
call, capturing its stdout / stderr; every call gets a fresh port, so each is a new process group."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from flexshard.runtime.local import free_port, wait_for_ranks

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _corrupt_reference() -> contextlib.AbstractContextManager:
    """Perturb one hot row of the reference's ``item`` table after its second step (a deliberately
    wrong reference: verify must fail on every rank)."""
    from flexshard.training import reference as train

    original = train.Reference.step
    calls = {"n": 0}

    def step(self, batches):
        out = original(self, batches)
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                self.weights["item"][0] += 0.01
        return out

    @contextlib.contextmanager
    def patched():
        train.Reference.step = step
        try:
            yield
        finally:
            train.Reference.step = original

    return patched()


PATCHES = {None: contextlib.nullcontext, "corrupt_reference": _corrupt_reference}


def _worker(rank: int, world: int, calls: list, ports: list[int], outdir: str) -> None:
    from flexshard.train import main

    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}
    )
    results = []
    try:
        for (argv, patch), port in zip(calls, ports, strict=True):
            os.environ["MASTER_PORT"] = str(port)
            out, err = io.StringIO(), io.StringIO()
            t0 = time.monotonic()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), PATCHES[patch]():
                rc = main(argv)
            results.append(
                {
                    "argv": argv,
                    "rc": rc,
                    "out": out.getvalue(),
                    "err": err.getvalue(),
                    "s": time.monotonic() - t0,
                }
            )
        (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        (Path(outdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_main(world: int, calls: list[tuple[list[str], str | None]], outdir: Path, timeout_s: float = 60.0):
    """Run ``main(argv)`` on ``world`` spawned ranks for each ``(argv, patch)``; per rank a list of
    ``{"rc", "out", "err"}``. A hang or a crash fails with the ranks' tracebacks."""
    outdir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in calls]
    # forkserver: torch and flexshard are imported once (in the server), not once per rank and run
    multiprocessing.set_forkserver_preload(["torch", "flexshard.train", "train_workers"])
    ctx = mp.start_processes(
        _worker, args=(world, calls, ports, str(outdir)), nprocs=world, join=False, start_method="forkserver"
    )
    wait_for_ranks(ctx, timeout_s, outdir, "train")
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)]
