"""The collective recorder on spawned gloo ranks: hand-counted calls and bytes, and the bytes of real
runtime steps against the runtime's own traffic counter."""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

from flexshard.bench.data import default_data
from flexshard.bench.plans import h100_view, make_plans
from flexshard.bench.predict import predicted_parts_ms
from flexshard.bench.recorder import recording
from flexshard.bench.systems import RuntimeSystem
from flexshard.runtime.features import ERROR_WORDS
from flexshard.runtime.headed_ids import SHARED_WORDS
from flexshard.runtime.local import run_on_ranks
from solvers.time_model import step_time
from solvers.time_types import LocalRates


def _hand_counted(rank: int, world: int) -> tuple[dict, np.ndarray, np.ndarray, dict]:
    dist.barrier()  # outside the block: not counted
    with recording(2) as rec:
        splits = [1, 2, 3, 4]  # rows of 3 float32 (12 B) to ranks 0..3
        x = torch.zeros(sum(splits), 3)
        out = torch.zeros(world * splits[rank], 3)
        dist.all_to_all_single(out, x, [splits[rank]] * world, splits)
        dist.all_reduce(torch.zeros(10))  # 40 B
        dist.barrier()
    with recording(2) as other:  # a second block starts from zero
        dist.all_reduce(torch.zeros(1))
    return rec.counts, rec.bytes_sent, rec.bytes_received, other.counts


def test_counts_and_bytes_hand_computed():
    got = run_on_ranks(_hand_counted, 4, timeout_s=120)
    for rank, (counts, sent, received, other) in enumerate(got):
        assert counts == {"all_to_all_single": 1, "all_reduce": 1, "barrier": 1}
        assert other == {"all_reduce": 1}
        mate = rank ^ 1  # the other rank of its group
        far = [p for p in range(4) if p // 2 != rank // 2]
        # all-reduce of 40 B, 2 groups of 2: 2 (g-1)/g P = 40 intra, 2 (G-1)/G P / g = 20 inter
        assert sent.tolist() == [[1, 2, 3, 4][mate] * 12 + 40, sum([1, 2, 3, 4][p] for p in far) * 12 + 20]
        assert received.tolist() == [[1, 2, 3, 4][rank] * 12 + 40, 2 * [1, 2, 3, 4][rank] * 12 + 20]


def _runtime_steps(rank: int, world: int, docs: dict) -> dict:
    data = default_data(16, 0, world)
    out = {}
    for key, doc in docs.items():
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(json.dumps(doc))
        system = RuntimeSystem(key, f.name, data.tables, data.orders, 0, 0.01)
        rows = []
        for step in range(2):
            with recording(2) as rec:
                system.step(data.make_batch(step, rank))
            unpriced = system.model.protocol.unpriced_bytes_sent()
            rows.append((rec.bytes_sent.copy(), system.own_bytes_sent(), dict(rec.counts), unpriced))
        out[key] = rows
    return out


@pytest.fixture(scope="module")
def runtime_steps() -> list[dict]:
    data = default_data(16, 0, 4)
    plans = make_plans(data, h100_view(4, 2), h100_view(4, 2), 2.0, torchrec=False, objective="bytes")
    assert "hot 0 " not in plans["flexshard"].summary  # the plan has replicas, so a replica sync
    return run_on_ranks(_runtime_steps, 4, {k: p.document for k, p in plans.items()}, timeout_s=300)


def test_recorded_bytes_are_the_runtime_counter(runtime_steps):
    """What the collectives carried = the runtime's own count: the bytes its model prices and the words
    of ``ids`` it does not (error codes, shared words, padding: at least the error and shared words to
    each peer, 1 in the group and 2 outside)."""
    for per_rank in runtime_steps:
        for key, rows in per_rank.items():
            for sent, own, _counts, unpriced in rows:
                tol = 0.5 if key == "flexshard" else 0.0  # an uneven split of an odd payload
                assert np.abs(sent - own).max() <= tol, (key, sent - own)
                assert (unpriced >= 8 * (ERROR_WORDS + SHARED_WORDS) * np.array([1, 2])).all(), key


def test_collectives_of_each_runtime_step(runtime_steps):
    for per_rank in runtime_steps:
        # ids, rows, grads; the first step's ids past the capacity agreed so far (none): ids_overflow
        assert [c for _s, _o, c, _u in per_rank["row_wise"]] == [{"all_to_all_single": n} for n in (4, 3)]
        first, second = per_rank["flexshard"][0][2], per_rank["flexshard"][1][2]
        assert first == second | {"all_to_all_single": second["all_to_all_single"] + 1}
        assert second["all_reduce"] > 0  # the replica sync


def test_prediction_with_the_time_model():
    from solvers.planner import budget_bytes, make_plan

    data = default_data(16, 0, 4)
    view = h100_view(4, 2)
    planned = make_plan("row_wise", data.workload, view, budget_bytes(data.workload, view, 1.0))
    expected = step_time(data.workload, view, planned.plan).total_s * 1e3
    got = predicted_parts_ms(data.workload, view, planned.plan)["total"]
    assert got == pytest.approx(expected, rel=1e-12)
    assert expected > 0


def test_prediction_prices_the_work_around_the_exchange_at_the_ranks_share_of_a_core():
    from dataclasses import replace

    from flexshard.bench.config import BenchConfig
    from flexshard.bench.worker import machine_rates
    from solvers.planner import budget_bytes, make_plan

    rates = machine_rates(BenchConfig(nproc=4, groups=2))
    factor = max(1.0, 4 / (os.cpu_count() or 1))
    for name in ("pack_s_per_value", "output_s_per_value", "stage_s", "step_s"):
        assert getattr(LocalRates.default(), name) > 0
        assert getattr(rates, name) == pytest.approx(factor * getattr(LocalRates.default(), name), rel=1e-12)
    data = default_data(16, 0, 4)
    view = h100_view(4, 2)
    planned = make_plan("row_wise", data.workload, view, budget_bytes(data.workload, view, 1.0))
    without = replace(rates, stage_s=0.0, table_stage_s=0.0, step_s=0.0)
    host_ms = (rates.step_s + rates.stage_s * 3) * 1e3  # 3 collectives, no term per table
    got = predicted_parts_ms(data.workload, view, planned.plan, rates=rates)["total"]
    bare = predicted_parts_ms(data.workload, view, planned.plan, rates=without)["total"]
    assert got - bare == pytest.approx(host_ms)
