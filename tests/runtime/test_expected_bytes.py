"""The cost model's expected bytes against bytes measured by the runtime over many random batches.

Four gloo ranks in 2 groups of 2 run a FlexShard plan of a skewed two-table workload; every rank
draws its ids independently from the tables' row distributions (as the model assumes). Averaged
over the iterations and ranks, the measured bytes per link class (ids, embeddings, gradients,
replica sync) must be within 3% of ``solvers.cost_model.evaluate``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_workers import run_function

from core.vocabulary import LinkClass
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.workloads import sample_ids, zipf_table
from solvers.cost_model import evaluate
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology.views import uniform_view

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

GROUPS, GROUP_SIZE = 2, 2
ITERATIONS = 40
BATCH, LENGTH = 16, 12  # samples per rank, ids per sample


def workload() -> Workload:
    tables = (
        zipf_table("items", 3000, 8, float(LENGTH), 1.05, 0.02),
        zipf_table("tags", 400, 4, float(LENGTH), 1.2, 0.0),
    )
    return Workload("expected-bytes", tables, batch_size_per_gpu=BATCH)


def measure(rank: int, world: int, plan_path: str) -> np.ndarray:
    wl = workload()
    plan_file = read_plan(plan_path)
    tables = [(t.name, t.num_rows, t.dim) for t in wl.tables]
    model = ShardedSequenceEmbedding(plan_file, tables, None, init=1, optimizer="sgd", lr=0.01)
    rng = np.random.default_rng(1000 + rank)
    total = np.zeros((2, 4, 2))
    for _ in range(ITERATIONS):
        feats = {}
        for t in wl.tables:
            values = torch.as_tensor(sample_ids(t.hist, BATCH * LENGTH, rng))
            feats[t.name] = (values, torch.full((BATCH,), LENGTH, dtype=torch.int64))
        out = model(feats)
        sum(o.sum() for o in out.values()).backward()
        model.step()
        total += model.traffic.bytes
    dist.barrier()
    return total / ITERATIONS


@pytest.mark.parametrize("dedup", [True, False])
def test_expected_bytes_match_the_cost_model(tmp_path, dedup):
    wl = workload()
    view = uniform_view(GROUPS, GROUP_SIZE, 100e9, 10e9)
    planned = make_plan("flexshard", wl, view, budget_bytes(wl, view, 2.0), dedup=dedup)
    tiers = [(tp.hot_rows, tp.warm_rows, tp.cold_rows) for tp in planned.plan.tables]
    assert any(h for h, _, _ in tiers) or any(w for _, w, _ in tiers), tiers  # something replicated
    assert all(c for _, _, c in tiers), tiers  # and something cold
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, to_dict(planned.plan, wl, view, planned.report, "test"))
    measured = run_function(measure, GROUPS * GROUP_SIZE, str(plan_path))
    predicted = evaluate(wl, view, planned.plan)
    for link in LinkClass:
        got = np.mean([m[link].sum(axis=0).max() for m in measured])  # max(send, recv), all components
        want = predicted.link_bytes(link).mean()
        assert got == pytest.approx(want, rel=0.03), (link, got, want, tiers)
