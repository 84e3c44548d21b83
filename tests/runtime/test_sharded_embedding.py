"""ShardedSequenceEmbedding on real multi-process gloo runs: 4 ranks as 2 groups of 2 (uneven owner
shares) and 8 ranks as 4 groups of 2. Each scenario is spawned once per module; the tests below
check its saved results against a single-process reference and an independent routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import (
    BALANCED_COLD,
    BALANCED_WARM,
    SEED,
    TABLES,
    balanced_ids,
    check_training,
    full_weights,
    make_orders,
    owners,
    random_batch,
    run,
    write_test_plan,
)
from torch.nn.functional import embedding

from core.vocabulary import INDEX_BYTES
from flexshard.plan_file import read_plan
from solvers.cost_model import Exchanges, hierarchical_allreduce_bytes, lookup_traffic, split_bytes
from topology.views import uniform_view

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

COLD_SHARE_4 = [0.375, 0.125, 0.25, 0.25]
WARM_SHARE_4 = [0.75, 0.25]
COLD_SHARE_8 = [0.2, 0.05, 0.1, 0.15, 0.1, 0.2, 0.1, 0.1]
WARM_SHARE_8 = [0.6, 0.4]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = tmp_path_factory.mktemp("four")
    plan = write_test_plan(d / "plan.json", 2, 2, COLD_SHARE_4, WARM_SHARE_4)
    (d / "out").mkdir()
    return read_plan(plan), run(4, plan, "main")


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    d = tmp_path_factory.mktemp("eight")
    plan = write_test_plan(d / "plan.json", 4, 2, COLD_SHARE_8, WARM_SHARE_8)
    (d / "out").mkdir()
    return read_plan(plan), run(8, plan, "small", timeout_s=180.0)


def expected_traffic(plan_file, batches: list[dict], dedup: bool, sync: str = "sparse") -> np.ndarray:
    """Bytes [N, 2 links, 4 components, 2 directions] of one iteration, from an independent routing."""
    world, groups = plan_file.world_size, plan_file.groups
    group_of = np.empty(world, dtype=np.int64)
    pos_of = np.empty(world, dtype=np.int64)
    for k, members in enumerate(groups):
        group_of[members] = k
        pos_of[members] = np.arange(len(members))
    routes = owners(plan_file, make_orders())
    out = np.zeros((world, 2, 4, 2))
    n_tables = len(TABLES)
    hot_payload, warm_payload = 0.0, np.zeros(world)
    for tp, (name, rows, dim) in zip(plan_file.plan.tables, TABLES, strict=True):
        tier, owner = routes[name]
        vec = dim * 4
        asked = np.zeros((world, world))  # [requester, owner] lookups
        touched = np.zeros(rows, dtype=bool)
        for r, feats in enumerate(batches):
            ids = feats[name][0].numpy()
            touched[ids] = True
            ids = np.unique(ids) if dedup else ids
            for i in ids:
                if tier[i] == 1:
                    asked[r, groups[group_of[r]][owner[i]]] += 1
                elif tier[i] == 2:
                    asked[r, owner[i]] += 1
        np.fill_diagonal(asked, 0)
        for r in range(world):
            for p in range(world):
                li = 0 if group_of[p] == group_of[r] else 1
                out[r, li, 0, 0] += asked[r, p] * INDEX_BYTES
                out[r, li, 0, 1] += asked[p, r] * INDEX_BYTES
                out[r, li, 1, 0] += asked[p, r] * vec
                out[r, li, 1, 1] += asked[r, p] * vec
                out[r, li, 2, 0] += asked[r, p] * vec
                out[r, li, 2, 1] += asked[p, r] * vec
        if sync == "dense":
            touched[:] = True
        mask_bytes = 1 if sync == "sparse" else 0
        hot_payload += touched[tier == 0].sum() * vec + tp.hot_rows * mask_bytes
        for r in range(world):
            mine = (tier == 1) & (owner == pos_of[r])
            warm_payload[r] += touched[mine].sum() * vec + mine.sum() * mask_bytes
    for r in range(world):  # split sizes: T int64 per peer per tier exchange
        for p in range(world):
            if p != r:
                same = group_of[p] == group_of[r]
                out[r, 0 if same else 1, 0, :] += n_tables * INDEX_BYTES * (2 if same else 1)
    g, big_g = len(groups[0]), len(groups)
    out[:, 0, 3, :] += 2 * (g - 1) / g * hot_payload
    out[:, 1, 3, :] += (
        2 * (big_g - 1) / big_g * hot_payload / g + (2 * (big_g - 1) / big_g * warm_payload)[:, None]
    )
    return out


# --- (a) forward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dedup", [False, True])
def test_forward_equals_unsharded_embedding(four, dedup):
    _plan, results = four
    w = full_weights()
    for r, res in enumerate(results):
        feats = random_batch(SEED, 99, r)
        for name, _rows, _dim in TABLES:
            assert torch.equal(res["forward"][dedup][name], embedding(feats[name][0], w[name])), (r, name)


def test_padded_view(four):
    _plan, results = four
    w = full_weights()
    values, lengths = random_batch(SEED, 99, 0)["b"]
    padded = results[0]["padded"]
    assert padded.shape == (lengths.numel(), int(lengths.max()), 8)
    start = 0
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(padded[i, :n], embedding(values[start : start + n], w["b"]))
        assert not padded[i, n:].any()
        start += n


def test_forward_eight_ranks(eight):
    _plan, results = eight
    w = full_weights()
    for r, res in enumerate(results):
        feats = random_batch(SEED, 99, r)
        for name, _rows, _dim in TABLES:
            assert torch.equal(res["forward"][True][name], embedding(feats[name][0], w[name]))


# --- (b) training -----------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adagrad-dense"])
def test_training_matches_single_process_reference(four, optimizer):
    plan_file, results = four
    check_training(plan_file, results, optimizer, steps=3)


def test_training_eight_ranks(eight):
    plan_file, results = eight
    check_training(plan_file, results, "sgd", steps=2)


# --- (c) traffic --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("which", "run_key", "sync"),
    [("four", "sgd", "sparse"), ("four", "adagrad-dense", "dense"), ("eight", "sgd", "sparse")],
)
def test_traffic_matches_independent_routing(request, which, run_key, sync):
    plan_file, results = request.getfixturevalue(which)
    steps = len(results[0]["train"][run_key]["traffic"])
    for step in range(steps):
        batches = [random_batch(SEED, step, r) for r in range(plan_file.world_size)]
        want = expected_traffic(plan_file, batches, dedup=True, sync=sync)
        got = np.stack([res["train"][run_key]["traffic"][step] for res in results])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        np.testing.assert_array_equal(got[:, :, :3, :], want[:, :, :3, :])  # lookups: whole bytes


def test_traffic_equals_cost_model_on_a_balanced_batch(four):
    """Each rank looks up exactly V * share rows of every owner: the measured lookup bytes are the
    cost model's ``lookup_traffic`` + ``split_bytes`` with those volumes, to the byte."""
    plan_file, results = four
    view = uniform_view(2, 2, 100e9, 10e9)
    v_warm, v_cold = sum(BALANCED_WARM), sum(BALANCED_COLD)
    want = np.zeros((4, 2, 4, 2))
    hot_payload = 0.0
    warm_payload = np.zeros(4)
    routes = owners(plan_file, make_orders())
    batches = [balanced_ids(routes, r, 4, BALANCED_WARM, BALANCED_COLD) for r in range(4)]
    for tp, (name, rows, dim) in zip(plan_file.plan.tables, TABLES, strict=True):
        vec = dim * 4
        want[:, :, :3, :] += lookup_traffic(view, tp.warm_share, v_warm, vec, within_group=True).bytes[
            :, :, :3, :
        ]
        want[:, :, :3, :] += lookup_traffic(view, tp.cold_share, v_cold, vec, within_group=False).bytes[
            :, :, :3, :
        ]
        tier, owner = routes[name]
        touched = np.zeros(rows, dtype=bool)
        for b in batches:
            touched[b[name][0].numpy()] = True
        hot_payload += touched[tier == 0].sum() * vec + tp.hot_rows
        for r in range(4):
            mine = (tier == 1) & (owner == view.local_index[r])
            warm_payload[r] += touched[mine].sum() * vec + mine.sum()
    want[:, :, 0, :] += split_bytes(view, len(TABLES), Exchanges(warm=True, cold_flat=True))[:, :, None]
    hot = hierarchical_allreduce_bytes(view, hot_payload)
    want[:, :, 3, :] += hot[:, :, None]
    want[:, 1, 3, :] += (2 * (2 - 1) / 2 * warm_payload)[:, None]
    got = np.stack([res["balanced_traffic"] for res in results])
    np.testing.assert_array_equal(got[:, :, :3, :], want[:, :, :3, :])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    # uneven shares make send and receive differ: the model reports max(send, recv) per link
    assert (got[:, :, :3, 0] != got[:, :, :3, 1]).any()


# --- (d) bad input ---------------------------------------------------------------------------------------


def test_bad_input_raises_on_every_rank(four):
    _plan, results = four
    for res in results:
        assert res["errors"]["range"] == "bad input on rank 2: table 'b': id 300 out of range [0, 300)"
        assert "rank 1: table 'c': lengths sum to" in res["errors"]["lengths"]
        assert (
            res["errors"]["empty"] == "bad input on rank 3: table 'a': empty batch (lengths has no entries)"
        )
        assert (
            "bad input on rank 0:" in res["errors"]["missing"]
            and "'c' is missing" in res["errors"]["missing"]
        )

    # plans that do not fit the run: the same one-line error on every rank
    errors = [res["errors"] for res in results]
    assert all(e == errors[0] for e in errors)
    e = errors[0]
    assert e["world"].startswith("the plan is for 5 ranks, this job has 4: launch 5 ranks")
    assert e["tables"].startswith("table 'b': the plan covers 300 rows, the model has 301")
    assert e["dim"].startswith("table 'c': the plan was made for dim 16, the model has dim 8")
    assert e["data"].startswith("table 'b': the plan was made from other data (hotness order ")
    assert e["no order"].startswith("table 'c': the plan was made from other data")
    assert all("\n" not in message for message in e.values())
    w = full_weights()
    for r, res in enumerate(results):  # the job goes on after the error
        feats = random_batch(SEED, 6, r)
        for name, _rows, _dim in TABLES:
            assert torch.equal(res["after_error"][name], embedding(feats[name][0], w[name]))
