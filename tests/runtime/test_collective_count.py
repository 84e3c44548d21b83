"""A training step issues exactly the collectives of :func:`solvers.schedule.step_schedule`, in order, named
by stage, each on a process group of the stage's ranks, counted by
:func:`flexshard.runtime.collective_count.count_collectives` on real gloo ranks: plans with hot + warm +
group fetch, hot + warm + flat cold, flat only (every row cold), row-wise (TorchRec's ranges), group fetch
only (``rows`` on the rail, ``grads`` in the group), hot + warm with no cold row (both in the group),
sparse and dense sync, fp32 and fp16 wires, at 4 ranks in 2 groups and 8 ranks in 2 groups, with 2 and
with 5 tables (the count does not depend on the number of tables); and hot + flat cold, flat only
on 3 ranks in groups of 2 and 1 (no rail groups: the hot rows synced over every rank)."""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_workers import run_function

from core.ranks import RankLayout
from core.vocabulary import Deal, FetchMode, SyncMode, WireDtype
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.collective_count import count_collectives
from flexshard.workloads import zipf_table
from solvers.cost_model import evaluate
from solvers.schedule import step_schedule
from solvers.types import Plan, TablePlan, Workload
from topology.views import ClusterView, uniform_view

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

ROWS, DIM, BATCH, LENGTH = 200, 4, 6, 5
KINDS = ("tiers_group", "tiers_flat", "flat_only", "row_wise", "group_only", "warm_only")
UNEQUAL_KINDS = ("hot_flat", "flat_only")  # groups of unequal size: no warm rows, no group fetch
SETTINGS = list(product((SyncMode.SPARSE, SyncMode.DENSE), (WireDtype.FP32, WireDtype.FP16), (2, 5)))
LAYOUTS = {"4-ranks-2-groups": [[0, 1], [2, 3]], "8-ranks-2-groups": [[0, 1, 2, 3], [4, 5, 6, 7]]}
LAYOUTS["3-ranks-unequal-groups"] = [[0, 1], [2]]


def cluster(groups: list[list[int]]) -> ClusterView:
    n = sum(len(g) for g in groups)
    if len({len(g) for g in groups}) == 1:
        return uniform_view(len(groups), len(groups[0]), 100e9, 10e9)
    return ClusterView(
        layout=RankLayout.of(groups, n),
        host_of_rank=tuple(f"h{k}" for k, g in enumerate(groups) for _ in g),
        intra_bw_Bps=np.full(n, 100e9),
        inter_bw_Bps=np.full(n, 10e9),
        intra_latency_s=np.zeros(n),
        inter_latency_s=np.zeros(n),
        memory_bytes=np.full(n, 2**30, dtype=np.int64),
    )


def workload(num_tables: int) -> Workload:
    tables = tuple(zipf_table(f"t{i}", ROWS, DIM, float(LENGTH), 1.1, 0.0) for i in range(num_tables))
    return Workload("count", tables, batch_size_per_gpu=BATCH)


def make_plan(kind: str, sync: SyncMode, wire: WireDtype, num_tables: int, view: ClusterView) -> Plan:
    n = view.num_ranks
    tiers = {
        "tiers_group": (10, 40),
        "tiers_flat": (10, 40),
        "hot_flat": (10, 0),
        "warm_only": (10, ROWS - 10),
    }
    hot, warm = tiers.get(kind, (0, 0))
    fetch = FetchMode.GROUP if kind in ("tiers_group", "group_only") else FetchMode.FLAT
    deal = Deal.RANGES if kind == "row_wise" else Deal.INTERLEAVE
    tables = tuple(
        TablePlan(
            f"t{i}",
            hot,
            warm,
            ROWS - hot - warm,
            1.0 / view.group_size_of_rank(),
            np.full(n, 1.0 / n),
            fetch,
            deal,
        )
        for i in range(num_tables)
    )
    strategy = "row_wise" if kind == "row_wise" else "flexshard"
    return Plan(strategy, tables, dedup=True, sync=sync, wire=wire)


def _count(rank: int, world: int, paths: list[str]) -> list[list[tuple[str, str, int]]]:
    """Per plan: the stage names of the first training step (forward, backward, step), and the
    collectives of the second, as (stage, kind, ranks of its process group)."""
    out = []
    for path in paths:
        plan_file = read_plan(path)
        tables = [(tp.name, ROWS, DIM) for tp in plan_file.plan.tables]
        model = ShardedSequenceEmbedding(plan_file, tables, None, init=1, optimizer="adagrad", lr=0.1)
        rng = np.random.default_rng(rank)
        for step in range(2):
            feats = {
                name: (torch.as_tensor(rng.integers(0, ROWS, BATCH * LENGTH)), torch.full((BATCH,), LENGTH))
                for name, _rows, _dim in tables
            }
            with count_collectives() as counted:
                loss = sum((o * o).sum() for o in model(feats).values())
                loss.backward()
                model.step()
            if step == 0:
                first = counted.names
            else:
                out.append(
                    (first, [(*call, n) for call, n in zip(counted.calls, counted.ranks, strict=True)])
                )
        dist.barrier()
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_issues_exactly_its_schedule(tmp_path, layout):
    view = cluster(LAYOUTS[layout])
    kinds = UNEQUAL_KINDS if view.uniform_group_size is None else KINDS
    cases = [(kind, *setting) for kind in kinds for setting in SETTINGS]
    paths, want = [], []
    for i, (kind, sync, wire, num_tables) in enumerate(cases):
        plan = make_plan(kind, sync, wire, num_tables, view)
        wl = workload(num_tables)
        path = tmp_path / f"plan{i}.json"
        write_plan(path, to_dict(plan, wl, view, evaluate(wl, view, plan), "test"))
        paths.append(str(path))
        want.append([(s.name, s.kind.value, s.participants(view)) for s in step_schedule(plan, view)])
    got = run_function(_count, view.num_ranks, paths, timeout_s=600.0)
    for case, expected, per_rank in zip(cases, want, zip(*got, strict=True), strict=True):
        assert expected, case
        names = [name for name, _kind, _n in expected]
        # the first batch's ids go past the capacity agreed so far (none: headers only), then never
        first = names[:1] + ["ids_overflow"] + names[1:] if "rows" in names else names
        for rank, (first_step, calls) in enumerate(per_rank):
            assert calls == expected, (case, rank)
            assert first_step == first, (case, rank)
    by_tables = {}
    for case, expected in zip(cases, want, strict=True):
        by_tables.setdefault(case[:3], set()).add(len(expected))
    assert all(len(counts) == 1 for counts in by_tables.values())  # 2 or 5 tables: the same stages
    if layout == "8-ranks-2-groups":  # the issue's mark (at most 10): every tier and the group fetch in 9
        assert len(want[cases.index(("tiers_group", SyncMode.SPARSE, WireDtype.FP32, 5))]) == 9
