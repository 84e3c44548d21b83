"""Helpers shared by the runtime tests and the processes they spawn (gloo over loopback)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from core.errors import ConfigError, PlanMismatchError
from core.ranks import RankLayout
from core.vocabulary import INDEX_BYTES, FetchMode
from flexshard.plan_file import OWNER_PATTERN_PERIOD, PlanFile, read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding, complete_order
from flexshard.runtime.local import run_on_ranks
from solvers.cost_model import evaluate
from solvers.dealing import interleave_pattern
from solvers.types import Plan, RowHistogram, TablePlan, TableSpec, Workload
from topology.views import uniform_view

TABLES = [("a", 120, 4), ("b", 300, 8), ("c", 60, 16)]
TIERS = {"a": (10, 30), "b": (20, 80), "c": (5, 15)}  # hot, warm rows
SEED = 7
COLD_SHARE_4 = [0.375, 0.125, 0.25, 0.25]  # uneven owner shares of the test plans on 4 and 8 ranks
WARM_SHARE_4 = [0.75, 0.25]
COLD_SHARE_8 = [0.2, 0.05, 0.1, 0.15, 0.1, 0.2, 0.1, 0.1]
WARM_BY_POSITION = {2: [0.6, 0.4], 4: [0.4, 0.3, 0.2, 0.1]}
GROUP = {name: FetchMode.GROUP for name, _rows, _dim in TABLES}  # every table's cold rows fetched per group
MIXED = {"a": FetchMode.GROUP, "c": FetchMode.GROUP}  # b fetched flat


def make_orders() -> dict[str, np.ndarray]:
    """a: identity; b: 50 touched ids hottest first (the rest completed); c: a full permutation."""
    rng = np.random.default_rng(3)
    return {"b": rng.permutation(300)[:50], "c": rng.permutation(60)}


def runtime_workload(tables: list = TABLES) -> Workload:
    """The workload the test plans are made for (rows numbered hottest first); ``tables``: (name, rows,
    dim) of :data:`TABLES`' names and rows."""
    specs = [
        TableSpec(name, rows, dim, ids_per_sample=3.0, hist=RowHistogram.from_counts(np.arange(rows, 0, -1)))
        for name, rows, dim in tables
    ]
    return Workload("runtime-test", tuple(specs), batch_size_per_gpu=4)


def write_test_plan(
    path: Path,
    num_groups: int,
    group_size: int,
    cold_share=None,
    warm_by_position=None,
    fetch=None,
    tables: list = TABLES,
) -> Path:
    """A plan with all three tiers non-empty and uneven shares, written and read back as a plan file;
    ``fetch``: the cold fetch mode of some tables (others flat); ``tables``: :data:`TABLES`' names and
    rows, with these dims."""
    n = num_groups * group_size
    view = uniform_view(num_groups, group_size, 100e9, 10e9)
    cold = np.full(n, 1.0 / n) if cold_share is None else np.asarray(cold_share, dtype=np.float64)
    warm_pos = (
        np.full(group_size, 1.0 / group_size)
        if warm_by_position is None
        else np.asarray(warm_by_position, dtype=np.float64)
    )
    plans = []
    for name, rows, _dim in tables:
        hot, warm = TIERS[name]
        mode = (fetch or {}).get(name, FetchMode.FLAT)
        plans.append(
            TablePlan(
                name, hot, warm, rows - hot - warm, warm_pos[view.local_index].copy(), cold.copy(), mode
            )
        )
    workload = runtime_workload(tables)
    plan = Plan(strategy="flexshard", tables=tuple(plans), dedup=True, sync="sparse")
    report = evaluate(workload, view, plan)
    write_plan(path, to_dict(plan, workload, view, report, "test", make_orders()))
    return path


# --- independent routing (from the plan file's definition, not the module's maps) -----------------


def owners(plan_file: PlanFile, orders: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per table (tier int[rows], owner int[rows]): owner is -1 (hot), a group position (warm) or a rank."""
    out = {}
    for tp, (name, rows, _dim) in zip(plan_file.plan.tables, TABLES, strict=True):
        order = complete_order(orders.get(name), rows, name)
        rank = np.empty(rows, dtype=np.int64)
        rank[order] = np.arange(rows)
        tier = np.where(rank < tp.hot_rows, 0, np.where(rank < tp.hot_rows + tp.warm_rows, 1, 2))
        owner = np.full(rows, -1)
        wpat = interleave_pattern(tp.warm_share[plan_file.groups[0]], OWNER_PATTERN_PERIOD)
        cpat = interleave_pattern(tp.cold_share, OWNER_PATTERN_PERIOD)
        for i in range(rows):  # a plain loop on purpose: independent of the vectorised module code
            if tier[i] == 1:
                owner[i] = wpat[(rank[i] - tp.hot_rows) % OWNER_PATTERN_PERIOD]
            elif tier[i] == 2:
                owner[i] = cpat[(rank[i] - tp.hot_rows - tp.warm_rows) % OWNER_PATTERN_PERIOD]
        out[name] = (tier, owner)
    return out


# --- batches -------------------------------------------------------------------------------------


def random_batch(seed: int, step: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 10_000 + step * 100 + rank)
    out = {}
    for name, rows, _dim in TABLES:
        lengths = torch.randint(0, 7, (5,), generator=gen)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        if values.numel() > 4:
            values[:3] = values[3]  # duplicates, so dedup matters
        out[name] = (values, lengths)
    return out


def loss_weights(seed: int, step: int, rank: int, features) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 7_919 + step * 31 + rank)
    dims = {n: d for n, _r, d in TABLES}
    return {n: torch.randn(v.numel(), dims[n], generator=gen) for n, (v, _l) in features.items()}


def balanced_ids(
    routes, rank: int, world: int, warm_counts, cold_counts, hot: int = 2, cold_start=None
) -> dict:
    """Distinct ids per table: ``warm_counts[p]`` warm ids of position p, ``cold_counts[o]`` cold ids
    of rank o (from its ``cold_start[o]``-th cold row, default ``rank``) and ``hot`` hot ids, varying with
    ``rank``."""
    out = {}
    for name, _rows, _dim in TABLES:
        tier, owner = routes[name]
        picked = [np.flatnonzero(tier == 0)[rank : rank + hot]]
        for p, k in enumerate(warm_counts):
            ids = np.flatnonzero((tier == 1) & (owner == p))
            picked.append(ids[rank : rank + k])
        for o, k in enumerate(cold_counts):
            ids = np.flatnonzero((tier == 2) & (owner == o))
            start = rank if cold_start is None else cold_start[o]
            picked.append(ids[start : start + k])
        values = torch.as_tensor(np.concatenate(picked))
        out[name] = (values, torch.tensor([values.numel()]))
    return out


def balanced_batch(plan_file: PlanFile, routes, rank: int) -> dict:
    """Rank ``rank``'s balanced batch: ``V * share`` distinct lookups of every owner (4 ranks). With a
    group fetch, each GPU's cold window of owner o starts ``k_o / 2`` rows after its group neighbour's, so
    the group looks up ``V_g = (1 + (g - 1) / 2) V`` distinct rows, ``V_g * share`` of each owner."""
    world, position = plan_file.world_size, int(plan_file.layout.position_of_rank[rank])
    if not plan_file.plan.cold_fetch(FetchMode.GROUP):
        return balanced_ids(routes, rank, world, BALANCED_WARM, BALANCED_COLD)
    start = [position * k // 2 for k in BALANCED_GROUP_COLD]
    return balanced_ids(routes, rank, world, BALANCED_WARM, BALANCED_GROUP_COLD, cold_start=start)


def with_fetch(plan_file: PlanFile, fetch: dict) -> PlanFile:
    """The plan with the cold fetch mode of the tables in ``fetch`` replaced (rows stay where they are)."""
    tables = tuple(
        dataclasses.replace(tp, fetch=fetch.get(tp.name, tp.fetch)) for tp in plan_file.plan.tables
    )
    return dataclasses.replace(plan_file, plan=dataclasses.replace(plan_file.plan, tables=tables))


def expected_traffic(
    plan_file, batches: list[dict], dedup: bool, sync: str = "sparse", element_bytes: int = 4
) -> np.ndarray:
    """Bytes [N, 2 links, 4 components, 2 directions] of one iteration, from an independent routing, with
    vectors of ``element_bytes`` per element on the wire. A flat lookup goes from the requester to the
    owner; a group fetch's id from the requester to its rail peer (the rank of its group at the owner's
    position) and, as a slot, straight to an owner in another group; its row once per group and row
    between the owner and the rail peer. The sparse sync's mask covers the hot rows and the whole warm
    tier, all-reduced over every rank (priced as the hot rows' hierarchical all-reduce)."""
    world, groups = plan_file.world_size, plan_file.groups
    group_of = np.empty(world, dtype=np.int64)
    pos_of = np.empty(world, dtype=np.int64)
    for k, members in enumerate(groups):
        group_of[members] = k
        pos_of[members] = np.arange(len(members))
    routes = owners(plan_file, make_orders())
    out = np.zeros((world, 2, 4, 2))
    n_tables = len(TABLES)
    hot_payload, warm_payload, mask_rows = 0.0, np.zeros(world), 0
    for tp, (name, rows, dim) in zip(plan_file.plan.tables, TABLES, strict=True):
        tier, owner = routes[name]
        vec = dim * element_bytes
        asked = np.zeros((world, world))  # [requester, owner or rail peer] vectors
        ids = np.zeros((world, world))  # [requester, owner or rail peer] ids
        fetched = [set() for _ in range(world)]  # the rows each rail peer fetches for its group
        touched = np.zeros(rows, dtype=bool)
        for r, feats in enumerate(batches):
            looked = feats[name][0].numpy()
            touched[looked] = True
            looked = np.unique(looked) if dedup else looked
            for i in looked:
                if tier[i] == 1:
                    dest = groups[group_of[r]][owner[i]]
                    asked[r, dest] += 1
                    ids[r, dest] += 1
                elif tier[i] == 2 and tp.fetch is FetchMode.GROUP:
                    peer = groups[group_of[r]][pos_of[owner[i]]]
                    asked[r, peer] += 1
                    ids[r, peer] += 1
                    if group_of[owner[i]] != group_of[r]:
                        ids[r, owner[i]] += 1
                    fetched[peer].add(int(i))
                elif tier[i] == 2:
                    asked[r, owner[i]] += 1
                    ids[r, owner[i]] += 1
        for peer, distinct in enumerate(fetched):
            for i in distinct:
                asked[peer, owner[i]] += 1
        np.fill_diagonal(asked, 0)
        np.fill_diagonal(ids, 0)
        for r in range(world):
            for p in range(world):
                li = 0 if group_of[p] == group_of[r] else 1
                out[r, li, 0, 0] += ids[r, p] * INDEX_BYTES
                out[r, li, 0, 1] += ids[p, r] * INDEX_BYTES
                out[r, li, 1, 0] += asked[p, r] * vec
                out[r, li, 1, 1] += asked[r, p] * vec
                out[r, li, 2, 0] += asked[r, p] * vec
                out[r, li, 2, 1] += asked[p, r] * vec
        if sync == "dense":
            touched[:] = True
        hot_payload += touched[tier == 0].sum() * vec
        mask_rows += tp.hot_rows + (tp.warm_rows if len(groups) > 1 else 0)
        for r in range(world):
            mine = (tier == 1) & (owner == pos_of[r])
            warm_payload[r] += touched[mine].sum() * vec
    if sync == "sparse":
        hot_payload += mask_rows
    tables = plan_file.plan.tables
    warm = any(tp.warm_rows for tp in tables)
    flat = any(tp.cold_rows and tp.fetch is FetchMode.FLAT for tp in tables)
    group = any(tp.cold_rows and tp.fetch is FetchMode.GROUP for tp in tables)
    for r in range(world):  # split sizes: T int64 per peer per column that reaches it, in one message
        for p in range(world):
            if p != r:
                same = group_of[p] == group_of[r]
                columns = int(warm) + int(flat) + int(group) if same else int(flat) + int(group)
                out[r, 0 if same else 1, 0, :] += n_tables * INDEX_BYTES * columns
    g, big_g = len(groups[0]), len(groups)
    out[:, 0, 3, :] += 2 * (g - 1) / g * hot_payload
    out[:, 1, 3, :] += (
        2 * (big_g - 1) / big_g * hot_payload / g + (2 * (big_g - 1) / big_g * warm_payload)[:, None]
    )
    return out


# --- single-process reference ---------------------------------------------------------------------


# --- the spawned process ---------------------------------------------------------------------------


def _scenario(rank: int, world: int, plan_path: str, scenario: str) -> dict:
    return SCENARIOS[scenario](rank, world, read_plan(plan_path))


def _train(model, world, rank, steps, seed):
    traffic = []
    for step in range(steps):
        feats = random_batch(seed, step, rank)
        out = model(feats)
        weights = loss_weights(seed, step, rank, feats)
        loss = sum((out[n] * weights[n].to(out[n].device)).sum() for n in out)
        loss.backward()
        model.step()
        traffic.append(model.traffic.bytes.copy())
    return traffic


# (optimizer, sync) of scenario_main's training runs; keyed "opt" (sparse) or "opt-dense"
TRAIN_RUNS = (
    ("sgd", "sparse"),
    ("adagrad", "sparse"),
    ("adagrad", "dense"),
    ("elementwise_adagrad", "sparse"),
    ("elementwise_adagrad", "dense"),
    ("adam", "sparse"),
)
TRAIN_KEYS = [opt if sync == "sparse" else f"{opt}-{sync}" for opt, sync in TRAIN_RUNS]


def scenario_main(rank: int, world: int, plan_file: PlanFile) -> dict:
    orders = make_orders()
    res = {"forward": {}, "train": {}, "errors": {}}
    for dedup in (False, True):
        model = ShardedSequenceEmbedding(plan_file.with_overrides(dedup=dedup), TABLES, orders, init=SEED)
        feats = random_batch(SEED, 99, rank)
        with torch.no_grad():
            out = model(feats)
        res["forward"][dedup] = {n: o.detach().cpu().clone() for n, o in out.items()}
        res["padded"] = model.padded(out["b"], feats["b"][1]).cpu()
    for opt, sync in TRAIN_RUNS:
        model = ShardedSequenceEmbedding(
            plan_file.with_overrides(sync=sync), TABLES, orders, init=SEED, optimizer=opt, lr=0.05
        )
        traffic = _train(model, world, rank, 3, SEED)
        key = opt if sync == "sparse" else f"{opt}-{sync}"
        res["train"][key] = {"rows": model.shard_rows(), "traffic": traffic}
    # exact byte check on a balanced batch
    routes = owners(plan_file, orders)
    model = ShardedSequenceEmbedding(plan_file, TABLES, orders, init=SEED, optimizer="sgd", lr=0.05)
    feats = balanced_batch(plan_file, routes, rank)
    out = model(feats)
    sum(o.sum() for o in out.values()).backward()
    model.step()
    res["balanced_traffic"] = model.traffic.bytes.copy()
    model = ShardedSequenceEmbedding(plan_file, TABLES, orders, init=SEED)
    # bad input on one rank: every rank raises, and the job goes on afterwards
    for case in ("range", "lengths", "empty", "missing"):
        feats = random_batch(SEED, 5, rank)
        if case == "range" and rank == 2:
            v, ln = feats["b"]
            v = v.clone()
            v[0] = 300
            feats["b"] = (v, ln)
        if case == "lengths" and rank == 1:
            v, ln = feats["c"]
            feats["c"] = (v, ln + 1)
        if case == "empty" and rank == 3:
            feats["a"] = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        if case == "missing" and rank == 0:
            del feats["c"]
        try:
            model(feats)
            res["errors"][case] = None
        except ValueError as e:
            res["errors"][case] = str(e)
    with torch.no_grad():
        res["after_error"] = {
            n: o.detach().cpu().clone() for n, o in model(random_batch(SEED, 6, rank)).items()
        }
    # a plan made for another world, other tables or other data: refused on every rank, no hang
    other_world = dataclasses.replace(plan_file, layout=RankLayout.single(world + 1))
    other_data = {**orders, "b": orders["b"][::-1].copy()}
    mismatches = {
        "world": (other_world, TABLES, orders),
        "tables": (plan_file, [("a", 120, 4), ("b", 301, 8), ("c", 60, 16)], orders),
        "dim": (plan_file, [("a", 120, 4), ("b", 300, 8), ("c", 60, 8)], orders),
        "data": (plan_file, TABLES, other_data),
        "no order": (plan_file, TABLES, {"b": orders["b"]}),
    }
    for case, (pf, tables, given) in mismatches.items():
        try:
            ShardedSequenceEmbedding(pf, tables, given)
            res["errors"][case] = None
        except PlanMismatchError as e:
            res["errors"][case] = str(e)
    try:  # Adam moves rows without gradient: dense sync (every replicated row updated) is refused
        ShardedSequenceEmbedding(plan_file.with_overrides(sync="dense"), TABLES, orders, optimizer="adam")
        res["errors"]["adam dense"] = None
    except ConfigError as e:
        res["errors"]["adam dense"] = str(e)
    return res


def scenario_small(rank: int, world: int, plan_file: PlanFile) -> dict:
    """Forward (dedup) and SGD training only (the 8-process case)."""
    orders = make_orders()
    model = ShardedSequenceEmbedding(plan_file, TABLES, orders, init=SEED, optimizer="sgd", lr=0.05)
    with torch.no_grad():
        out = model(random_batch(SEED, 99, rank))
    res = {"forward": {True: {n: o.detach().cpu().clone() for n, o in out.items()}}}
    traffic = _train(model, world, rank, 2, SEED)
    res["train"] = {"sgd": {"rows": model.shard_rows(), "traffic": traffic}}
    return res


def scenario_fetch_modes(rank: int, world: int, plan_file: PlanFile) -> dict:
    """Per fetch variant (every table per group; a mix of group and flat tables): forward with and without
    dedup, then SGD and Adagrad training (2 steps each)."""
    orders = make_orders()
    res = {}
    for variant, fetch in FETCH_VARIANTS.items():
        pf = with_fetch(plan_file, fetch)
        out = {"forward": {}, "train": {}}
        model = ShardedSequenceEmbedding(pf.with_overrides(dedup=False), TABLES, orders, init=SEED)
        with torch.no_grad():
            out["forward"][False] = {
                n: o.cpu().clone() for n, o in model(random_batch(SEED, 99, rank)).items()
            }
        for opt in ("sgd", "adagrad"):
            model = ShardedSequenceEmbedding(pf, TABLES, orders, init=SEED, optimizer=opt, lr=0.05)
            if opt == "sgd":
                with torch.no_grad():
                    feats = random_batch(SEED, 99, rank)
                    out["forward"][True] = {n: o.cpu().clone() for n, o in model(feats).items()}
            traffic = _train(model, world, rank, 2, SEED)
            out["train"][opt] = {"rows": model.shard_rows(), "traffic": traffic}
        res[variant] = out
    return res


BALANCED_WARM = (3, 1)  # warm lookups per position (shares 0.75 / 0.25)
BALANCED_COLD = (3, 1, 2, 2)  # cold lookups per rank (shares 0.375 / 0.125 / 0.25 / 0.25)
BALANCED_GROUP_COLD = (6, 2, 4, 4)  # the same shares, even, for half-overlapping windows in a group
FETCH_VARIANTS = {"group": GROUP, "mixed": MIXED}
SCENARIOS = {"main": scenario_main, "small": scenario_small, "fetch_modes": scenario_fetch_modes}


def run(
    world: int, plan_path: Path, scenario: str, timeout_s: float = 120.0, backend: str = "gloo"
) -> list[dict]:
    """Spawn ``world`` ranks running a named scenario and load their results."""
    return run_on_ranks(
        _scenario, world, str(plan_path), scenario, backend=backend, timeout_s=timeout_s, label=scenario
    )


def run_function(fn, world: int, *args, timeout_s: float = 120.0) -> list:
    """Spawn ``world`` gloo ranks running ``fn(rank, world, *args)`` (a module-level function) and
    return their results in rank order; a hang past ``timeout_s`` or an error fails the caller."""
    return run_on_ranks(fn, world, *args, timeout_s=timeout_s)
