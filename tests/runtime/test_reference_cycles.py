"""A training step leaves no reference cycles: every buffer of a step is freed by reference counting
when the step is done, not when Python's cyclic collector next runs (which the training loop keeps out
of its steps, flexshard.training.garbage). On 4 gloo ranks in 2 groups, plans with hot, warm and
group-fetched cold rows and row-wise, dedup on and off, fp32 and fp16 wires, the plain step and the
pipelined order: with the collector off, the collection after the steps finds nothing."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch.distributed as dist
from runtime_workers import run_function
from test_collective_count import cluster, make_plan, workload
from test_pipeline_stages import DIM, GROUPS, ROWS, STEPS, _batch, _loss, pipelined_steps

from core.vocabulary import SyncMode, WireDtype
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding
from solvers.cost_model import evaluate

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

CASES = [
    ("tiers_group", True, WireDtype.FP32),
    ("tiers_group", False, WireDtype.FP32),
    ("tiers_group", True, WireDtype.FP16),
    ("row_wise", True, WireDtype.FP32),
    ("row_wise", False, WireDtype.FP32),
]


def _cyclic_garbage(rank: int, world: int, paths: list[str]) -> list[tuple[int, int]]:
    """Per plan: the objects the cyclic collector finds after plain steps, and after pipelined ones."""
    side = dist.new_group(ranks=list(range(world)))
    found = []
    for path in paths:
        plan_file = read_plan(path)
        tables = [(tp.name, ROWS, DIM) for tp in plan_file.plan.tables]
        plain = ShardedSequenceEmbedding(plan_file, tables, None, init=1, optimizer="adagrad", lr=0.1)
        piped = ShardedSequenceEmbedding(plan_file, tables, None, init=1, optimizer="adagrad", lr=0.1)
        gc.collect()
        gc.disable()
        try:
            for step in range(STEPS):
                _loss(plain(_batch(rank, step, tables))).backward()
                plain.step()
            after_plain = gc.collect()
            pipelined_steps(piped, rank, tables, side)
            after_piped = gc.collect()
        finally:
            gc.enable()
        found.append((after_plain, after_piped))
        dist.barrier()
    return found


def test_a_step_leaves_no_reference_cycles(tmp_path):
    view = cluster(GROUPS)
    paths = []
    for i, (kind, dedup, wire) in enumerate(CASES):
        plan = dataclasses.replace(make_plan(kind, SyncMode.SPARSE, wire, 2, view), dedup=dedup)
        wl = workload(2)
        write_plan(tmp_path / f"p{i}.json", to_dict(plan, wl, view, evaluate(wl, view, plan), "test"))
        paths.append(str(tmp_path / f"p{i}.json"))
    got = run_function(_cyclic_garbage, 4, paths, timeout_s=600.0)
    for rank, found in enumerate(got):
        assert found == [(0, 0)] * len(CASES), (rank, list(zip(CASES, found, strict=True)))
