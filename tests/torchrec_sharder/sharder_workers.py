"""Models, plans and batches shared by the FlexShardSharder tests and the gloo ranks they spawn.

The model: an ``EmbeddingBagCollection`` (table ``users``, always TorchRec's own sharder) and an
``EmbeddingCollection`` (``item`` serving features ``hist`` and ``target``, ``tag`` serving
``tag_hist``) feeding a linear layer (DDP). The test plans give every table all three tiers with uneven
owner shares; ``item`` fetches its cold rows once per group, ``tag`` straight from the owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.streamable import Pipelineable

from core.vocabulary import FetchMode
from flexshard.plan_file import to_dict, write_plan
from flexshard.torchrec import FlexShardSharder, flexshard_module_plan
from solvers.cost_model import evaluate
from solvers.types import Plan, RowHistogram, TablePlan, TableSpec, Workload
from topology.views import uniform_view

DIM = 8
TABLES = [("item", 240, DIM), ("tag", 60, DIM)]  # the EmbeddingCollection's tables
FEATURES = {"item": ["hist", "target"], "tag": ["tag_hist"]}
TIERS = {"item": (12, 40), "tag": (6, 14)}  # hot, warm rows
FETCH = {"item": FetchMode.GROUP, "tag": FetchMode.FLAT}
USERS = 50
OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "elementwise_adagrad": EmbOptimType.EXACT_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}
LR, DENSE_LR, EPS = 0.05, 0.1, 1e-8


def orders() -> dict[str, np.ndarray]:
    """item: 100 touched ids hottest first (the rest completed); tag: a full permutation."""
    rng = np.random.default_rng(5)
    return {"item": rng.permutation(240)[:100], "tag": rng.permutation(60)}


def write_test_plan(path: Path, num_groups: int, group_size: int, tables=TABLES) -> Path:
    """A plan with all three tiers non-empty, uneven warm and cold shares, written as a plan file."""
    n = num_groups * group_size
    view = uniform_view(num_groups, group_size, 100e9, 10e9)
    cold = np.arange(1, n + 1, dtype=np.float64)
    cold /= cold.sum()
    warm = np.arange(group_size, 0, -1, dtype=np.float64)
    warm /= warm.sum()
    specs, plans = [], []
    for name, rows, dim in tables:
        hot, w = TIERS[name]
        hist = RowHistogram.from_counts(np.arange(rows, 0, -1))
        specs.append(TableSpec(name, rows, dim, ids_per_sample=3.0, hist=hist))
        plans.append(
            TablePlan(name, hot, w, rows - hot - w, warm[view.local_index].copy(), cold, FETCH[name])
        )
    workload = Workload("sharder-test", tuple(specs), batch_size_per_gpu=4)
    plan = Plan(strategy="flexshard", tables=tuple(plans), dedup=True, sync="sparse")
    write_plan(path, to_dict(plan, workload, view, evaluate(workload, view, plan), "test", orders()))
    return path


# --- the model ---------------------------------------------------------------------------------------


@dataclass
class Batch(Pipelineable):
    """The bag collection's features (``user``), the sequence features, the labels."""

    users: KeyedJaggedTensor
    sequences: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.users.to(device, non_blocking=non_blocking),
            self.sequences.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.users.record_stream(stream)
        self.sequences.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(self.users.pin_memory(), self.sequences.pin_memory(), self.labels.pin_memory())


def _pooled(jt, batch: int) -> torch.Tensor:
    """Per-sample sums of a JaggedTensor's rows [batch, DIM]."""
    seg = torch.repeat_interleave(torch.arange(batch), jt.lengths())
    return torch.zeros(batch, DIM).index_add(0, seg, jt.values())


def interact(seq: dict, users, labels: torch.Tensor) -> torch.Tensor:
    """[batch, DIM] features of the samples from their sequences' and users' embeddings (left out of
    TorchRec's pipeline tracing: ``torch.fx.wrap``)."""
    b = labels.numel()
    x = (_pooled(seq["hist"], b) + 1.0) * _pooled(seq["target"], b) + _pooled(seq["tag_hist"], b)
    return x if users is None else x + users["user"]


torch.fx.wrap("interact")


class Model(torch.nn.Module):
    def __init__(self, device: torch.device, with_users: bool = True, reduction: str = "sum") -> None:
        super().__init__()
        self.with_users, self.reduction = with_users, reduction
        if with_users:
            config = EmbeddingBagConfig(
                name="users", embedding_dim=DIM, num_embeddings=USERS, feature_names=["user"]
            )
            self.ebc = EmbeddingBagCollection(tables=[config], device=device)
        configs = [
            EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=FEATURES[name])
            for name, rows, dim in TABLES
        ]
        self.ec = EmbeddingCollection(tables=configs, device=device)
        self.dense = torch.nn.Linear(DIM, 1, device=device)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss, the loss detached): TorchRec's train pipelines return the second."""
        users = self.ebc(batch.users) if self.with_users else None
        x = interact(self.ec(batch.sequences), users, batch.labels)
        logits = self.dense(x).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction=self.reduction
        )
        return loss, loss.detach()


def make_batch(seed: int, step: int, rank: int, samples: int = 4) -> Batch:
    """Rank ``rank``'s batch of ``step``: random histories (with repeated ids), one target, tags, a user."""
    gen = torch.Generator().manual_seed(seed * 10_000 + step * 100 + rank)
    lengths = {
        "user": torch.ones(samples, dtype=torch.int64),
        "hist": torch.randint(0, 6, (samples,), generator=gen),
        "target": torch.ones(samples, dtype=torch.int64),
        "tag_hist": torch.randint(0, 4, (samples,), generator=gen),
    }
    rows = {"user": USERS, "hist": 240, "target": 240, "tag_hist": 60}
    values = {}
    for key, n in lengths.items():
        v = torch.randint(0, rows[key], (int(n.sum()),), generator=gen)
        if v.numel() > 3:
            v[:2] = v[2]  # repeated ids: dedup matters
        values[key] = v

    def kjt(keys: list[str]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([values[k] for k in keys]),
            lengths=torch.cat([lengths[k] for k in keys]),
        )

    labels = torch.randint(0, 2, (samples,), generator=gen).float()
    return Batch(kjt(["user"]), kjt(["hist", "target", "tag_hist"]), labels)


def build(
    kind: str,
    optimizer: str,
    plan_path: str | None,
    with_users: bool = True,
    plan_given: bool = True,
    users_optimizer: str | None = None,
    reduction: str = "sum",
):
    """(DMP, combined optimizer) of the test model, weights from torch seed 0 on every rank. ``kind``:
    ``"flexshard"`` (the collection by FlexShardSharder) or ``"torchrec"`` (row-wise by TorchRec's own);
    the bag collection row-wise by TorchRec's (``users_optimizer``, default ``optimizer``). ``plan_given``:
    a ShardingPlan given to DMP, else DMP's planner makes it. ``reduction``: of the loss over a rank's
    samples."""
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = Model(device, with_users, reduction)
    fused = {"optimizer": OPTIMIZERS[optimizer], "learning_rate": LR, "eps": EPS}
    users_fused = {**fused, "optimizer": OPTIMIZERS[users_optimizer or optimizer]}
    if kind == "flexshard":
        ec_sharder = FlexShardSharder(plan_path, orders=orders(), fused_params=fused)
    else:
        ec_sharder = EmbeddingCollectionSharder(fused_params=fused)
    ebc_sharder = EmbeddingBagCollectionSharder(fused_params=users_fused)
    world = dist.get_world_size()
    plan = None
    if plan_given:
        entries = {}
        if kind == "flexshard":
            entries["ec"] = flexshard_module_plan(model.ec, ec_sharder)
        else:
            entries["ec"] = construct_module_sharding_plan(
                model.ec,
                {n: row_wise(compute_kernel="fused") for n, _r, _d in TABLES},
                ec_sharder,
                world,
                world,
                "cpu",
            )
        if with_users:
            entries["ebc"] = construct_module_sharding_plan(
                model.ebc, {"users": row_wise(compute_kernel="fused")}, ebc_sharder, world, world, "cpu"
            )
        plan = ShardingPlan(entries)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=device,
        plan=plan,
        sharders=[ec_sharder, ebc_sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=DENSE_LR),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def full_tables(dmp, kind: str) -> dict[str, torch.Tensor]:
    """Every table of the collection assembled from every rank's rows (collective)."""
    ec = dmp.module.ec
    out = {}
    for name, rows, dim in TABLES:
        if kind == "flexshard":
            mine = [(torch.as_tensor(ids), w.detach().clone()) for ids, w in ec.table_rows(name).values()]
        else:
            st = ec.state_dict()[f"embeddings.{name}.weight"]
            mine = [
                (
                    torch.arange(
                        s.metadata.shard_offsets[0], s.metadata.shard_offsets[0] + s.tensor.shape[0]
                    ),
                    s.tensor,
                )
                for s in st.local_shards()
            ]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        full = torch.full((rows, dim), float("nan"))
        for parts in gathered:
            for ids, w in parts:
                full[ids] = w
        out[name] = full
    return out


# --- what the spawned ranks run ----------------------------------------------------------------------


def train(
    rank: int,
    world: int,
    kind: str,
    optimizer: str,
    plan_path: str | None,
    steps: int,
    pipelined: bool = False,
    plan_given: bool = True,
    with_users: bool = True,
) -> dict:
    """``steps`` training steps of the test model on this rank's batches: the losses, and the
    collection's tables after them (rank 0). ``pipelined``: through TorchRec's TrainPipelineSparseDist."""
    dmp, opt = build(kind, optimizer, plan_path, with_users, plan_given)
    batches = [make_batch(1, s, rank) for s in range(steps)]
    losses = []
    if pipelined:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"), execute_all_batches=True)
        it = iter(batches)
        for _ in range(steps):
            losses.append(float(pipeline.progress(it)))  # the model's second output: its loss
    else:
        for batch in batches:
            opt.zero_grad()
            loss, _logits = dmp(batch)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    tables = full_tables(dmp, kind)
    return {
        "losses": losses,
        "tables": tables if rank == 0 else None,
        "ec": type(dmp.module.ec).__name__,
        "plan": {n: (p.sharding_type, p.compute_kernel) for n, p in dmp.plan.plan["ec"].items()},
        "pipelined": [m.forward.name for m in pipeline._pipelined_modules] if pipelined else None,
    }


def equal_unsharded(rank: int, world: int, plan_path: str) -> dict:
    """The collection alone, sharded by ``FlexShardSharder.shard`` (no DMP) from an unsharded copy:
    outputs on this rank's batch, and the tables after one SGD step (lr 1) of the loss
    ``sum(output * R)`` (R random per rank), against the unsharded collection's gradient averaged over
    the ranks (TorchRec's gradient division)."""
    torch.manual_seed(0)
    configs = [
        EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=FEATURES[name])
        for name, rows, dim in TABLES
    ]
    reference = EmbeddingCollection(tables=configs, need_indices=True)
    module = EmbeddingCollection(tables=configs, need_indices=True)
    module.load_state_dict(reference.state_dict())
    w0 = {name: reference.embeddings[name].weight.detach().clone() for name, _r, _d in TABLES}
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 1.0}
    sharder = FlexShardSharder(plan_path, orders=orders(), fused_params=fused)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharded = sharder.shard(module, flexshard_module_plan(module, sharder), env, torch.device("cpu"), "ec")
    kjt = make_batch(2, 0, rank, samples=16).sequences
    out, want = sharded(kjt).wait(), reference(kjt)
    gen = torch.Generator().manual_seed(100 + rank)
    factors = {k: torch.randn(want[k].values().shape, generator=gen) for k in want}
    loss = sum((out[k].values() * factors[k]).sum() for k in out)
    loss.backward()
    sharded.fused_optimizer.step()
    sum((want[k].values() * factors[k]).sum() for k in want).backward()
    grads = {name: reference.embeddings[name].weight.grad.clone() for name, _r, _d in TABLES}
    for g in grads.values():
        dist.all_reduce(g)
        g.div_(world)
    replicas = {name: sharded.table_rows(name)["hot"][1].clone() for name, _r, _d in TABLES}
    gathered = [None] * world
    dist.all_gather_object(gathered, replicas)
    tables = full_tables(_Holder(sharded), "flexshard")
    return {
        "out": {k: (v.values().detach(), v.lengths(), v.weights()) for k, v in out.items()},
        "want": {k: (v.values().detach(), v.lengths(), v.weights()) for k, v in want.items()},
        "tables": tables,
        "expected": {name: w0[name] - grads[name] for name in w0},
        "grad_terms": {name: g.abs() for name, g in grads.items()},
        "hot_replicas_equal": all(
            torch.equal(gathered[0][n], gathered[r][n]) for r in range(world) for n in replicas
        ),
        "type": type(sharded).__name__,
    }


class _Holder:
    """``full_tables`` reads ``dmp.module.ec``."""

    def __init__(self, ec) -> None:
        self.module = self
        self.ec = ec


def refused(rank: int, world: int, plan_path: str) -> list[tuple[str, str]]:
    """(exception type, message) of two DMP builds refused on this rank: ``plan_path`` (for another
    world size), then this world's plan of other tables (``item`` with 250 rows); then of a step whose
    batch lacks a feature on rank 1."""
    out = []
    for path in (plan_path, plan_path.replace("other-world", "this-world")):
        try:
            if "this-world" in path:
                TABLES[0] = ("item", 250, DIM)  # the model's table differs from the plan's
            build("flexshard", "sgd", path, with_users=False)
            out.append(("built", ""))
        except Exception as e:  # the exception each rank raises is the result
            out.append((type(e).__name__, str(e)))
        finally:
            TABLES[0] = ("item", 240, DIM)
    dmp, _opt = build("flexshard", "sgd", plan_path.replace("other-world", "this-world"), with_users=False)
    batch = make_batch(3, 0, rank)
    if rank == 1:  # one rank's batch lacks a feature
        jt = batch.sequences.to_dict()
        batch.sequences = KeyedJaggedTensor.from_jt_dict({k: jt[k] for k in ("hist", "target")})
    try:
        dmp(batch)
        out.append(("ran", ""))
    except Exception as e:
        out.append((type(e).__name__, str(e)))
    return out


def wire_bytes(rank: int, world: int, workload, topology: str, iterations: int, batch: int, length: int):
    """Bytes per iteration per [link, component, direction] counted by the sharded module over
    ``iterations`` random batches drawn from the workload's row distributions (DMP, the plan made on the
    fly from ``workload`` and ``topology``, bytes objective), and the plan it ran (rank 0)."""
    from flexshard.workloads import sample_ids

    torch.manual_seed(0)
    configs = [
        EmbeddingConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name])
        for t in workload.tables
    ]

    class Seq(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(tables=configs, device=torch.device("meta"))

        def forward(self, kjt: KeyedJaggedTensor) -> dict:
            return self.ec(kjt)

    sharder = FlexShardSharder(stats=workload, topology=topology, objective="bytes", budget=2.0)
    model = Seq()
    plan = ShardingPlan({"ec": flexshard_module_plan(model.ec, sharder)})
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan, sharders=[sharder]
    )
    ec = dmp.module.ec
    rng = np.random.default_rng(1000 + rank)
    total = np.zeros((2, 4, 2))
    keys = [t.name for t in workload.tables]
    for _ in range(iterations):
        values = [torch.as_tensor(sample_ids(t.hist, batch * length, rng)) for t in workload.tables]
        kjt = KeyedJaggedTensor(
            keys=keys, values=torch.cat(values), lengths=torch.full((batch * len(keys),), length)
        )
        out = dmp(kjt)
        sum(jt.values().sum() for jt in out.values()).backward()
        dmp.fused_optimizer.step()
        total += ec.embedding.traffic.bytes
    return total / iterations, (ec.embedding.plan_file.plan if rank == 0 else None)
