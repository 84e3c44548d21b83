"""The cost model's expected bytes against bytes measured by the runtime over many random batches.

Gloo ranks (4 in 2 groups of 2; 8 in 2 groups of 4 and in 4 groups of 2) run a FlexShard plan of a
skewed two-table workload, whose cold rows the optimizer fetches once per group (``FetchMode.GROUP``:
the expected distinct rows of a group's batch drive the inter-group bytes); every rank draws its ids
independently from the tables' row distributions (as the model assumes). Averaged over the iterations
and ranks, the measured bytes per link class (ids, embeddings, gradients, replica sync) must be within
3% of ``solvers.cost_model.evaluate``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_workers import run_function

from core.vocabulary import FetchMode, LinkClass
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.workloads import sample_ids, zipf_table
from solvers.cost_model import evaluate
from solvers.optimizer import OptimizerConfig
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology.views import uniform_view

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

ITERATIONS = 40
BATCH, LENGTH = 16, 12  # samples per rank, ids per sample

BYTES = OptimizerConfig(step_time=False)


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


@pytest.mark.parametrize(
    ("groups", "group_size", "dedup"),
    [(2, 2, True), (2, 2, False), (2, 4, True), (4, 2, True)],
    ids=["2x2-dedup", "2x2-no-dedup", "2x4-dedup", "4x2-dedup"],
)
def test_expected_bytes_match_the_cost_model(tmp_path, groups, group_size, dedup):
    wl = workload()
    view = uniform_view(groups, group_size, 100e9, 10e9)
    # the bytes objective's plan: it replicates and fetches once per group, every path the bytes cross
    planned = make_plan("flexshard", wl, view, budget_bytes(wl, view, 2.0), dedup=dedup, config=BYTES)
    tiers = [(tp.hot_rows, tp.warm_rows, tp.cold_rows, tp.fetch.value) for tp in planned.plan.tables]
    assert any(t[0] for t in tiers) or any(t[1] for t in tiers), tiers  # something replicated
    assert all(t[2] for t in tiers), tiers  # and something cold
    assert planned.plan.cold_fetch(FetchMode.GROUP), tiers  # fetched once per group
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, to_dict(planned.plan, wl, view, planned.report, "test"))
    measured = run_function(measure, groups * group_size, str(plan_path), timeout_s=300.0)
    predicted = evaluate(wl, view, planned.plan)
    for link in LinkClass:
        got = np.mean([m[link].sum(axis=0).max() for m in measured])  # max(send, recv), all components
        want = predicted.link_bytes(link).mean()
        print(f"{groups}x{group_size} dedup {dedup} {link.label}: measured {got:,.1f} B, model {want:,.1f} B")
        assert got == pytest.approx(want, rel=0.03), (link, got, want, tiers)
