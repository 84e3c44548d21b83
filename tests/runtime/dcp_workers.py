"""Spawned ranks of the DCP state tests (tests/runtime/test_dcp_state.py): train, save and load through
``torch.distributed.checkpoint`` with a generic optimizer state (row-wise ``[rows]`` and ``[rows, dim]``)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from runtime_workers import SEED, TABLES, loss_weights, make_orders, random_batch

from core.errors import CheckpointError
from flexshard.checkpoint_dcp import load_dcp, save_dcp
from flexshard.plan_file import read_plan
from flexshard.runtime import ShardedSequenceEmbedding, dcp_state
from flexshard.runtime.dcp_state import DcpStateful


def _with_second_state(module: ShardedSequenceEmbedding, fill: bool) -> None:
    """Give every shard a second state ``momentum2 [rows, dim]`` (``id * 1000 + column`` when ``fill``,
    else zeros) beside row-wise Adagrad's ``momentum1 [rows]``: the DCP state carries every entry of
    ``Shard.states`` (TorchRec key ``<t>.exp_avg_sq``, as Adam's second moment), a generic optimizer state
    with both shapes."""
    for shard in module.shards.values():
        ids = torch.as_tensor(shard.ids, dtype=torch.float32)
        value = ids[:, None] * 1000 + torch.arange(shard.dim, dtype=torch.float32)
        shard.states["momentum2"] = value if fill else torch.zeros_like(value)


def _rows(module: ShardedSequenceEmbedding) -> dict:
    out = {}
    for (t, tier), s in module.shards.items():
        out[(module.table_names[t], tier.label)] = {
            "ids": torch.as_tensor(s.ids), "weights": s.weights.clone(),
            "state": s.states["momentum1"].clone(), "extra": s.states["momentum2"].clone(),
        }  # fmt: skip
    return out


def _train(module: ShardedSequenceEmbedding, rank: int, steps: int) -> None:
    for step in range(steps):
        feats = random_batch(SEED, step, rank)
        out = module(feats)
        weights = loss_weights(SEED, step, rank, feats)
        sum((out[n] * weights[n]).sum() for n in out).backward()
        module.step()


def _save(module: ShardedSequenceEmbedding, ckpt: str, stateful: bool) -> dict:
    """Save the DCP state to ``ckpt``; the rows held and this rank's canonical blocks."""
    sd = module.dcp_state_dict()
    blocks = {k: v.to_local().clone() for k, v in sd["model"].items()} | {
        f"{k}/{s}": v.to_local().clone() for k, d in sd["optim"]["state"].items() for s, v in d.items()
    }
    dcp.save({"emb": DcpStateful(module)} if stateful else sd, checkpoint_id=ckpt)
    return {"rows": _rows(module), "blocks": blocks, "groups": module.pg.groups}


def save_main(rank: int, world: int, plan_path: str, ckpt: str, steps: int) -> dict:
    """Train ``steps`` Adagrad steps, then save (a plain state dict); what :func:`_save` returns."""
    module = ShardedSequenceEmbedding(
        read_plan(plan_path), TABLES, make_orders(), init=SEED, optimizer="adagrad", lr=0.05
    )
    _train(module, rank, steps)
    _with_second_state(module, fill=True)
    res = _save(module, ckpt, stateful=False)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dcp_state.device_mesh(module)
    res["dtensor_blocks"] = {  # where DTensor (and so DCP) puts this rank's block of n rows, uneven n too
        n: compute_local_shape_and_global_offset((n, 3), mesh, [Shard(0)]) for n in (0, 3, 5, 10, 61, 301)
    }
    return res


def load_main(
    rank: int, world: int, plan_path: str, ckpt: str, stateful: bool, save_to: str = "", layout: str = "exact"
) -> dict:
    """A module of another plan and seed loads ``ckpt``; the rows it then holds, and the one-line errors of
    state dicts with a table missing or of another shape; with ``save_to``, then trains a step and saves
    there (through :class:`DcpStateful`). ``layout``: the module's routing layout."""
    module = ShardedSequenceEmbedding(
        read_plan(plan_path),
        TABLES,
        make_orders(),
        init=SEED + 1,
        optimizer="adagrad",
        lr=0.05,
        layout=layout,
    )
    _with_second_state(module, fill=False)
    if stateful:
        dcp.load({"emb": DcpStateful(module)}, checkpoint_id=ckpt)
    else:
        load_dcp(module, ckpt)  # metadata checked, then dcp.load and load_dcp_state_dict
    res = {"rows": _rows(module), "groups": module.pg.groups, "errors": {}}
    second = {key: shard.states.pop("momentum2") for key, shard in module.shards.items()}
    try:  # an optimizer with one state of the two
        load_dcp(module, ckpt)
        res["errors"]["optimizer"] = None
    except CheckpointError as e:
        res["errors"]["optimizer"] = str(e)
    for key, shard in module.shards.items():
        shard.states["momentum2"] = second[key]
    sd = module.dcp_state_dict()
    missing = {
        "model": {k: v for k, v in sd["model"].items() if k != "embeddings.b.weight"},
        "optim": sd["optim"],
    }
    wrong = {"model": dict(sd["model"]), "optim": sd["optim"]}
    wrong["model"]["embeddings.b.weight"] = torch.zeros(301, 8)
    no_state = {"model": sd["model"], "optim": {"state": {}}}
    for case, bad in (("missing", missing), ("shape", wrong), ("no state", no_state)):
        try:
            module.load_dcp_state_dict(bad)
            res["errors"][case] = None
        except CheckpointError as e:
            res["errors"][case] = str(e)
    if save_to:
        _train(module, rank, 1)
        res["saved"] = _save(module, save_to, stateful=True)
    return res


def adam_main(rank: int, world: int, plan_path: str, ckpt: str, save: bool) -> dict:
    """Adam (its ``t`` in the DCP state): with ``save``, train 3 steps and save ``ckpt``; else a fresh
    module (another init) loads ``ckpt``. The module's ``optimizer_step`` and the rows it holds (weights,
    ``momentum1``, ``momentum2``), then (loaded) one more step's rows."""
    module = ShardedSequenceEmbedding(
        read_plan(plan_path), TABLES, make_orders(), init=SEED + (0 if save else 1), optimizer="adam", lr=0.05
    )
    if save:
        _train(module, rank, 3)
        save_dcp(module, ckpt)
    else:
        load_dcp(module, ckpt)
    res = {"step": module.optimizer_step, "rows": _adam_rows(module)}
    if not save:
        _train(module, rank, 1)
        res["next"] = _adam_rows(module)
    return res


def _adam_rows(module: ShardedSequenceEmbedding) -> dict:
    return {
        (module.table_names[t], tier.label): (
            torch.as_tensor(s.ids),
            s.weights.clone(),
            s.states["momentum1"].clone(),
            s.states["momentum2"].clone(),
        )
        for (t, tier), s in module.shards.items()
    }
