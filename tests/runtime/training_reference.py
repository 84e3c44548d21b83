"""The single-process reference of the runtime tests' training runs (the same weights, every rank's
batches, each optimizer's update written out here) and the check of a run's rows against it."""

from __future__ import annotations

import numpy as np
import torch
from runtime_workers import SEED, TABLES, loss_weights, make_orders, owners, random_batch

from flexshard.runtime import seeded_initializer


def full_weights() -> dict[str, torch.Tensor]:
    init = seeded_initializer(SEED)
    return {name: init(name, np.arange(rows), dim) for name, rows, dim in TABLES}


def reference_training(
    world: int,
    steps: int,
    optimizer: str,
    lr: float = 0.05,
    eps: float = 1e-8,
    betas=(0.9, 0.999),
    start: tuple | None = None,
    first_step: int = 0,
):
    """Single process: the same weights, all ranks' batches, loss = sum over ranks; each optimizer's
    update written out here (fbgemm's formulas; Adam's t = the step, from 1) on the touched rows, for
    steps ``first_step ..`` from ``start`` (weights, states; default: the initial rows, zero state).
    Returns the weights and ``{table: {state name: tensor}}``."""
    w = full_weights()
    per_element = {"elementwise_adagrad": ("momentum1",), "adam": ("momentum1", "momentum2")}
    names = per_element.get(optimizer, ("momentum1",) if optimizer in ("adagrad", "rowwise_adagrad") else ())
    s = {
        n: {k: torch.zeros(t.shape if optimizer in per_element else t.shape[:1]) for k in names}
        for n, t in w.items()
    }
    if start is not None:
        w = {n: t.clone() for n, t in start[0].items()}
        s = {n: {k: t.clone() for k, t in states.items()} for n, states in start[1].items()}
    b1, b2 = betas
    for step in range(first_step, first_step + steps):
        for name, rows, dim in TABLES:
            g = torch.zeros(rows, dim)
            touched = torch.zeros(rows, dtype=torch.bool)
            for r in range(world):
                feats = random_batch(SEED, step, r)
                g.index_add_(0, feats[name][0], loss_weights(SEED, step, r, feats)[name])
                touched[feats[name][0]] = True
            r_ = torch.nonzero(touched).flatten()
            gr, st = g[r_], s[name]
            if optimizer == "sgd":
                w[name][r_] -= lr * gr
            elif optimizer in ("adagrad", "rowwise_adagrad"):
                st["momentum1"][r_] += gr.pow(2).mean(1)
                w[name][r_] -= lr * gr / (st["momentum1"][r_].sqrt().unsqueeze(1) + eps)
            elif optimizer == "elementwise_adagrad":
                st["momentum1"][r_] += gr.pow(2)
                w[name][r_] -= lr * gr / (st["momentum1"][r_].sqrt() + eps)
            else:
                t = step + 1  # the module's iteration, the same for every row and table
                st["momentum1"][r_] = b1 * st["momentum1"][r_] + (1 - b1) * gr
                st["momentum2"][r_] = b2 * st["momentum2"][r_] + (1 - b2) * gr.pow(2)
                m_hat, v_hat = st["momentum1"][r_] / (1 - b1**t), st["momentum2"][r_] / (1 - b2**t)
                w[name][r_] -= lr * m_hat / (v_hat.sqrt() + eps)
    return w, s


def check_training(plan_file, results, optimizer: str, steps: int) -> None:
    """Every rank's rows and optimizer states equal the single-process reference; hot and warm copies
    (weights and every state) bitwise equal; every warm row once per group, every cold row once."""
    world = plan_file.world_size
    ref_w, ref_s = reference_training(world, steps, optimizer.split("-")[0])
    positions = {r: p for members in plan_file.groups for p, r in enumerate(members)}
    held = {
        (name, tier): np.zeros(rows, dtype=np.int64) for name, rows, _ in TABLES for tier in ("warm", "cold")
    }
    for r, res in enumerate(results):
        for (name, tier), (ids, w, s) in res["train"][optimizer]["rows"].items():
            ids_t = torch.as_tensor(ids, dtype=torch.int64)
            torch.testing.assert_close(w, ref_w[name][ids_t], rtol=0, atol=1e-5)
            assert s.keys() == ref_s[name].keys(), (optimizer, s.keys())
            for k in s:
                torch.testing.assert_close(s[k], ref_s[name][k][ids_t], rtol=0, atol=1e-5)
            if tier != "hot":
                np.add.at(held[(name, tier)], ids, 1)
            # replicas bitwise equal: hot on every rank, warm on the ranks at the same position
            peers = (
                range(world) if tier == "hot" else [q for q in range(world) if positions[q] == positions[r]]
            )
            if tier != "cold":
                for q in peers:
                    ids_q, w_q, s_q = results[q]["train"][optimizer]["rows"][(name, tier)]
                    assert np.array_equal(ids, ids_q) and torch.equal(w, w_q)
                    assert s.keys() == s_q.keys() and all(torch.equal(s[k], s_q[k]) for k in s)
    tiers = {tp.name: tp for tp in plan_file.plan.tables}
    routes = owners(plan_file, make_orders())
    for (name, tier), count in held.items():  # every warm row once per group, every cold row once
        want = np.where(
            routes[name][0] == (1 if tier == "warm" else 2), len(plan_file.groups) if tier == "warm" else 1, 0
        )
        assert np.array_equal(count, want), (name, tier, tiers[name])
