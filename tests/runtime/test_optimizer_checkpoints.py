"""Optimizer state through checkpoints, with Adam (per-element moments and the module's iteration):
save and resume at the same world continue bitwise as an uninterrupted run; a checkpoint of 4 ranks in
2 groups loads into 2 ranks (another plan) with every row's weights and moments and the iteration, and
training on from there equals a single-process reference that starts from the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import (
    SEED,
    TABLES,
    loss_weights,
    make_orders,
    random_batch,
    run_function,
    write_test_plan,
)
from training_reference import reference_training

from flexshard import checkpoint
from flexshard.checkpoint_reshard import load_resharded
from flexshard.plan_file import read_plan
from flexshard.runtime import ShardedSequenceEmbedding

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks


def _module(plan_path: str, optimizer: str, init: int = SEED) -> ShardedSequenceEmbedding:
    return ShardedSequenceEmbedding(
        read_plan(plan_path), TABLES, make_orders(), init=init, optimizer=optimizer, lr=0.05
    )


def _train(model: ShardedSequenceEmbedding, rank: int, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        feats = random_batch(SEED, step, rank)
        out = model(feats)
        weights = loss_weights(SEED, step, rank, feats)
        sum((out[n] * weights[n]).sum() for n in out).backward()
        model.step()


def _dense() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


def save_and_resume(rank: int, world: int, plan_path: str, ckpt: str, optimizer: str) -> dict:
    """Train 2 steps, save, train 2 more; a fresh module (other initial rows) loads the checkpoint and
    trains the same 2 steps."""
    model = _module(plan_path, optimizer)
    _train(model, rank, 0, 2)
    checkpoint.save(model, _dense(), None, 2, ckpt)
    _train(model, rank, 2, 2)
    again = _module(plan_path, optimizer, init=SEED + 1)
    checkpoint.load(ckpt, again, _dense())
    loaded_step = again.optimizer_step
    _train(again, rank, 2, 2)
    return {"straight": model.shard_rows(), "resumed": again.shard_rows(), "loaded_step": loaded_step}


def reshard_and_train(rank: int, world: int, plan_path: str, ckpt: str, optimizer: str) -> dict:
    model = _module(plan_path, optimizer, init=SEED + 1)
    load_resharded(ckpt, model, _dense())
    loaded = {  # copies: on the CPU shard_rows gives the live tensors, which training moves
        key: (ids, w.clone(), {k: v.clone() for k, v in states.items()})
        for key, (ids, w, states) in model.shard_rows().items()
    }
    res = {"loaded": loaded, "loaded_step": model.optimizer_step}
    _train(model, rank, 2, 2)
    res["trained"] = model.shard_rows()
    return res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("adam")
    plan = write_test_plan(d / "plan4.json", 2, 2)  # hot, warm and cold rows on 4 ranks in 2 groups
    results = run_function(save_and_resume, 4, str(plan), str(d / "ckpt"), "adam", timeout_s=240.0)
    return d, results


def test_resume_continues_bitwise_as_an_uninterrupted_run(saved):
    d, results = saved
    manifest = checkpoint.read_manifest(checkpoint.step_dir(d / "ckpt", 2))
    assert manifest.optimizer == "adam" and manifest.optimizer_step == 2
    for res in results:
        assert res["loaded_step"] == 2
        assert res["straight"].keys() == res["resumed"].keys()
        for key, (ids, w, states) in res["straight"].items():
            ids_r, w_r, states_r = res["resumed"][key]
            assert np.array_equal(ids, ids_r) and torch.equal(w, w_r), key
            assert states.keys() == states_r.keys() == {"momentum1", "momentum2"}
            assert all(torch.equal(states[k], states_r[k]) for k in states), key


def test_four_ranks_checkpoint_reshards_to_two_with_the_moments(saved):
    d, _ = saved
    folder = checkpoint.step_dir(d / "ckpt", 2)
    full = checkpoint.load_full(folder)  # every row once, with its moments
    assert all(full.states[n]["momentum2"].abs().sum() > 0 for n in full.states)  # Adam state to compare
    plan2 = write_test_plan(d / "plan2.json", 1, 2)
    results = run_function(reshard_and_train, 2, str(plan2), str(folder), "adam", timeout_s=240.0)
    for res in results:
        assert res["loaded_step"] == 2  # the iteration travels with the checkpoint
        for (name, _tier), (ids, w, states) in res["loaded"].items():
            idx = torch.as_tensor(ids, dtype=torch.int64)
            assert torch.equal(w, full.weights[name][idx])
            assert all(torch.equal(s, full.states[name][k][idx]) for k, s in states.items())
    # two more steps at world 2 (t = 3, 4) equal the reference started from the checkpoint
    ref_w, ref_s = reference_training(2, 2, "adam", start=(full.weights, full.states), first_step=2)
    for res in results:
        for (name, _tier), (ids, w, states) in res["trained"].items():
            idx = torch.as_tensor(ids, dtype=torch.int64)
            torch.testing.assert_close(w, ref_w[name][idx], rtol=0, atol=1e-5)
            for k, s in states.items():
                torch.testing.assert_close(s, ref_s[name][k][idx], rtol=0, atol=1e-6)
    hot = [res["trained"][("a", "hot")] for res in results]  # replicas equal after training at world 2
    assert torch.equal(hot[0][1], hot[1][1]) and torch.equal(hot[0][2]["momentum1"], hot[1][2]["momentum1"])
