"""A SASRec-style sequence recommender on TorchRec, its sequence tables sharded by TorchRec's row-wise
sharding or by FlexShard (``FlexShardSharder``), trained on the same batches from the same weights.

    torchrun --standalone --nproc-per-node 4 docs/examples/sasrec_torchrec.py --sharding torchrec --groups 2
    torchrun --standalone --nproc-per-node 4 docs/examples/sasrec_torchrec.py --sharding flexshard --groups 2

The model: an ``EmbeddingCollection`` with an item table (features ``item_seq``: a user's history, and
``neg_seq``: a sampled negative item per position) and an item-attribute table (``cat_seq``: each history
item's category), an ``EmbeddingBagCollection`` with a user table (data-parallel: a small table,
replicated), and one causal transformer block over the history. Each position scores the next item
against its negative (SASRec's binary cross-entropy). The collection's tables use TorchRec's fused
EXACT_ROWWISE_ADAGRAD in both runs; the dense layers (and the user table) Adam.

The data is synthetic and deterministic, a function of (seed, step, rank): histories of 50-100 items
drawn from a Zipf-like head plus a uniform tail, mapped to ids by a fixed random permutation; each item's
category is fixed; negatives are uniform over the items; users uniform. With ``--stats FILE`` (``flexshard
stats``) each table takes its own table of the file, by name (``--stats-tables``: ``item_id``,
``item_attribute``, ``user_id``): its rows, popularity and hotness order. FlexShard plans on the fly from
these statistics for H100 nodes of ``--groups`` NVLink groups of consecutive ranks, minimising inter-group
bytes (``--objective``), or runs ``--plan`` (a file ``--write-plan`` wrote).

Rank 0 prints per step the loss (mean over ranks) and the bytes the busiest rank moves on each link
class, the larger of what it sends and receives as the cost model counts them (counted by
``flexshard.bench.recorder``: every ``torch.distributed`` collective TorchRec or FlexShard issues; DDP's
gradient all-reduce runs in C++, is not counted, and is the same in both runs), then the mean
inter-group bytes per step beside the cost model's prediction for the run's sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
)
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from core.vocabulary import LinkClass
from flexshard.bench.recorder import recording
from flexshard.plan_file import to_dict, write_plan
from flexshard.runtime.routing import complete_order
from flexshard.torchrec import FlexShardSharder, flexshard_module_plan
from flexshard.workloads import fingerprint, load_stats
from flexshard.workloads.synthetic import sample_ids, zipf_histogram
from solvers.baselines import torchrec_default_report
from solvers.optimizer import OptimizerConfig
from solvers.planner import budget_bytes, make_plan
from solvers.types import RowHistogram, TableSpec, Workload
from topology.presets import h100_cluster
from topology.views import cluster_view

ITEMS, CATEGORIES, USERS, DIM = 20_000, 200, 5_000, 32
LEN_MIN, LEN_MAX = 50, 100  # history length, uniform
ALPHA, HEAD_ROWS, TAIL_MASS = 0.9, 5_000, 0.045  # item popularity: Zipf head + uniform tail
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
DENSE_LR = 1e-3
INTRA, INTER = int(LinkClass.INTRA_GROUP), int(LinkClass.INTER_GROUP)


# --- synthetic data -------------------------------------------------------------------------------


@dataclass
class Batch:
    users: KeyedJaggedTensor  # feature "user": one id per sample
    sequences: KeyedJaggedTensor  # "item_seq", "neg_seq", "cat_seq": history, negatives, categories


@dataclass
class Data:
    """The tables' statistics as the planner sees them (``workload``, per table its hotness ``orders``:
    ids hottest first) and what the batches are drawn from."""

    workload: Workload  # tables "item" (history + negatives) and "category"
    orders: dict[str, np.ndarray]  # full hotness orders: the id of each hotness rank
    history: RowHistogram  # the history items' popularity (hotness ranks)
    category_of: np.ndarray | None  # each item's category; None: drawn from the category popularity
    users: tuple[RowHistogram, np.ndarray] | None  # the user table's popularity and order; None: uniform
    user_rows: int
    seed: int

    def make_batch(self, step: int, rank: int) -> Batch:
        """Rank ``rank``'s batch of ``step`` (deterministic)."""
        batch = self.workload.batch_size_per_gpu
        rng = np.random.default_rng((self.seed, step, rank))
        lengths = torch.from_numpy(rng.integers(LEN_MIN, LEN_MAX + 1, batch))
        n = int(lengths.sum())
        items = self.orders["item"][sample_ids(self.history, n, rng)]  # hotness rank -> id
        negatives = rng.integers(0, self.workload.tables[0].num_rows, n)
        if self.category_of is not None:
            categories = self.category_of[items]
        else:
            categories = self.orders["category"][sample_ids(self.workload.tables[1].hist, n, rng)]
        sequences = KeyedJaggedTensor(
            keys=["item_seq", "neg_seq", "cat_seq"],
            values=torch.from_numpy(np.concatenate([items, negatives, categories])),
            lengths=torch.cat([lengths, lengths, lengths]),
        )
        if self.users is None:
            user_ids = rng.integers(0, self.user_rows, batch)
        else:
            user_ids = self.users[1][sample_ids(self.users[0], batch, rng)]
        users = KeyedJaggedTensor(
            keys=["user"],
            values=torch.from_numpy(user_ids),
            lengths=torch.ones(batch, dtype=torch.int64),
        )
        return Batch(users, sequences)


STATS_TABLES = "item_id,item_attribute,user_id"  # the tables of `flexshard stats` on SASRec's data


def make_data(batch: int, seed: int, stats: str | None, names: str = STATS_TABLES) -> Data:
    """The item, category and user tables, synthetic or (``stats``) the stats file's tables ``names``
    (item, category, user). The item table serves a history and as many uniform negatives, so per lookup
    its rows follow the half-and-half mixture; every table's lookups are independent draws, as the cost
    model takes them. The user table is data-parallel (not in the planner's workload)."""
    users, user_rows = None, USERS
    if stats is None:
        history, item_ids, category_hist, category_ids, category_of = synthetic_tables(seed)
    else:
        history, item_ids, category_hist, category_ids, users = stats_tables(stats, names)
        category_of, user_rows = None, users[0].num_rows
    items = history.num_rows
    lengths = np.arange(LEN_MIN, LEN_MAX + 1)
    pmf = np.full(lengths.size, 1.0 / lengths.size)
    mixture = RowHistogram(history.rows, 0.5 * history.prob + 0.5 / items)  # history + negatives
    item = TableSpec(
        "item", items, DIM, 2 * lengths.mean(), mixture, length_values=2 * lengths, length_probs=pmf
    )
    category = TableSpec(
        "category",
        category_hist.num_rows,
        DIM,
        lengths.mean(),
        category_hist,
        length_values=lengths,
        length_probs=pmf,
    )
    orders = {"item": item_ids, "category": category_ids}
    workload = Workload("sasrec", (item, category), batch).with_orders(orders)
    return Data(workload, orders, history, category_of, users, user_rows, seed)


def synthetic_tables(seed: int) -> tuple:
    """History items: Zipf(ALPHA) over HEAD_ROWS plus a uniform tail, ids a random permutation of the
    hotness ranks; a fixed random category per item, so a category's probability is its items' total."""
    rng = np.random.default_rng(seed)
    history = zipf_histogram(ITEMS, ALPHA, TAIL_MASS, head_rows=HEAD_ROWS)
    item_ids = rng.permutation(ITEMS)  # the id of each hotness rank
    category_of = rng.integers(0, CATEGORIES, ITEMS)
    per_rank = np.repeat(history.prob, history.rows)  # a history item's probability, per hotness rank
    per_category = np.bincount(category_of[item_ids], weights=per_rank, minlength=CATEGORIES)
    category_ids = np.argsort(-per_category, kind="stable")
    return history, item_ids, RowHistogram.from_counts(per_category), category_ids, category_of


def stats_tables(path: str, names: str = STATS_TABLES) -> tuple:
    """The stats file's (``flexshard stats``) tables ``names`` ("item,category,user", e.g. Amazon
    Beauty's item_id, item_attribute and user_id) as the item, category and user tables, each with its own
    rows, popularity and full hotness order: (item popularity, item order, category popularity, category
    order, (user popularity, user order))."""
    workload, orders = load_stats(path)
    tables = {t.name: t for t in workload.tables}
    wanted = names.split(",")
    if len(wanted) != 3 or len(set(wanted)) != 3:
        raise SystemExit(f"--stats-tables: three different names (item,category,user), got {names!r}")
    missing = [n for n in wanted if n not in tables]
    if missing:
        have = ", ".join(tables)
        raise SystemExit(f"--stats-tables: {path} has no table {missing[0]!r} (its tables: {have})")
    item, category, user = (tables[n] for n in wanted)
    ids = [complete_order(orders.get(t.name), t.num_rows, t.name) for t in (item, category, user)]
    return item.hist, ids[0], category.hist, ids[1], (user.hist, ids[2])


# --- the model ------------------------------------------------------------------------------------


class SASRec(nn.Module):
    def __init__(self, items: int, categories: int, users: int) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    num_embeddings=items,
                    embedding_dim=DIM,
                    name="item",
                    feature_names=["item_seq", "neg_seq"],
                ),
                EmbeddingConfig(
                    num_embeddings=categories, embedding_dim=DIM, name="category", feature_names=["cat_seq"]
                ),
            ]
        )
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="user", embedding_dim=DIM, num_embeddings=users, feature_names=["user"]
                )
            ]
        )
        self.position = nn.Embedding(LEN_MAX, DIM)
        self.block = nn.TransformerEncoderLayer(
            DIM, nhead=2, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True
        )
        self.norm = nn.LayerNorm(DIM)

    def forward(self, batch: Batch) -> torch.Tensor:
        """The next-item loss of the batch (mean over its positions that have a next item)."""
        seq = self.ec(batch.sequences)  # Dict[str, JaggedTensor]: a DIM vector per id
        user = self.ebc(batch.users)["user"]  # [batch, DIM]
        return next_item_loss(seq["item_seq"], seq["neg_seq"], seq["cat_seq"], user, self)


def next_item_loss(
    items: JaggedTensor, negatives: JaggedTensor, cats: JaggedTensor, user: torch.Tensor, m: SASRec
) -> torch.Tensor:
    """SASRec's loss: at each position followed by an item, ``-log s(h.e_next) - log s(-h.e_neg)``."""
    lengths = items.lengths()
    width = int(lengths.max())
    item_vecs = items.to_padded_dense(width)  # [batch, width, DIM], zeros past each history
    x = item_vecs + cats.to_padded_dense(width) + m.position.weight[:width] + user[:, None]
    steps = torch.arange(width)
    causal = steps[None, :] > steps[:, None]  # True: may not attend (a later position)
    padding = steps[None, :] >= lengths[:, None]
    h = m.norm(m.block(x, src_mask=causal, src_key_padding_mask=padding))
    has_next = steps[None, :-1] < (lengths - 1)[:, None]  # positions followed by an item
    queries = h[:, :-1][has_next]  # [M, DIM]
    positive = (queries * item_vecs[:, 1:][has_next]).sum(1)  # the next item's score
    negative = (queries * negatives.to_padded_dense(width)[:, :-1][has_next]).sum(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    return bce(positive, torch.ones_like(positive)) + bce(negative, torch.zeros_like(negative))


# --- sharding -------------------------------------------------------------------------------------


def shard(
    model: SASRec, sharding: str, data: Data, groups: int, plan: str | None, objective: str
) -> DistributedModelParallel:
    """DMP over the job's ranks: the collection row-wise by TorchRec, or by FlexShard's plan; the user
    table data-parallel by TorchRec in both."""
    world = dist.get_world_size()
    if sharding == "flexshard":
        if plan is not None:
            ec_sharder = FlexShardSharder(plan, orders=data.orders, fused_params=FUSED)
        else:  # planned on rank 0 when DMP shards the collection, for H100 nodes of `groups` groups
            ec_sharder = FlexShardSharder(
                stats=data.workload,
                groups=groups,
                orders=data.orders,
                objective=objective,
                fused_params=FUSED,
            )
        ec_plan = flexshard_module_plan(model.ec, ec_sharder)
    else:
        ec_sharder = EmbeddingCollectionSharder(fused_params=FUSED)
        ec_plan = construct_module_sharding_plan(
            model.ec,
            {"item": row_wise(compute_kernel="fused"), "category": row_wise(compute_kernel="fused")},
            ec_sharder,
            world,
            world,
            "cpu",
        )
    ebc_sharder = EmbeddingBagCollectionSharder(fused_params=FUSED)
    ebc_plan = construct_module_sharding_plan(
        model.ebc, {"user": data_parallel()}, ebc_sharder, world, world, "cpu"
    )
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ec": ec_plan, "ebc": ebc_plan}),
        sharders=[ec_sharder, ebc_sharder],
    )


def write_plan_file(path: str, data: Data, world: int, groups: int, objective: str) -> None:
    """The plan FlexShardSharder makes on the fly for this job (H100 nodes of ``groups`` groups, 2x
    row-wise memory, minimising ``objective``), written as a plan file for ``--plan``."""
    view = cluster_view(h100_cluster(groups, world // groups))
    w = data.workload
    config = OptimizerConfig(step_time=objective == "step")
    made = make_plan("flexshard", w, view, budget_bytes(w, view, 2.0), config=config)
    write_plan(path, to_dict(made.plan, w, view, made.report, fingerprint(w), data.orders))


def predicted_inter_bytes(dmp: DistributedModelParallel, sharding: str, data: Data, groups: int) -> dict:
    """The cost model's inter-group bytes per step of the busiest rank: FlexShard's plan's (its report)
    and TorchRec row-wise's for the same workload (contiguous id ranges, no dedup)."""
    world = dist.get_world_size()
    view = cluster_view(h100_cluster(groups, world // groups))
    out = {"torchrec_row_wise": torchrec_default_report(data.workload, view).inter_group_bytes}
    if sharding == "flexshard":
        out["flexshard_plan"] = float(dmp.module.ec.embedding.plan_file.predicted["inter_group_bytes"])
    return out


# --- training -------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sharding", choices=("torchrec", "flexshard"), default="flexshard")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--groups", type=int, default=2, help="NVLink groups of consecutive ranks (emulated)")
    p.add_argument(
        "--plan",
        default=None,
        help="a plan file for these tables (item, category), as --write-plan writes; else planned on the fly",
    )
    p.add_argument("--objective", choices=("bytes", "step"), default="bytes", help="what the plan minimises")
    p.add_argument("--stats", default=None, help="a stats file (flexshard stats); else synthetic tables")
    p.add_argument(
        "--stats-tables",
        default=STATS_TABLES,
        help=f"the stats file's item, category and user tables (default {STATS_TABLES})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="rank 0 writes the per-step figures and the summary here")
    p.add_argument("--write-plan", default=None, help="write the plan made on the fly here and exit")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.groups <= 0 or world % args.groups:
        raise SystemExit(f"--groups: must divide the {world} ranks, got {args.groups}")
    torch.set_num_threads(1)
    data = make_data(args.batch, args.seed, args.stats, args.stats_tables)
    if args.write_plan:
        if rank == 0:
            write_plan_file(args.write_plan, data, world, args.groups, args.objective)
            print(f"wrote {args.write_plan}: the plan for {world} ranks in {args.groups} groups")
        dist.destroy_process_group()
        return
    torch.manual_seed(args.seed)  # the unsharded model's weights: the same in both runs
    model = SASRec(*(t.num_rows for t in data.workload.tables), data.user_rows)
    users = {k: v.detach().clone() for k, v in model.ebc.state_dict().items()}
    # DMP keeps the collection's rows (both shardings); the user table is restored below
    dmp = shard(model, args.sharding, data, args.groups, args.plan, args.objective)
    dmp.module.ebc.load_state_dict(users)  # TorchRec re-initialises data-parallel tables: restore them
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda ps: torch.optim.Adam(ps, lr=DENSE_LR),
    )
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])

    steps = []
    if rank == 0:
        print(f"{args.sharding}: {world} ranks in {args.groups} groups, batch {args.batch} per rank")
        if args.sharding == "flexshard":
            for t in dmp.module.ec.embedding.plan_file.plan.tables:
                tiers = f"{t.hot_rows:,} hot, {t.warm_rows:,} warm, {t.cold_rows:,} cold rows"
                print(f"  plan: {t.name}: {tiers}, cold fetch {t.fetch.value}")
        header = f"{'step':>4} {'loss':>10} {'intra-group B':>14} {'inter-group B':>14}"
        print(header + "  (busiest rank, max of sent and received)")
    for step in range(args.steps):
        batch = data.make_batch(step, rank)
        with recording(world // args.groups) as rec:  # every collective this rank issues in the step
            opt.zero_grad()
            loss = dmp(batch)
            loss.backward()
            opt.step()
        moved = np.maximum(rec.bytes_sent, rec.bytes_received)  # per link class, B
        mine = torch.tensor([loss.item(), moved[INTRA], moved[INTER]], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        every = torch.stack(every)
        record = {
            "step": step,
            "loss": float(every[:, 0].mean()),
            "rank_losses": every[:, 0].tolist(),
            "intra_bytes": float(every[:, 1].max()),
            "inter_bytes": float(every[:, 2].max()),
            "collectives": dict(sorted(rec.counts.items())),  # rank 0's (every rank issues the same)
        }
        steps.append(record)
        if rank == 0:
            intra, inter = record["intra_bytes"], record["inter_bytes"]
            print(f"{step:>4} {record['loss']:>10.6f} {intra:>14,.0f} {inter:>14,.0f}")

    predicted = predicted_inter_bytes(dmp, args.sharding, data, args.groups)
    measured = float(np.mean([s["inter_bytes"] for s in steps]))
    if rank == 0:
        said = f"{args.sharding}: mean inter-group bytes per step (busiest rank) {measured:,.0f} measured"
        if "flexshard_plan" in predicted:
            said += f", FlexShard's plan predicts {predicted['flexshard_plan']:,.0f}"
        print(f"{said}; TorchRec row-wise predicted {predicted['torchrec_row_wise']:,.0f}")
        calls = ", ".join(f"{kind} {n}" for kind, n in steps[-1]["collectives"].items())
        print(f"{args.sharding}: collectives in the last step (DDP's own all-reduce not seen): {calls}")
        if args.json:
            rows = {t.name: t.num_rows for t in data.workload.tables} | {"user": data.user_rows}
            record = {"sharding": args.sharding, "world": world, "groups": args.groups, "batch": args.batch,
                      "table_rows": rows, "steps": steps, "measured_inter_bytes": measured,
                      "predicted_inter_bytes": predicted}  # fmt: skip
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every rank has destroyed its process group: leave without the interpreter's teardown, which can
    # race gloo's worker threads and abort a rank after its work (SIGABRT, "terminate called without
    # an active exception"; pytorch/pytorch#65231). FlexShard's spawned ranks end the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
