"""The runtime's GPU op choices (two-pass gathers, column joins, ``torch.nonzero``, gathers before a host
copy) run on the CPU inside :func:`flexshard.runtime.device_rules.counted_as_gpu` and give what the CPU's
choices give, bit for bit: forward outputs, losses and every shard's rows and optimizer state after three
Adagrad steps, on 8 spawned gloo ranks in 2 groups of 4 with one dim for every table (the relay working in
the stages' buffers) and every table's cold rows fetched per group, some, or none."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from runtime_workers import (
    COLD_SHARE_8,
    GROUP,
    MIXED,
    SEED,
    WARM_BY_POSITION,
    make_orders,
    random_batch,
    run_function,
    write_test_plan,
)

from flexshard.plan_file import read_plan
from flexshard.runtime import ShardedSequenceEmbedding, column_joins, device_rules, relay, transfer
from flexshard.runtime.device_rules import counted_as_gpu, gpu_paths

ONE_DIM = [("a", 120, 8), ("b", 300, 8), ("c", 60, 8)]  # TABLES' names and rows, one dim
FETCH = {"group": GROUP, "mixed": MIXED, "flat": {}}
STEPS = 3


def _counted(module, name: str, calls: dict) -> None:
    """Count the calls of ``module.name`` (looked up at call time by the runtime) under ``name``."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, counted)


def _train(rank: int, world: int, plans: dict) -> dict:
    orders = make_orders()
    calls: dict[str, int] = {}
    _counted(transfer, "_gather_staged", calls)
    _counted(transfer, "join_columns", calls)
    _counted(relay, "join_columns", calls)
    _counted(torch, "nonzero", calls)
    out = {"calls": {}}
    for name, path in plans.items():
        for as_gpu in (False, True):
            calls.clear()
            with counted_as_gpu() if as_gpu else nullcontext():
                model = ShardedSequenceEmbedding(
                    read_plan(path), ONE_DIM, orders, init=SEED, optimizer="adagrad", lr=0.05
                )
                losses, outputs = [], []
                for step in range(STEPS):
                    feats = random_batch(SEED, step, rank)
                    got = model(feats)
                    gen = torch.Generator().manual_seed(SEED * 7_919 + step * 31 + rank)
                    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in got.values())
                    loss.backward()
                    model.step()
                    losses.append(float(loss))
                    outputs.append({n: o.detach().clone() for n, o in got.items()})
            out[(name, as_gpu)] = {"losses": losses, "outputs": outputs, "rows": model.shard_rows()}
            out["calls"][(name, as_gpu)] = dict(calls)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_paths")
    plans = {
        name: str(
            write_test_plan(d / f"{name}.json", 2, 4, COLD_SHARE_8, WARM_BY_POSITION[4], fetch, ONE_DIM)
        )
        for name, fetch in FETCH.items()
    }
    return run_function(_train, 8, plans, timeout_s=300.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FETCH))
def test_the_gpu_choices_give_the_cpu_choices_values_bit_for_bit(runs, name):
    for rank, res in enumerate(runs):
        cpu, gpu = res[(name, False)], res[(name, True)]
        assert gpu["losses"] == cpu["losses"], rank
        for step in range(STEPS):
            for table, o in cpu["outputs"][step].items():
                assert torch.equal(gpu["outputs"][step][table], o), (rank, step, table)
        assert cpu["rows"].keys() == gpu["rows"].keys()
        for key, (ids, weights, states) in cpu["rows"].items():
            g_ids, g_weights, g_states = gpu["rows"][key]
            assert (g_ids == ids).all() and torch.equal(g_weights, weights), (rank, key)
            assert all(torch.equal(g_states[n], s) for n, s in states.items()), (rank, key)


@pytest.mark.slow
def test_the_gpu_choices_ran_on_the_cpu_only_when_asked(runs):
    for res in runs:
        for name in FETCH:
            assert res["calls"][(name, False)] == {}, name  # the CPU's choices: none of these
            gpu = res["calls"][(name, True)]
            assert gpu.get("nonzero", 0) > 0, name  # flat_nonzero by torch.nonzero
    # the two-pass gathers and the column joins ran where they save ops (on some ranks: the blocks differ)
    for path in ("_gather_staged", "join_columns"):
        assert sum(res["calls"][(name, True)].get(path, 0) for res in runs for name in FETCH) > 0, path


def test_counted_as_gpu_is_a_scoped_switch():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert not gpu_paths(cpu) and gpu_paths(gpu)
    with counted_as_gpu():
        assert gpu_paths(cpu) and device_rules._as_gpu
        with counted_as_gpu():
            assert gpu_paths(cpu)
        assert gpu_paths(cpu)  # the inner block restores what the outer one set
    assert not gpu_paths(cpu) and not device_rules._as_gpu
    with pytest.raises(RuntimeError), counted_as_gpu():
        raise RuntimeError("inside")
    assert not gpu_paths(cpu)  # restored after an error too
    # the rules the runtime's choices read
    assert column_joins.gpu_paths is gpu_paths and transfer.gpu_paths is gpu_paths
