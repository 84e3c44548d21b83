"""The module's split forward (``input_dist`` then ``forward`` of the prepared batch) in the pipelined
order of :mod:`flexshard.training.pipeline`: batch s+1's ``ids`` issued after step s's forward on a side
process group, its headers read after the backward, waited at step s+1. On 4 gloo ranks in 2 groups, with a
plan of hot + warm + group-fetched cold rows and a row-wise plan, dedup on and off: the outputs of every
step and every row and optimizer state afterwards equal the plain forward's bit for bit; the side group
carries exactly ``ids`` (and batch 0's ``ids_overflow``: the first batch's ids are past the capacity
agreed so far) and the default group the rest of the step's schedule, in order."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_workers import run_function
from test_collective_count import cluster, make_plan, workload

from core.vocabulary import SyncMode, WireDtype
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.collective_count import _local
from solvers.cost_model import evaluate
from solvers.schedule import step_schedule

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

ROWS, DIM, BATCH, LENGTH, STEPS = 200, 4, 6, 5, 4
GROUPS = [[0, 1], [2, 3]]
CASES = [(kind, dedup) for kind in ("tiers_group", "row_wise") for dedup in (True, False)]


def _batch(rank: int, step: int, tables) -> dict:
    rng = np.random.default_rng((rank, step))
    return {
        name: (torch.as_tensor(rng.integers(0, ROWS, BATCH * LENGTH)), torch.full((BATCH,), LENGTH))
        for name, _rows, _dim in tables
    }


@contextlib.contextmanager
def _record(calls: list, side):
    """Record ``(stage, on the side group)`` of every all-to-all and all-reduce issued in the block."""
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce")}

    def wrap(fn):
        def recorded(*args, **kwargs):
            calls.append((getattr(_local, "stage", None) or "", kwargs.get("group") is side))
            return fn(*args, **kwargs)

        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _loss(outs: dict) -> torch.Tensor:
    return sum(((o * o).sum(1) * torch.arange(o.shape[0])).sum() for o in outs.values())


def pipelined_steps(piped, rank: int, tables, side, each_step=None, outputs=None) -> None:
    """``STEPS`` steps of ``piped`` in the pipelined order (batch s+1's ``ids`` after step s's forward on
    ``side``, its headers read after the backward); ``each_step(step)``: a context each step runs in;
    ``outputs(outs)``: called with each step's outputs."""
    ahead = piped.input_dist(_batch(rank, 0, tables), side)
    for step in range(STEPS):
        with each_step(step) if each_step else contextlib.nullcontext():
            outs = piped(ahead.wait())
            if outputs:
                outputs(outs)
            if step + 1 < STEPS:
                ahead = piped.input_dist(_batch(rank, step + 1, tables), side)
            _loss(outs).backward()
            if step + 1 < STEPS:
                ahead.advance()
            piped.step()


def _train(rank: int, world: int, paths: list[str]) -> list[dict]:
    side = dist.new_group(ranks=list(range(world)))
    results = []
    for path in paths:
        plan_file = read_plan(path)
        tables = [(tp.name, ROWS, DIM) for tp in plan_file.plan.tables]
        res = {"plain": [], "pipelined": [], "calls": []}
        plain = ShardedSequenceEmbedding(plan_file, tables, None, init=1, optimizer="adagrad", lr=0.1)
        for step in range(STEPS):
            outs = plain(_batch(rank, step, tables))
            res["plain"].append({k: v.detach().clone() for k, v in outs.items()})
            _loss(outs).backward()
            plain.step()
        piped = ShardedSequenceEmbedding(plan_file, tables, None, init=1, optimizer="adagrad", lr=0.1)

        calls, kept = res["calls"], res["pipelined"]

        def recorded(step: int, calls: list = calls):
            calls.append([])
            return _record(calls[-1], side)

        def keep(outs: dict, kept: list = kept) -> None:
            kept.append({k: v.detach().clone() for k, v in outs.items()})

        pipelined_steps(piped, rank, tables, side, recorded, keep)
        res["rows"] = (plain.shard_rows(), piped.shard_rows())
        results.append(res)
        dist.barrier()
    return results


def test_pipelined_order_equals_the_plain_forward_and_splits_the_groups(tmp_path):
    view = cluster(GROUPS)
    paths, schedules = [], []
    for i, (kind, dedup) in enumerate(CASES):
        plan = dataclasses.replace(make_plan(kind, SyncMode.SPARSE, WireDtype.FP32, 2, view), dedup=dedup)
        wl = workload(2)
        write_plan(tmp_path / f"p{i}.json", to_dict(plan, wl, view, evaluate(wl, view, plan), "test"))
        paths.append(str(tmp_path / f"p{i}.json"))
        schedules.append([s.name for s in step_schedule(plan, view)])
    got = run_function(_train, 4, paths, timeout_s=600.0)
    for c, (case, schedule) in enumerate(zip(CASES, schedules, strict=True)):
        assert schedule[:1] == ["ids"], schedule
        for rank in range(4):
            res = got[rank][c]
            for a, b in zip(res["plain"], res["pipelined"], strict=True):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (case, rank)
            plain, piped = res["rows"]
            assert plain.keys() == piped.keys()
            for key in plain:
                (ids, w, states), (ids_p, w_p, states_p) = plain[key], piped[key]
                assert np.array_equal(ids, ids_p) and torch.equal(w, w_p), (case, rank, key)
                assert states.keys() == states_p.keys() == {"momentum1"}  # row-wise Adagrad's accumulator
                assert all(torch.equal(states[k], states_p[k]) for k in states), (case, rank, key)
            for step, calls in enumerate(res["calls"]):  # this step's stages; the next batch's on the side
                main = [name for name, on_side in calls if not on_side]
                ahead = [name for name, on_side in calls if on_side]
                assert main == schedule[1:], (case, rank, step)
                first = ["ids_overflow"] if step == 0 else []  # batch 0's: issued when it is waited for
                assert ahead == first + (["ids"] if step + 1 < STEPS else []), (case, rank, step)
