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


def _patched_step(after) -> contextlib.AbstractContextManager:
    """Run ``after(module, n)`` after every ``ShardedSequenceEmbedding.step`` (``n``: steps so far)."""
    from flexshard.runtime import ShardedSequenceEmbedding

    original = ShardedSequenceEmbedding.step
    calls = {"n": 0}

    def step(self):
        original(self)
        calls["n"] += 1
        after(self, calls["n"])

    @contextlib.contextmanager
    def patched():
        ShardedSequenceEmbedding.step = step
        try:
            yield
        finally:
            ShardedSequenceEmbedding.step = original

    return patched()


def _diverge_replica(module, n: int) -> None:
    """After step 2, rank 1's copy of the hottest ``item`` row moves by 1e-3: replicas no longer equal."""
    from core.vocabulary import Tier

    if n == 2 and module.rank == 1:
        with torch.no_grad():
            module.shards[(module.table_names.index("item"), Tier.HOT)].weights[0] += 1e-3


def _skew_update(module, n: int) -> None:
    """From step 3, every rank's rows move 10% further than the optimizer says (the same on every copy):
    a wrong optimizer, which only the comparison with the reference can find."""
    if n == 2:
        module.lr *= 1.1


def _skip_an_iteration(module, n: int) -> None:
    """After step 2 the module's iteration count runs one ahead (Adam's bias correction of step 3 uses
    t = 4): only the comparison with the reference, which counts the training steps, can find it."""
    if n == 2:
        module.optimizer_step += 1


def _stall_rank_1(module, n: int) -> None:
    """After step 1, rank 1 stops answering for 8 s (as a rank stopped by SIGSTOP, or a slow host)."""
    if n == 1 and module.rank == 1:
        time.sleep(8.0)


@contextlib.contextmanager
def _dump_resharded_load():
    """After ``checkpoint_reshard.load_resharded``, each rank saves what its module and dense model hold to
    ``<checkpoint-dir>-loaded/rank<r>.pt`` (beside the checkpoint folder): ``world``, ``groups``, ``rows``
    (``{table: {tier: {ids, weights, states}}}``), ``dense``, ``dense_optimizer``."""
    from flexshard import checkpoint_reshard

    original = checkpoint_reshard.load_resharded

    def load(path, module, dense_model=None, dense_optimizer=None):
        step = original(path, module, dense_model, dense_optimizer)
        folder = Path(path).parent.with_name(Path(path).parent.name + "-loaded")
        folder.mkdir(exist_ok=True)
        rows: dict = {}
        for (table, tier), (ids, w, s) in module.shard_rows().items():
            rows.setdefault(table, {})[tier] = {"ids": torch.from_numpy(ids), "weights": w, "states": s}
        dump = {
            "world": module.world_size,
            "groups": module.pg.groups,
            "rows": rows,
            "dense": {k: v.detach().cpu() for k, v in dense_model.state_dict().items()},
            "dense_optimizer": dense_optimizer.state_dict(),
        }
        torch.save(dump, folder / f"rank{module.rank}.pt")
        return step

    checkpoint_reshard.load_resharded = load
    try:
        yield
    finally:
        checkpoint_reshard.load_resharded = original


@contextlib.contextmanager
def _bad_batch_at_step_3():
    """Rank 2's batch of step 3 (index 2) asks for an id past its first table's rows."""
    from flexshard.training import loop

    original = loop.make_source

    def make_source(*args, **kwargs):
        source = original(*args, **kwargs)
        batch = source.batch

        def bad(step, rank):
            b = batch(step, rank)
            if step == 2 and rank == 2:
                name = next(iter(b.history))
                b.history = {**b.history, name: b.history[name].copy()}
                b.history[name][0] = 10**9
            return b

        source.batch = bad
        return source

    loop.make_source = make_source
    try:
        yield
    finally:
        loop.make_source = original


PATCHES = {
    "bad_batch_at_step_3": _bad_batch_at_step_3,
    None: contextlib.nullcontext,
    "dump_resharded_load": _dump_resharded_load,
    "stall_rank_1": lambda: _patched_step(_stall_rank_1),
    "diverge_replica": lambda: _patched_step(_diverge_replica),
    "skew_update": lambda: _patched_step(_skew_update),
    "skip_an_iteration": lambda: _patched_step(_skip_an_iteration),
}


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
