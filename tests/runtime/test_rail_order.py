"""The group fetch's rail order on real multi-process gloo runs: an all-cold group-fetched table on the
exact layout deduplicates straight into the order its GIDS and GSLOTS columns are sent in
(:attr:`~flexshard.runtime.exchange_protocol.ExchangeProtocol.owner_key`), where the general path sorts
each column by destination. Both paths must give the same outputs, bytes and trained rows bit for bit:
2 groups of 2 (GSLOTS in order for free) and 3 groups of 2 (GSLOTS re-sorted), every wire dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import SEED, TABLES, _train, make_orders, random_batch, run_function, runtime_workload
from torch.nn.functional import embedding
from training_reference import full_weights

from core.vocabulary import FetchMode
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding
from solvers.cost_model import evaluate
from solvers.types import Plan, TablePlan
from topology.views import uniform_view

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

COLD = {4: [0.4, 0.1, 0.3, 0.2], 6: [0.3, 0.1, 0.2, 0.15, 0.05, 0.2]}  # uneven owner shares
WIRES = ("fp32", "fp16", "bf16")


def _all_cold_group_plan(path, groups: int, size: int) -> str:
    view = uniform_view(groups, size, 100e9, 10e9)
    cold = np.asarray(COLD[groups * size])
    tables = tuple(
        TablePlan(name, 0, 0, rows, np.full(groups * size, 1.0 / size), cold.copy(), FetchMode.GROUP)
        for name, rows, _dim in TABLES
    )
    plan = Plan(strategy="flexshard", tables=tables, dedup=True, sync="sparse")
    write_plan(
        path,
        to_dict(plan, runtime_workload(), view, evaluate(runtime_workload(), view, plan), "t", make_orders()),
    )
    return str(path)


def _both_paths(rank: int, world: int, plan_path: str) -> dict:
    """Per wire: (forward, traffic, trained rows) with the rail order and with it switched off."""
    out = {}
    for wire in WIRES:
        pf = read_plan(plan_path).with_overrides(wire=wire)
        for rail in (True, False):
            model = ShardedSequenceEmbedding(
                pf, TABLES, make_orders(), init=SEED, optimizer="adagrad", lr=0.05
            )
            used = [k is not None and k[0] is not None for k in model._unique_order]
            if not rail:  # the general path: a sort per column
                keep = zip(used, model._unique_order, strict=True)
                model._unique_order = [None if u else k for u, k in keep]
            with torch.no_grad():
                forward = {n: o.clone() for n, o in model(random_batch(SEED, 99, rank)).items()}
            traffic = _train(model, world, rank, 3, SEED)
            out[(wire, rail)] = {
                "used": used,
                "forward": forward,
                "traffic": traffic,
                "rows": model.shard_rows(),
            }
    return out


@pytest.mark.parametrize("groups", [2, 3])
def test_the_rail_order_equals_the_sorted_columns_bit_for_bit(tmp_path, groups):
    results = run_function(_both_paths, 2 * groups, _all_cold_group_plan(tmp_path / "plan.json", groups, 2))
    w = full_weights()
    for rank, res in enumerate(results):
        feats = random_batch(SEED, 99, rank)
        for wire in WIRES:
            new, old = res[(wire, True)], res[(wire, False)]
            assert all(new["used"]), (rank, wire)  # every table took the rail order
            for name, _rows, _dim in TABLES:
                assert torch.equal(new["forward"][name], old["forward"][name]), (rank, wire, name)
                if wire == "fp32":
                    assert torch.equal(new["forward"][name], embedding(feats[name][0], w[name]))
            for a, b in zip(new["traffic"], old["traffic"], strict=True):
                np.testing.assert_array_equal(a, b)
            assert new["rows"].keys() == old["rows"].keys()
            for key, (ids, weights, states) in new["rows"].items():
                o_ids, o_weights, o_states = old["rows"][key]
                assert np.array_equal(ids, o_ids) and torch.equal(weights, o_weights), (rank, wire, key)
                assert all(torch.equal(v, o_states[n]) for n, v in states.items()), (rank, wire, key)
