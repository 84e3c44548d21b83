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
    COLD_SHARE_4,
    COLD_SHARE_8,
    SEED,
    TABLES,
    TRAIN_KEYS,
    WARM_BY_POSITION,
    WARM_SHARE_4,
    balanced_ids,
    expected_traffic,
    make_orders,
    owners,
    random_batch,
    run,
    write_test_plan,
)
from torch.nn.functional import embedding
from training_reference import check_training, full_weights

from flexshard.plan_file import read_plan
from solvers.cost_model import Exchanges, hierarchical_allreduce_bytes, lookup_traffic, split_bytes
from topology.views import uniform_view

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = tmp_path_factory.mktemp("four")
    plan = write_test_plan(d / "plan.json", 2, 2, COLD_SHARE_4, WARM_SHARE_4)
    (d / "out").mkdir()
    return read_plan(plan), run(4, plan, "main")


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    d = tmp_path_factory.mktemp("eight")
    plan = write_test_plan(d / "plan.json", 4, 2, COLD_SHARE_8, WARM_BY_POSITION[2])
    (d / "out").mkdir()
    return read_plan(plan), run(8, plan, "small", timeout_s=180.0)


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


@pytest.mark.parametrize("optimizer", TRAIN_KEYS)
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
    cost model's ``lookup_traffic`` + ``split_bytes`` with those volumes, to the byte. The sparse sync's
    mask (a byte per hot row and per row of the whole warm tier) is all-reduced over every rank, priced
    as the hot rows' hierarchical all-reduce."""
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
        hot_payload += touched[tier == 0].sum() * vec + tp.hot_rows + tp.warm_rows  # + the mask
        for r in range(4):
            mine = (tier == 1) & (owner == view.local_index[r])
            warm_payload[r] += touched[mine].sum() * vec
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
    assert e["adam dense"] == (
        "optimizer: adam needs the plan's sync 'sparse' (dense sync updates every replicated row, and this "
        "optimizer moves rows without gradient); make the plan with --sync sparse, or run it with "
        "PlanFile.with_overrides(sync='sparse')"
    )
    assert all("\n" not in message for message in e.values())
    w = full_weights()
    for r, res in enumerate(results):  # the job goes on after the error
        feats = random_batch(SEED, 6, r)
        for name, _rows, _dim in TABLES:
            assert torch.equal(res["after_error"][name], embedding(feats[name][0], w[name]))
