"""Cold rows fetched once per group (``FetchMode.GROUP``) on real multi-process gloo runs: 4 ranks as 2
groups of 2 (every table per group, and a mix of group and flat tables; hot and warm tiers too, uneven
shares), 8 ranks as 2 groups of 4 and as 4 groups of 2. Outputs equal the unsharded embedding, training
equals the single-process reference, replicas stay bitwise equal, bytes equal an independent routing on
random batches and the cost model (:func:`solvers.cost_model.evaluate_volumes`) on a balanced one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_workers import (
    BALANCED_GROUP_COLD,
    BALANCED_WARM,
    COLD_SHARE_4,
    COLD_SHARE_8,
    FETCH_VARIANTS,
    SEED,
    TABLES,
    TRAIN_KEYS,
    WARM_BY_POSITION,
    WARM_SHARE_4,
    balanced_batch,
    expected_traffic,
    make_orders,
    owners,
    random_batch,
    run,
    run_function,
    runtime_workload,
    with_fetch,
    write_test_plan,
)
from torch.nn.functional import embedding
from training_reference import check_training, full_weights

from core.ranks import RankLayout
from core.vocabulary import FLOAT32_BYTES, Component, FetchMode, LinkClass, SyncMode
from flexshard.plan_file import read_plan
from flexshard.runtime import make_process_groups
from flexshard.runtime.replicas import hierarchical_all_reduce
from solvers import wire
from solvers.cost_model import evaluate_volumes, warm_sync_bytes
from solvers.volumes import TierVolumes
from topology.views import uniform_view

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks


@pytest.fixture(scope="module", params=list(FETCH_VARIANTS))
def four(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"four-{request.param}")
    plan = write_test_plan(d / "plan.json", 2, 2, COLD_SHARE_4, WARM_SHARE_4, FETCH_VARIANTS[request.param])
    return read_plan(plan), run(4, plan, "main")


@pytest.fixture(scope="module", params=[(2, 4), (4, 2)], ids=["2x4", "4x2"])
def eight(request, tmp_path_factory):
    groups, size = request.param
    d = tmp_path_factory.mktemp(f"eight-{groups}x{size}")
    plan = write_test_plan(d / "plan.json", groups, size, COLD_SHARE_8, WARM_BY_POSITION[size])
    return read_plan(plan), run(8, plan, "fetch_modes", timeout_s=300.0)


def check_forward(forward: dict, rank: int) -> None:
    w = full_weights()
    feats = random_batch(SEED, 99, rank)
    for name, _rows, _dim in TABLES:
        assert torch.equal(forward[name], embedding(feats[name][0], w[name])), (rank, name)


def check_traffic(plan_file, traffic: list[list[np.ndarray]], sync: str = "sparse") -> None:
    """``traffic[r][step]`` of training on ``random_batch`` equals the independent routing's bytes."""
    for step in range(len(traffic[0])):
        batches = [random_batch(SEED, step, r) for r in range(plan_file.world_size)]
        want = expected_traffic(plan_file, batches, dedup=True, sync=sync)
        got = np.stack([t[step] for t in traffic])
        np.testing.assert_array_equal(got[:, :, :3, :], want[:, :, :3, :])  # lookups: whole bytes
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


# --- 4 ranks in 2 groups ----------------------------------------------------------------------------------


def test_the_plan_file_keeps_the_fetch_modes(four):
    plan_file, _results = four
    modes = {tp.name: tp.fetch for tp in plan_file.plan.tables}
    assert modes["a"] is modes["c"] is FetchMode.GROUP
    assert plan_file.plan.cold_fetch(FetchMode.GROUP)


@pytest.mark.parametrize("dedup", [False, True])
def test_forward_equals_unsharded_embedding(four, dedup):
    _plan, results = four
    for r, res in enumerate(results):
        check_forward(res["forward"][dedup], r)


@pytest.mark.parametrize("optimizer", TRAIN_KEYS)
def test_training_matches_single_process_reference(four, optimizer):
    plan_file, results = four
    check_training(plan_file, results, optimizer, steps=3)
    check_traffic(
        plan_file,
        [res["train"][optimizer]["traffic"] for res in results],
        optimizer.partition("-")[2] or "sparse",
    )


def test_balanced_batch_bytes_equal_the_cost_model(four):
    """Each rank looks up exactly ``V * share`` cold rows of every owner and its group ``V_g * share``:
    the measured bytes are ``evaluate_volumes`` of those volumes to the byte (the warm sync, which the
    model prices by expected shares, from the realised payload)."""
    plan_file, results = four
    view = uniform_view(2, 2, 100e9, 10e9)
    routes = owners(plan_file, make_orders())
    batches = [balanced_batch(plan_file, routes, r) for r in range(4)]
    v_cold = sum(BALANCED_GROUP_COLD)
    volumes, model_warm, real_warm = [], np.zeros(4), np.zeros(4)
    for tp, (name, rows, dim) in zip(plan_file.plan.tables, TABLES, strict=True):
        tier, owner = routes[name]
        touched = np.zeros(rows, dtype=bool)
        for b in batches:
            touched[b[name][0].numpy()] = True
        hot_touched = float(touched[tier == 0].sum())
        volumes.append(
            TierVolumes(sum(BALANCED_WARM), v_cold, hot_touched, 0.0, cold_group_volume=1.5 * v_cold)
        )
        vec = dim * FLOAT32_BYTES
        model_warm += tp.warm_share * wire.sync_payload(0.0, tp.warm_rows, vec, SyncMode.SPARSE)
        for r in range(4):
            mine = (tier == 1) & (owner == view.local_index[r])
            real_warm[r] += wire.sync_payload(touched[mine].sum(), mine.sum(), vec, SyncMode.SPARSE)
    want = evaluate_volumes(runtime_workload(), view, plan_file.plan, volumes).traffic.bytes
    want[:, LinkClass.INTER_GROUP, Component.SYNC, :] += (
        warm_sync_bytes(view, real_warm) - warm_sync_bytes(view, model_warm)
    )[:, None]
    got = np.stack([res["balanced_traffic"] for res in results])
    np.testing.assert_array_equal(got[:, :, :3, :], want[:, :, :3, :])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    assert (got[:, :, :3, 0] != got[:, :, :3, 1]).any()  # uneven shares: send and receive differ
    # the group fetch crossed the fabric less than a flat fetch of the same batch would
    flat = with_fetch(plan_file, {name: FetchMode.FLAT for name, _rows, _dim in TABLES})
    flat_bytes = evaluate_volumes(runtime_workload(), view, flat.plan, volumes).traffic
    inter = LinkClass.INTER_GROUP
    assert got[:, inter, :3, :].sum() < flat_bytes.bytes[:, inter, :3, :].sum()


def test_bad_input_raises_on_every_rank(four):
    _plan, results = four
    errors = [res["errors"] for res in results]
    assert all(e == errors[0] for e in errors)
    assert errors[0]["range"] == "bad input on rank 2: table 'b': id 300 out of range [0, 300)"
    assert all(errors[0][case] for case in ("lengths", "empty", "missing"))
    w = full_weights()
    for r, res in enumerate(results):  # the job goes on after the error
        feats = random_batch(SEED, 6, r)
        for name, _rows, _dim in TABLES:
            assert torch.equal(res["after_error"][name], embedding(feats[name][0], w[name]))


# --- 8 ranks in 2 groups of 4 and in 4 groups of 2 --------------------------------------------------------


@pytest.mark.parametrize("variant", list(FETCH_VARIANTS))
def test_eight_ranks(eight, variant):
    plan_file, results = eight
    plan_file = with_fetch(plan_file, FETCH_VARIANTS[variant])
    runs = [res[variant] for res in results]
    for r, res in enumerate(runs):
        for dedup in (False, True):
            check_forward(res["forward"][dedup], r)
    for optimizer in ("sgd", "adagrad"):
        check_training(plan_file, runs, optimizer, steps=2)
        check_traffic(plan_file, [res["train"][optimizer]["traffic"] for res in runs])


# --- the hot rows' hierarchical all-reduce ------------------------------------------------------------


def _hierarchical_all_reduce(rank: int, world: int) -> dict:
    """Per layout (2 groups of 3, 3 groups of 2) and payload length (slices of unequal length too): what
    this rank gave and got, for a float sum and a uint8 max (the touched mask)."""
    out = {}
    for groups in (2, 3):
        reduce = hierarchical_all_reduce(make_process_groups(RankLayout.consecutive(world, groups)))
        gen = torch.Generator().manual_seed(rank)
        for n in (0, 1, 7, 1000):
            x = torch.randn(n, generator=gen)
            y = x.clone()
            reduce(y, dist.ReduceOp.SUM)
            out[(groups, n)] = (x, y)
        mask = (torch.rand(13, generator=gen) < 0.2).to(torch.uint8)
        got = mask.clone()
        reduce(got, dist.ReduceOp.MAX)
        out[(groups, "mask")] = (mask, got)
    return out


def test_hierarchical_all_reduce_gives_every_rank_the_same_sum():
    results = run_function(_hierarchical_all_reduce, 6)
    for key in results[0]:
        given = torch.stack([res[key][0] for res in results])
        got = [res[key][1] for res in results]
        assert all(torch.equal(g, got[0]) for g in got), key  # bitwise equal on every rank
        if key[1] == "mask":
            assert torch.equal(got[0], given.amax(dim=0)), key
        else:
            torch.testing.assert_close(got[0], given.sum(dim=0), rtol=0, atol=1e-5)
