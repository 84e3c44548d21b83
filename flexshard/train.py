"""``flexshard train``: train the sequence recommendation model (:mod:`flexshard.model`) with its
embedding tables sharded by a FlexShard plan.

Run under a launcher (``torchrun --nproc-per-node N -m flexshard.train ...``: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT come from the environment; gloo on CPU, NCCL when CUDA is
available) or as a single process (world size 1).

Data: ``--data PATH``, a ``user item item ...`` sequence file (e.g. ``amazon-yelp-sequences/
Beauty.txt``) whose workload and hotness orders come from
:func:`flexshard.workloads.load_workload_with_orders`; its tables ``item_id`` (history and candidates)
and ``user_id`` (one per sample) are used. Without ``--data``: an embedded synthetic workload, tables
``item`` (50,000 rows) and ``creator`` (5,000 rows, 10 items each) with a Zipf head (alpha 0.9 over
the hottest 10% of items) plus a 5% uniform tail, history lengths uniform in ``1..max_len``. Batches
are deterministic in ``(seed, step, rank)``: sample ``i`` of a rank's batch is a user (or synthetic
history), a cut point and ``--negatives`` random items.

Plan: ``--plan PATH`` (a plan file) or planned on the fly by ``solvers.planner.make_plan`` with
``--strategy`` (default ``flexshard``; or a baseline such as ``row_wise``: every row cold, split
evenly over all ranks) for ``uniform_view(G, world / G)`` (``--groups G`` emulates G NVLink domains
of consecutive ranks) at ``--budget`` times row-wise memory (on rank 0, then broadcast).
``--strategy`` and ``--plan`` are exclusive. A plan file may cover more tables than the model uses (a
plan made from ``flexshard stats`` of the same data also has its ``item_attribute`` table): those
entries are dropped, and its predicted metrics still describe the whole plan.

Gradients: each rank's loss is its batch mean divided by the world size; embedding rows get the sum
over ranks (the module's semantics) and dense gradients are all-reduced with SUM, so both follow the
mean loss over the global batch. Dense parameters use element-wise SGD / Adagrad
(:class:`flexshard.model.DenseOptimizer`, ``torch.optim``'s math) with the same learning rate as the
row-wise embedding optimizer.

``--verify``: every rank also trains an unsharded reference (full tables from the same initializer
or checkpoint, row-wise SGD / Adagrad written out again, a copy of the dense model and optimizer) on
every rank's batch (all-gathered), and compares its logits with the reference's each step and, after
the last step, every row (weights and optimizer state) of every copy it holds and the dense
parameters, within ``1e-5 * (1 + |reference|)`` (absolute up to 1, relative beyond: logits grow as
training goes on, and GPU ``index_add_`` sums in a nondeterministic order). The first mismatch
ends the run on every rank with exit status 1 and a ``verify: FAILED ...`` line; success prints
``verify: OK (N steps, all rows of all copies match)``.

``--metrics-out PATH``: rank 0 writes a JSON Lines file: a ``header`` record (run config, world,
groups, data, the plan's strategy, tier sizes per table and the cost model's ``predicted`` metrics
from the plan), one ``step`` record per step (``loss``: the global mean loss printed on the step
line; ``elapsed_s``: the slowest rank's step time in seconds; ``bytes``: this step's bytes per rank
per link class, ``max(send, recv)`` summed over components, as ``{"max": ..., "mean": ...}`` over
ranks; ``bytes_by_component``: the same per link class and component ``ids`` / ``forward`` /
``backward`` / ``sync`` (``max(send, recv)`` of that component alone)), and an ``end`` record (steps
run, verify outcome). The file is written at the end (temporary file + rename): a failed run leaves
no file, or the previous one unchanged.

Exit status: 0 success, 1 verification failure, 2 bad input (one ``flexshard train: error:`` line).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional

from flexshard import checkpoint
from flexshard.cli_common import first_line
from flexshard.model import OBJECTIVES, Batch, DenseOptimizer, SequenceRecModel, batch_logits, lookup_features
from flexshard.plan_file import PlanFile, read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding, emulated_groups, seeded_initializer
from flexshard.runtime.routing import LAYOUTS
from flexshard.runtime.sharded import OPTIMIZERS
from solvers.planner import STRATEGIES, budget_bytes, make_plan
from solvers.types import COMPONENTS, LINK_CLASSES, PlannerError, RowHistogram, TableSpec, Workload
from topology.io import atomic_open
from topology.views import uniform_view

TOLERANCE = 1e-5
INTRA_BW_BPS, INTER_BW_BPS = 450e9, 50e9  # NVLink-class / 400 Gb/s NIC-class links for planning
SYN_ITEMS, SYN_ITEMS_PER_CREATOR, SYN_ALPHA, SYN_HEAD, SYN_TAIL = 50_000, 10, 0.9, 5_000, 0.05


class VerifyError(Exception):
    """A mismatch between the sharded run and the reference (exit status 1)."""


# --- data -------------------------------------------------------------------------------------------


class SyntheticSource:
    """The embedded synthetic workload (module docstring)."""

    name = "synthetic"

    def __init__(self, dim: int, max_len: int, negatives: int, batch_size: int, seed: int) -> None:
        self.dim, self.max_len, self.negatives, self.batch_size, self.seed = (
            dim,
            max_len,
            negatives,
            batch_size,
            seed,
        )
        p = np.full(SYN_ITEMS, SYN_TAIL / SYN_ITEMS)
        head = np.arange(1, SYN_HEAD + 1, dtype=np.float64) ** -SYN_ALPHA
        p[:SYN_HEAD] += (1 - SYN_TAIL) * head / head.sum()
        self.pmf = p / p.sum()
        self.cdf = np.cumsum(self.pmf)
        self.seq_tables = ["item", "creator"]
        self.user_table = None
        self.orders: dict[str, np.ndarray] = {}  # rows are numbered hottest first
        creators = SYN_ITEMS // SYN_ITEMS_PER_CREATOR
        self.tables = [("item", SYN_ITEMS, dim), ("creator", creators, dim)]

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(n), side="right"), SYN_ITEMS - 1)

    def batch(self, step: int, rank: int) -> Batch:
        rng = np.random.default_rng([self.seed, step, rank, 1])
        b = self.batch_size
        lengths = rng.integers(1, self.max_len + 1, b).astype(np.int64)
        items = self._draw(rng, int(lengths.sum()))
        cand = np.concatenate(
            [self._draw(rng, b)[:, None], rng.integers(0, SYN_ITEMS, (b, self.negatives))], axis=1
        ).astype(np.int64)
        per = SYN_ITEMS_PER_CREATOR
        return Batch(
            lengths, {"item": items, "creator": items // per}, {"item": cand, "creator": cand // per}
        )

    def workload(self) -> Workload:
        mean_hist = (self.max_len + 1) / 2
        ids = mean_hist + 1 + self.negatives
        mix = ((mean_hist + 1) * self.pmf + self.negatives / SYN_ITEMS) / ids  # history + target + negatives
        per_creator = mix.reshape(-1, SYN_ITEMS_PER_CREATOR).sum(1)
        specs = [
            TableSpec(name, rows, dim, ids, RowHistogram.from_counts(p))
            for (name, rows, dim), p in zip(self.tables, (mix, per_creator), strict=True)
        ]
        return Workload("train-synthetic", tuple(specs), self.batch_size)

    def describe(self) -> str:
        return "synthetic (" + ", ".join(f"{n} {r:,} x {d}" for n, r, d in self.tables) + ")"


class SequenceFileSource:
    """A ``user item item ...`` file: tables ``item_id`` (history + candidates) and ``user_id``."""

    def __init__(self, path: str, dim: int, max_len: int, negatives: int, batch_size: int, seed: int) -> None:
        from flexshard.workloads import detect_format, load_workload_with_orders
        from flexshard.workloads.readers import ITEM_TABLE, USER_TABLE

        self.path, self.dim, self.max_len, self.negatives = Path(path), dim, max_len, negatives
        self.batch_size, self.seed, self.name = batch_size, seed, Path(path).name
        if not self.path.is_file():
            raise PlannerError(f"--data: {path}: no such file")
        fmt = detect_format(self.path)
        if fmt != "seq":
            raise PlannerError(
                f"--data: {path}: train reads 'user item item ...' sequence files, got {fmt!r}"
            )
        workload, orders = load_workload_with_orders(self.path, dim=dim, batch_size_per_gpu=batch_size)
        specs = {t.name: t for t in workload.tables}
        self.seq_tables, self.user_table = [ITEM_TABLE], USER_TABLE
        keep = [specs[ITEM_TABLE], specs[USER_TABLE]]
        self._workload = Workload(f"train-{self.path.stem}", tuple(keep), batch_size)
        self.orders = {t.name: orders[t.name] for t in keep if t.name in orders}
        self.tables = [(t.name, t.num_rows, t.dim) for t in keep]
        users, lengths, items = [], [], []
        with open(self.path) as f:
            for line in f:
                tok = line.split()
                if len(tok) >= 3:  # a user and at least two items: one history item and a target
                    users.append(int(tok[0]))
                    lengths.append(len(tok) - 1)
                    items.extend(int(x) for x in tok[1:])
        if not users:
            raise PlannerError(f"--data: {path}: no user with at least two items")
        self.users = np.asarray(users, dtype=np.int64)
        self.seq_len = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.seq_len)[:-1]])
        self.items = np.asarray(items, dtype=np.int64)
        touched = self.orders.get(ITEM_TABLE)
        self.negative_pool = (
            np.sort(touched) if touched is not None and touched.size else np.unique(self.items)
        )

    def batch(self, step: int, rank: int) -> Batch:
        rng = np.random.default_rng([self.seed, step, rank, 2])
        b = self.batch_size
        s = rng.integers(0, self.users.size, b)
        n = self.seq_len[s]
        cut = 1 + np.floor(rng.random(b) * (n - 1)).astype(np.int64)  # target position, 1..n-1
        start = np.maximum(cut - self.max_len, 0)
        lengths = cut - start
        hist = np.concatenate(
            [
                self.items[self.offsets[i] + a : self.offsets[i] + c]
                for i, a, c in zip(s, start, cut, strict=True)
            ]
        )
        target = self.items[self.offsets[s] + cut]
        neg = self.negative_pool[rng.integers(0, self.negative_pool.size, (b, self.negatives))]
        cand = np.concatenate([target[:, None], neg], axis=1).astype(np.int64)
        return Batch(
            lengths.astype(np.int64), {self.seq_tables[0]: hist}, {self.seq_tables[0]: cand}, self.users[s]
        )

    def workload(self) -> Workload:
        return self._workload

    def describe(self) -> str:
        return f"{self.path} (" + ", ".join(f"{n} {r:,} x {d}" for n, r, d in self.tables) + ")"


# --- reference ----------------------------------------------------------------------------------------


def make_dense_optimizer(name: str, params, lr: float) -> DenseOptimizer:
    return DenseOptimizer(params, name, lr)


class Reference:
    """Unsharded single-process training with the same math: full tables (``functional.embedding``), row-wise
    SGD / Adagrad on the rows any rank touched, a copy of the dense model and its optimizer."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        dense: SequenceRecModel,
        dense_opt_state: dict | None,
        optimizer: str,
        lr: float,
        eps: float,
        user_table: str | None,
        device: torch.device,
    ) -> None:
        self.weights = {n: w.to(device).clone().requires_grad_(True) for n, w in weights.items()}
        self.state = {n: s.to(device).clone() for n, s in state.items()}
        self.dense = copy.deepcopy(dense)
        self.dense_opt = make_dense_optimizer(optimizer, self.dense.parameters(), lr)
        if dense_opt_state is not None:
            self.dense_opt.load_state_dict(dense_opt_state)
        self.optimizer, self.lr, self.eps, self.user_table, self.device = (
            optimizer,
            lr,
            eps,
            user_table,
            device,
        )

    def step(self, batches: list[Batch]) -> list[torch.Tensor]:
        """One step on all ranks' batches (loss = sum over ranks of batch mean / world); the logits
        of each rank's batch."""
        world = len(batches)
        self.dense_opt.zero_grad()
        total, outs, used = None, [], {n: [] for n in self.weights}
        for b in batches:
            feats = lookup_features(b, self.user_table, self.device)
            emb = {n: functional.embedding(v, self.weights[n]) for n, (v, _l) in feats.items()}
            for n, (v, _l) in feats.items():
                used[n].append(v)
            logits = batch_logits(self.dense, emb, b, self.user_table)
            outs.append(logits.detach())
            loss = self.dense.loss(logits) / world
            total = loss if total is None else total + loss
        total.backward()
        with torch.no_grad():
            for n, w in self.weights.items():
                g_full = w.grad if w.grad is not None else torch.zeros_like(w)
                rows = torch.unique(torch.cat(used[n])) if used[n] else torch.zeros(0, dtype=torch.int64)
                g = g_full[rows]
                if self.optimizer == "sgd":
                    w[rows] = w[rows] - self.lr * g
                else:
                    s = self.state[n]
                    s[rows] = s[rows] + g.pow(2).mean(dim=1)
                    w[rows] = w[rows] - self.lr * g / (s[rows].sqrt().unsqueeze(1) + self.eps)
                w.grad = None
        self.dense_opt.step()
        return outs


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max ``|a - b| / (1 + |b|)``: an absolute difference for values up to 1, relative beyond."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float(((a - b).abs() / (1 + b.abs())).max())


# --- distributed setup -----------------------------------------------------------------------------


def _init_distributed() -> tuple[bool, torch.device]:
    """Init the default process group from the launcher's environment (or a world of 1); returns
    (whether this call created it, the device)."""
    cuda = torch.cuda.is_available()
    created = False
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, init_method="env://")
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        created = True
    if dist.get_backend() == "nccl":
        return created, torch.device("cuda", torch.cuda.current_device())
    return created, torch.device("cpu")


def _plan(args, source, world: int, rank: int) -> PlanFile:
    """Load ``--plan`` or plan on rank 0 and broadcast the plan document (every rank reads it back)."""
    if args.plan:
        plan_file = read_plan(args.plan)
        if args.groups is not None and args.groups != len(plan_file.groups):
            raise PlannerError(f"--groups {args.groups}: the plan file has {len(plan_file.groups)} groups")
        return _model_tables(plan_file, [name for name, _rows, _dim in source.tables])
    groups = 1 if args.groups is None else args.groups
    emulated_groups(world, groups)  # checks that groups divide the world size
    doc: list = [None]
    if rank == 0:
        try:
            workload = source.workload()
            view = uniform_view(groups, world // groups, INTRA_BW_BPS, INTER_BW_BPS)
            planned = make_plan(
                args.strategy or "flexshard",
                workload,
                view,
                budget_bytes(workload, view, args.budget),
                args.dedup,
                "sparse",
            )
            from flexshard.workloads import fingerprint

            doc[0] = to_dict(planned.plan, workload, view, planned.report, fingerprint(workload))
        except ValueError as e:
            doc[0] = {"error": str(e)}
    dist.broadcast_object_list(doc, src=0)
    if "error" in doc[0]:
        raise PlannerError(f"plan: {doc[0]['error']}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        write_plan(path, doc[0])
        return read_plan(path)


def _model_tables(plan_file: PlanFile, names: list[str]) -> PlanFile:
    """The plan restricted to the model's tables, in the model's order. A plan made from the whole data
    set (``flexshard stats`` adds e.g. an ``item_attribute`` table the model does not use) covers more
    tables; their entries are dropped. A model table the plan lacks is left for the module's check."""
    by_name = {t.name: t for t in plan_file.plan.tables}
    if set(by_name) == set(names) or not set(names) <= set(by_name):
        return plan_file
    plan = replace(plan_file.plan, tables=tuple(by_name[n] for n in names))
    return replace(plan_file, plan=plan)


def _allreduce_dense_grads(model: torch.nn.Module, world: int) -> None:
    params = list(model.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if world == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(part.view_as(p.grad))


def _agree_message(message: str) -> str:
    """The first non-empty message over the ranks (collective), or ''."""
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1 if message else 0], dtype=torch.int64, device=dev)
    dist.all_reduce(flag)
    if not int(flag.item()):
        return ""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    return next(m for m in everyone if m)


# --- the run -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flexshard train", description=__doc__.splitlines()[0])
    p.add_argument("--data", help="a 'user item item ...' sequence file (default: embedded synthetic data)")
    p.add_argument("--plan", help="a plan file (default: plan on the fly with make_plan)")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=None,
        help="strategy when planning on the fly (default flexshard; not with --plan)",
    )
    p.add_argument(
        "--groups", type=int, default=None, help="emulated groups of consecutive ranks (default 1)"
    )
    p.add_argument(
        "--budget", type=float, default=2.0, help="per-GPU budget, multiple of row-wise (default 2)"
    )
    p.add_argument("--steps", type=int, default=20, help="total training steps (default 20)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank and step (default 64)")
    p.add_argument(
        "--lr", type=float, default=0.05, help="learning rate, embeddings and dense (default 0.05)"
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad", help="default adagrad (row-wise)")
    p.add_argument(
        "--dedup", action=argparse.BooleanOptionalAction, default=True, help="dedup ids (default on)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=16, help="embedding dim of every table (default 16)")
    p.add_argument("--max-len", type=int, default=20, help="history positions kept (default 20)")
    p.add_argument("--negatives", type=int, default=4, help="random negatives per sample (default 4)")
    p.add_argument("--objective", choices=OBJECTIVES, default="next-item")
    p.add_argument(
        "--verify", action="store_true", help="compare with an unsharded reference (exit 1 on mismatch)"
    )
    p.add_argument("--checkpoint-dir", help="folder of sharded checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: at the end only)")
    p.add_argument(
        "--resume", action="store_true", help="resume from the latest checkpoint in --checkpoint-dir"
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="exact",
        help="routing layout: exact (per-row arrays) or compact (for very large tables; default exact)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument(
        "--metrics-out",
        help="rank 0 writes per-step loss and bytes per link class / component here (JSON Lines)",
    )
    return p


def _check_args(args) -> None:
    for name in ("steps", "batch_size", "dim", "max_len"):
        if getattr(args, name) <= 0:
            raise PlannerError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if args.negatives < 0 or args.checkpoint_every < 0:
        raise PlannerError("--negatives and --checkpoint-every must be >= 0")
    if not args.lr > 0 or not args.budget > 0:
        raise PlannerError("--lr and --budget must be positive")
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        raise PlannerError("--resume and --checkpoint-every need --checkpoint-dir")
    if args.plan and args.strategy is not None:
        raise PlannerError("--strategy and --plan are exclusive (--strategy plans on the fly)")


def run(args) -> int:
    _check_args(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    out = print if rank == 0 else (lambda *a, **k: None)
    src_args = (args.dim, args.max_len, args.negatives, args.batch_size, args.seed)
    source = SequenceFileSource(args.data, *src_args) if args.data else SyntheticSource(*src_args)
    if args.metrics_out:
        problem = _check_metrics_path(args.metrics_out) if rank == 0 else ""
        problem = _agree_message(problem)
        if problem:
            raise PlannerError(problem)
    plan_file = _plan(args, source, world, rank)

    torch.manual_seed(args.seed)
    dense = SequenceRecModel(args.dim, args.max_len, args.objective).to(device)
    for p in dense.parameters():  # same initial weights everywhere (already equal by seed)
        dist.broadcast(p.data, src=0)
    dense_opt = make_dense_optimizer(args.optimizer, dense.parameters(), args.lr)
    module = ShardedSequenceEmbedding(
        plan_file,
        source.tables,
        source.orders,
        init=args.seed,
        optimizer=args.optimizer,
        lr=args.lr,
        dedup=args.dedup,
        device=device,
        layout=args.layout,
    )
    start = 0
    resumed_from = None
    if args.resume:
        found = checkpoint.latest(args.checkpoint_dir)
        if found is not None:
            start = checkpoint.load(found, module, dense, dense_opt)
            resumed_from = found
            out(f"resume: {found} (step {start})")
        else:
            out(f"resume: no checkpoint in {args.checkpoint_dir}, starting at step 0")
    out(
        f"train: world {world} ({len(plan_file.groups)} groups of {world // len(plan_file.groups)}), "
        f"backend {dist.get_backend()}, device {device}, data {source.describe()}"
    )
    out(
        f"plan ({plan_file.plan.strategy}): "
        + ", ".join(
            f"{t.name} hot/warm/cold {t.hot_rows}/{t.warm_rows}/{t.cold_rows}" for t in plan_file.plan.tables
        )
        + f"; optimizer {args.optimizer}, lr {args.lr}, dedup {'on' if args.dedup else 'off'}, "
        f"batch {args.batch_size} per rank, objective {args.objective}, layout {args.layout}"
    )

    records: list[dict] = []
    if args.metrics_out:
        records.append(_header_record(args, world, source, plan_file, device, start))

    reference = None
    if args.verify:
        if resumed_from is not None:
            full = checkpoint.load_full(resumed_from)
            ref_w, ref_s = full.weights, full.state
        else:
            init = seeded_initializer(args.seed)
            ref_w = {n: init(n, np.arange(r), d) for n, r, d in source.tables}
            ref_s = {n: torch.zeros(r) for n, r, _d in source.tables}
        reference = Reference(
            ref_w, ref_s, dense, copy.deepcopy(dense_opt.state_dict()), args.optimizer, args.lr,
            module.eps, source.user_table, device,
        )  # fmt: skip

    for step in range(start, args.steps):
        batch = source.batch(step, rank)
        t0 = time.perf_counter()
        emb = module(lookup_features(batch, source.user_table, device))
        logits = batch_logits(dense, emb, batch, source.user_table)
        loss = dense.loss(logits) / world
        dense_opt.zero_grad()
        loss.backward()
        _allreduce_dense_grads(dense, world)
        dense_opt.step()
        module.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        link = module.link_bytes()
        stats = torch.tensor(
            [float(loss.detach()), link["intra_group"], link["inter_group"], elapsed], device=device
        )
        loss_sum = stats[:1].clone()
        dist.all_reduce(loss_sum)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if args.metrics_out:
            records.append(_step_record(step + 1, float(loss_sum), elapsed, module.traffic, world, device))
        if not args.quiet:
            out(
                f"step {step + 1}/{args.steps} loss {float(loss_sum):.6f} "
                f"samples/s {world * args.batch_size / max(float(stats[3]), 1e-9):,.0f} "
                f"intra_group {float(stats[1]):,.0f} B inter_group {float(stats[2]):,.0f} B (max over ranks)"
            )
        if reference is not None:
            batches: list = [None] * world
            dist.all_gather_object(batches, batch)
            ref_logits = reference.step(batches)
            diff = _max_diff(logits, ref_logits[rank])
            message = ""
            if not diff <= TOLERANCE:
                message = (
                    f"verify: FAILED at step {step + 1}: rank {rank}'s logits differ from the reference by "
                    f"{diff:.3g} (> {TOLERANCE:g} x (1 + |reference|))"
                )
            message = _agree_message(message)
            if message:
                raise VerifyError(message)
        if args.checkpoint_dir and (
            (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0) or step + 1 == args.steps
        ):
            path = checkpoint.save(
                module, dense, dense_opt, step + 1, args.checkpoint_dir, {"seed": args.seed}
            )
            out(f"checkpoint: saved {path}")

    if reference is not None:
        message = _agree_message(_final_check(module, dense, reference, rank))
        if message:
            raise VerifyError(message)
        out(f"verify: OK ({args.steps - start} steps, all rows of all copies match)")
    if args.metrics_out and rank == 0:
        records.append({"kind": "end", "steps": args.steps - start, "verify": "OK" if args.verify else None})
        _write_jsonl(Path(args.metrics_out), records)
        out(f"metrics: wrote {args.metrics_out} ({args.steps - start} steps)")
    return 0


# --- metrics -----------------------------------------------------------------------------------------


def _check_metrics_path(path: str) -> str:
    """'' if ``path``'s folder exists and ``path`` is not a folder, else an error message."""
    target = Path(path)
    if target.is_dir():
        return f"--metrics-out: {path} is a directory"
    if not target.resolve().parent.is_dir():
        return f"--metrics-out: {path}: folder {target.parent} does not exist"
    return ""


def _header_record(args, world: int, source, plan_file: PlanFile, device: torch.device, start: int) -> dict:
    """The run's configuration and the plan (tiers per table, the cost model's predicted metrics)."""
    return {
        "kind": "header",
        "config": {k: v for k, v in vars(args).items() if k != "metrics_out"},
        "world": world,
        "groups": plan_file.groups,
        "backend": dist.get_backend(),
        "device": str(device),
        "data": source.describe(),
        "start_step": start,
        "link_classes": list(LINK_CLASSES),
        "components": list(COMPONENTS),
        "plan": {
            "strategy": plan_file.plan.strategy,
            "dedup": plan_file.plan.dedup,
            "sync": plan_file.plan.sync,
            "tables": [
                {"name": t.name, "hot_rows": t.hot_rows, "warm_rows": t.warm_rows, "cold_rows": t.cold_rows}
                for t in plan_file.plan.tables
            ],
            "predicted": plan_file.predicted,
        },
    }


def _step_record(
    step: int, loss: float, elapsed_s: float, traffic: np.ndarray, world: int, device: torch.device
) -> dict:
    """One step's record (collective: gathers every rank's ``[2 links, 4 components, 2 directions]``
    traffic array in bytes and its step time in seconds, as float64)."""
    mine = torch.as_tensor(np.concatenate([[elapsed_s], traffic.reshape(-1)]), dtype=torch.float64)
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    rows = torch.stack(everyone).cpu().numpy()  # [world, 1 + 16]
    per_rank = rows[:, 1:].reshape(world, len(LINK_CLASSES), len(COMPONENTS), 2)
    link = per_rank.sum(axis=2).max(axis=2)  # [world, links]: max(send, recv) of the component sum
    comp = per_rank.max(axis=3)  # [world, links, components]

    def stat(x: np.ndarray) -> dict[str, float]:
        return {"max": float(x.max()), "mean": float(x.mean())}

    return {
        "kind": "step",
        "step": step,
        "loss": loss,
        "elapsed_s": float(rows[:, 0].max()),
        "bytes": {lk: stat(link[:, li]) for li, lk in enumerate(LINK_CLASSES)},
        "bytes_by_component": {
            lk: {c: stat(comp[:, li, ci]) for ci, c in enumerate(COMPONENTS)}
            for li, lk in enumerate(LINK_CLASSES)
        },
    }


def _write_jsonl(path: Path, records: list[dict]) -> None:
    """Write ``records`` one JSON object a line, atomically (:func:`topology.io.atomic_open`)."""
    with atomic_open(path) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _final_check(module: ShardedSequenceEmbedding, dense, reference: Reference, rank: int) -> str:
    """'' if every row this rank holds (weights and optimizer state), and the dense parameters, match
    the reference, and every row of every table is held somewhere; else a ``verify: FAILED`` line."""
    rows = module.shard_rows()
    copies: dict[str, torch.Tensor] = {}
    for (name, _tier), (ids, _w, _s) in rows.items():  # collective part first: every rank runs it
        held = copies.setdefault(name, torch.zeros(reference.weights[name].shape[0], dtype=torch.int64))
        held[torch.as_tensor(ids, dtype=torch.int64)] += 1
    missing = ""
    for name, held in copies.items():
        total = held.to(module.device)
        dist.all_reduce(total)
        if bool((total < 1).any()) and not missing:
            missing = f"table {name!r} row {int(torch.nonzero(total < 1)[0])} is held by no rank"
    if missing:
        return f"verify: FAILED after the last step: {missing}"
    for (name, tier), (ids, w, s) in rows.items():
        idx = torch.as_tensor(ids, dtype=torch.int64)
        ref_w = reference.weights[name].detach().cpu()[idx]
        ref_s = reference.state[name].cpu()[idx]
        for what, got, want in (("weights", w, ref_w), ("optimizer state", s, ref_s)):
            diff = _max_diff(got, want)
            if not diff <= TOLERANCE:
                rel = (got - want).abs() / (1 + want.abs())
                bad = int(ids[int(rel.reshape(len(ids), -1).max(1).values.argmax())])
                return (
                    f"verify: FAILED after the last step: rank {rank}, table {name!r} {tier} row {bad}: "
                    f"{what} differ from the reference by {diff:.3g} (> {TOLERANCE:g} x (1 + |reference|))"
                )
    for (pname, p), q in zip(dense.named_parameters(), reference.dense.parameters(), strict=True):
        diff = _max_diff(p, q)
        if not diff <= TOLERANCE:
            return (
                f"verify: FAILED after the last step: rank {rank}, dense parameter {pname!r} differs from "
                f"the reference by {diff:.3g} (> {TOLERANCE:g} x (1 + |reference|))"
            )
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    created = False
    try:
        created, _device = _init_distributed()
        return run(args)
    except VerifyError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    except (ValueError, OSError) as e:  # PlannerError, CheckpointError, the module's input checks
        message = first_line(e)
        print(f"flexshard train: error: {message}", file=sys.stderr, flush=True)
        return 2
    finally:
        sys.stdout.flush()
        if created and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
