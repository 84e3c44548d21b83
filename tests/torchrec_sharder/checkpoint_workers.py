"""Spawned ranks of the DMP checkpoint tests (tests/torchrec_sharder/test_sharder_checkpoint.py): the test
model of :mod:`sharder_workers` (users in an EmbeddingBagCollection by TorchRec's sharder with row-wise
Adagrad; the EmbeddingCollection by FlexShardSharder with Adam) saved and loaded through
``torch.distributed.checkpoint`` exactly as a TorchRec user does: ``{"model": dmp.state_dict(), "optim":
dmp.fused_optimizer.state_dict()}``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sharder_workers import TABLES, Batch, build, make_batch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import KeyedJaggedTensor

from core.vocabulary import Tier

EC_OPTIMIZER, USERS_OPTIMIZER = "adam", "adagrad"
QUARTERS = 4  # each global step is 4 quarter batches: one per rank at 4 ranks, two per rank at 2


def _gathered_sharded(st: ShardedTensor, rows: int) -> torch.Tensor:
    """A TorchRec ShardedTensor whole (collective)."""
    mine = [(s.metadata.shard_offsets[0], s.tensor.detach().clone()) for s in st.local_shards()]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    full = None
    for rank_parts in parts:
        for lo, t in rank_parts:
            full = torch.full((rows, *t.shape[1:]), float("nan")) if full is None else full
            full[lo : lo + t.shape[0]] = t
    return full


def torchrec_full_state(dmp) -> dict:
    """:func:`full_state` of the test model with its collection row-wise by TorchRec's own sharder
    (row-wise Adagrad: weights and ``momentum1``); no ``step``. Collective."""
    out = {}
    tables = dmp.module.ec.state_dict()
    optim = dmp.fused_optimizer.state_dict()["state"]
    for name, rows, _dim in TABLES:
        out[(name, "weight")] = _gathered_sharded(tables[f"embeddings.{name}.weight"], rows)
        state = optim[f"ec.embeddings.{name}.weight"][f"{name}.momentum1"]
        out[(name, "momentum1")] = _gathered_sharded(state, rows)
    users = dmp.module.ebc.state_dict()["embedding_bags.users.weight"]
    out[("users", "weight")] = _gathered_sharded(users, users.size(0))
    state = dmp.fused_optimizer.state_dict()["state"]["ebc.embedding_bags.users.weight"]
    out[("users", "momentum1")] = _gathered_sharded(state["users.momentum1"], users.size(0))
    out["dense"] = {k: v.detach().clone() for k, v in dmp.module.dense.state_dict().items()}
    return out


def cross_load(
    rank: int, world: int, kind: str, plan_path: str, load_from: str, steps: int, save_to: str
) -> dict:
    """The test model with its collection by ``kind`` (``"flexshard"`` or ``"torchrec"``, row-wise
    Adagrad everywhere): load ``load_from`` (if any), train ``steps`` steps, save to ``save_to`` (if any);
    the whole state (without ``step``) after the load and after the save (rank 0)."""
    dmp, opt = build(kind, "adagrad", plan_path if kind == "flexshard" else None)

    def state() -> dict:
        if kind == "torchrec":
            return torchrec_full_state(dmp)
        return {k: v for k, v in full_state(dmp).items() if k != "step"}

    return _load_train_save(dmp, opt, state, rank, load_from, steps, save_to, seed=5)


def _load_train_save(dmp, opt, state, rank: int, load_from: str, steps: int, save_to: str, seed: int) -> dict:
    """Load ``load_from`` (if any), train ``steps`` plain-loop steps on batches of ``seed``, save to
    ``save_to`` (if any); ``state()`` after the load and after the save (rank 0), the load's keys."""
    res = {}
    if load_from:
        res["keys"] = load(dmp, load_from)
        res["loaded"] = state()
    for step in range(steps):
        opt.zero_grad()
        loss, _ = dmp(make_batch(seed, step, rank))
        loss.backward()
        opt.step()
    if save_to:
        save(dmp, save_to)
        res["saved"] = state()
    return res if rank == 0 else {"keys": res.get("keys")}


def full_state(dmp) -> dict:
    """Every row of every table, whole, with its optimizer state: the collection's from the FlexShard rows
    each rank holds (all tiers; replicas must agree), the users' from TorchRec's sharded state; and the
    collection's ``optimizer_step``. Collective."""
    emb = dmp.module.ec.embedding
    mine = {}
    for (t, tier), s in emb.shards.items():
        mine[(emb.table_names[t], tier.label)] = (
            torch.as_tensor(s.ids),
            {"weight": s.weights.detach().clone(), **{n: v.clone() for n, v in s.states.items()}},
        )
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for name, rows, _dim in TABLES:
        for rank_rows in parts:
            for tier in Tier:
                ids, tensors = rank_rows[(name, tier.label)]
                for k, v in tensors.items():
                    full = out.setdefault((name, k), torch.full((rows, *v.shape[1:]), float("nan")))
                    again = ~torch.isnan(full[ids].reshape(len(ids), -1)[:, 0])
                    assert torch.equal(full[ids[again]], v[again]), (name, k)  # replicas agree
                    full[ids] = v
    users = dmp.module.ebc.state_dict()["embedding_bags.users.weight"]
    out[("users", "weight")] = _gathered_sharded(users, users.size(0))
    state = dmp.fused_optimizer.state_dict()["state"]["ebc.embedding_bags.users.weight"]
    out[("users", "momentum1")] = _gathered_sharded(state["users.momentum1"], users.size(0))
    out["step"] = emb.optimizer_step
    out["dense"] = {k: v.detach().clone() for k, v in dmp.module.dense.state_dict().items()}
    return out


def save(dmp, path: str) -> None:
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=path)


def load(dmp, path: str) -> tuple[list[str], list[str]]:
    """TorchRec's recipe: templates, ``dcp.load``, then both ``load_state_dict``; the model's missing and
    unexpected keys."""
    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    keys = dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["optim"])
    return list(keys.missing_keys), list(keys.unexpected_keys)


def round_trip(rank: int, world: int, plan_path: str, load_from: str, steps: int, save_to: str) -> dict:
    """Load ``load_from`` (if any), train ``steps`` plain-loop steps, save to ``save_to`` (if any); the whole
    state after the load and after the save (rank 0)."""
    dmp, opt = build("flexshard", EC_OPTIMIZER, plan_path, users_optimizer=USERS_OPTIMIZER)
    return _load_train_save(dmp, opt, lambda: full_state(dmp), rank, load_from, steps, save_to, seed=3)


def _concat(batches: list[Batch]) -> Batch:
    """Samples of ``batches`` one after another (a rank's share of a global step)."""

    def cat(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        keys = kjts[0].keys()
        per = [k.to_dict() for k in kjts]
        values = [torch.cat([d[key].values() for d in per]) for key in keys]
        lengths = [torch.cat([d[key].lengths() for d in per]) for key in keys]
        return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))

    return Batch(
        cat([b.users for b in batches]),
        cat([b.sequences for b in batches]),
        torch.cat([b.labels for b in batches]),
    )


def global_batches(rank: int, world: int, first: int, last: int) -> list[Batch]:
    """This rank's share of global steps ``first..last-1``: each step's :data:`QUARTERS` quarter batches
    dealt in order, ``QUARTERS / world`` to a rank (the global batch is the same at any world size)."""
    per = QUARTERS // world
    return [
        _concat([make_batch(4, step, q) for q in range(rank * per, (rank + 1) * per)])
        for step in range(first, last)
    ]


def pipelined(
    rank: int,
    world: int,
    plan_path: str,
    load_from: str,
    first: int,
    last: int,
    save_after: int,
    save_to: str,
) -> dict:
    """Under TorchRec's TrainPipelineSparseDist, global steps ``first..last-1`` (loss: the mean over a
    rank's samples, so that with TorchRec's gradient division and DDP's mean every step's gradient is the
    mean over the global batch, whatever the world size); after ``save_after`` steps of this run, a DCP
    save to ``save_to`` while the pipeline holds the next batch, and training goes on. ``load_from``:
    loaded first. This rank's losses; the collection's tables at the end (rank 0)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    dmp, opt = build("flexshard", EC_OPTIMIZER, plan_path, users_optimizer=USERS_OPTIMIZER, reduction="mean")
    if load_from:
        load(dmp, load_from)
    step0 = dmp.module.ec.embedding.optimizer_step
    pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"), execute_all_batches=True)
    it = iter(global_batches(rank, world, first, last))
    losses = []
    for i in range(last - first):
        losses.append(float(pipeline.progress(it)))
        if i + 1 == save_after:
            save(dmp, save_to)
    state = full_state(dmp)
    return {"losses": losses, "step0": step0, "state": state if rank == 0 else None}


def state_keys(rank: int, world: int, plan_path: str) -> dict:
    """The keys (and global shapes) of ``dmp.state_dict()`` and ``dmp.fused_optimizer.state_dict()`` of the
    test model with the collection by FlexShardSharder and by TorchRec's row-wise sharding (both row-wise
    Adagrad)."""
    out = {}
    for kind in ("flexshard", "torchrec"):
        dmp, _opt = build(kind, "adagrad", plan_path if kind == "flexshard" else None)
        model = {k: tuple(v.size()) for k, v in dmp.state_dict().items()}
        optim = {
            (k, s): tuple(v.size())
            for k, states in dmp.fused_optimizer.state_dict()["state"].items()
            for s, v in states.items()
        }
        out[kind] = (model, optim)
    return out
