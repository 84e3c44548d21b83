"""FlexShard vs TorchRec row-wise sharding of sequence embeddings, on the same batches (CPU, gloo).

One launch spawns ``--world`` gloo ranks on this host (default 4 = 2 emulated groups of 2; ``--world
8`` gives 2 groups of 4) and runs, on identical jagged batches, one system after the other:

(a) FlexShard: ``ShardedSequenceEmbedding`` with a plan from ``make_plan("flexshard", ...)`` at a
    per-GPU budget of ``--budget`` x row-wise memory (default 2x); forward + backward + ``step()``
    (row-wise Adagrad, sparse replica sync, dedup as planned);
(b) TorchRec: ``EmbeddingCollection`` wrapped by ``DistributedModelParallel`` with a plan forcing
    ``ShardingType.ROW_WISE`` and the FUSED kernel on CPU, input as ``KeyedJaggedTensor``; forward +
    backward (the fused ``EXACT_ROWWISE_ADAGRAD`` update runs inside backward). No index dedup:
    ``EmbeddingCollectionSharder(use_index_dedup=True)`` calls ``fbgemm::jagged_unique_indices``,
    which has no CPU kernel in fbgemm-gpu-cpu 1.8 (``--torchrec-dedup`` tries it and reports the
    error); what it would send is COMPUTED from the ids instead (see the cross-checks). ``--qcomms``
    adds TorchRec with its own quantized comms (``QCommsConfig`` bf16 forward and backward, through
    ``EmbeddingCollectionSharder(qcomm_codecs_registry=...)``) and FlexShard planned and run at bf16;
(c) ablation (``--no-ablation`` skips it): FlexShard's runtime on the plain row-wise plan
    (``make_plan("row_wise", ..., dedup=True)``: every row cold, ids deduplicated per rank), which
    separates what deduplication saves from what the hot / warm tiers save.

EmbeddingCollection needs one embedding dim for all its tables, so the default tables share dim 64.

Data: ``--tables`` tables of 10^4-10^5 rows; every sample is one history of length uniform in
``[--len-min, --len-max]`` looked up in every table; ids are drawn from the calibrated head + tail
mixture of ``flexshard.workloads.synthetic`` (Zipf(``--alpha``) over a head of ``0.08 x`` the lookups
of an 8-rank iteration, plus ``--tail-mass`` uniform over the table), then mapped through a fixed
random permutation (real ids are hashed, so hot rows are spread over TorchRec's row blocks).
FlexShard's hotness order is counted on ``--profile-steps`` separate profiling batches (not the timed
ones); ``--oracle-order`` uses the true order. The planner sees the analytic histogram.

Measured vs computed:

* step time: wall time of forward + backward + optimizer step on each rank after a barrier; the
  step's time is the slowest rank's; mean, std and median over the timed steps. Both models are
  built once; ``--rounds`` timed blocks of ``--steps`` steps per system run in the orders of
  :func:`flexshard.bench.rotation.round_order` (a Williams design, as ``flexshard bench`` runs its
  strategies), on the same batches;
* bytes: MEASURED for both systems by wrapping the ``torch.distributed`` collectives both call
  (:mod:`flexshard.bench.recorder`, the recorder of ``flexshard bench``; TorchRec's row-wise system is
  ``flexshard.bench.systems.TorchRecRowWise``) during the timed steps only: bytes each
  rank sends to each peer (self excluded), peers classified intra / inter by the emulated groups.
  All-to-all and gather bytes per peer are exact (from the split sizes). An all-reduce's per-peer
  traffic depends on gloo's algorithm, so it is COMPUTED from its payload with the cost model's
  hierarchical all-reduce (``2 (g-1)/g P`` intra-group, ``2 (G-1)/G P / g`` inter-group), the same
  convention as FlexShard's own counter; TorchRec row-wise issues no all-reduce here.
* cross-checks: FlexShard's own ``traffic`` counter (ids + forward + backward + sync, send side), and
  for TorchRec the bytes COMPUTED from the ids and its row-block boundaries (8-byte ids sent to the
  owning rank + ``dim x 4`` bytes per remote lookup forward and again backward); the measured
  TorchRec bytes add the lengths / split-size exchanges of its input dist on top. The same
  computation on each rank's unique ids per table gives TorchRec's bytes with index dedup;
* the cost model's prediction (``CostReport`` of each plan, bottleneck rank) is printed alongside.

Bytes are per rank per iteration (mean over ranks and timed steps, send side). Timings on CPU with
gloo over loopback (all ranks share this host's cores) say nothing about GPU / NCCL step times.

Run (TorchRec installed as in ``scripts/setup_torchrec.sh``)::

    .venv/bin/python experiments/bench_vs_torchrec.py [--world 4|8] [--batch 128] [--steps 10]
        [--warmup 3] [--rounds 2] [--json out.json]

``--study`` runs the three documented configurations one after another (world 4 batch 128, world 4
batch 256, world 8 batch 128; a fresh spawn of the ranks each; the other options apply to all three)
and writes ``docs/results/torchrec_runtime.md`` and ``torchrec_runtime.png`` (``--no-write``: print
only)::

    .venv/bin/python experiments/bench_vs_torchrec.py --study [--no-write]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import study
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.osutil import free_port
from flexshard.bench.data import orders_by_count
from flexshard.bench.recorder import recording
from flexshard.bench.rotation import round_order
from flexshard.bench.systems import TorchRecRowWise
from flexshard.runtime.host_memory import keep_freed_memory
from flexshard.runtime.local import wait_for_ranks
from flexshard.training.garbage import StepGarbageCollection

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

REFERENCE_RANKS = 8  # the head size is fixed from an 8-rank iteration, so --world does not change the data
INTRA, INTER = 0, 1  # LinkClass indices, as flexshard.bench.recorder counts them
DEFAULT_TABLES = "item:100000:64,creator:50000:64,category:10000:64"  # EmbeddingCollection: one dim
STUDY: tuple[tuple[str, dict[str, int]], ...] = (  # (name, Config overrides), in the order they run
    ("world 4 (2 groups of 2), batch 128 per rank", {"world": 4, "batch": 128}),
    ("world 4 (2 groups of 2), batch 256 per rank", {"world": 4, "batch": 256}),
    ("world 8 (2 groups of 4), batch 128 per rank", {"world": 8, "batch": 128}),
)
STUDY_SYSTEMS = (
    ("flexshard", "FlexShard"),
    ("flexshard_rw", "ablation (row-wise + dedup)"),
    ("torchrec", "TorchRec"),
)


@dataclass
class Config:
    world: int = 4
    groups: int = 2
    tables: list[tuple[str, int, int]] = field(default_factory=list)
    batch: int = 128
    len_min: int = 50
    len_max: int = 100
    warmup: int = 3
    steps: int = 10
    seed: int = 0
    budget: float = 2.0
    lr: float = 0.01
    alpha: float = 0.87
    tail_mass: float = 0.045
    intra_GBps: float = 450.0
    inter_GBps: float = 50.0
    profile_steps: int = 4
    oracle_order: bool = False
    threads: int = 1
    rounds: int = 2
    torchrec_dedup: bool = False
    qcomms: bool = False  # also both systems with bf16 on the wire (TorchRec: its QCommsConfig)
    ablation: bool = True
    skip_torchrec: bool = False
    timeout_s: float = 1200.0

    @property
    def group_size(self) -> int:
        return self.world // self.groups

    @property
    def mean_len(self) -> float:
        return (self.len_min + self.len_max) / 2.0


# --- data --------------------------------------------------------------------------------------------


class TableDistribution:
    """Head + tail mixture over hotness ranks, mapped to ids by a fixed random permutation."""

    def __init__(self, cfg: Config, index: int, num_rows: int) -> None:
        from flexshard.workloads.synthetic import head_rows_for, iteration_lookups

        lookups = iteration_lookups(cfg.mean_len, REFERENCE_RANKS, cfg.batch)
        self.num_rows = num_rows
        self.head = head_rows_for(num_rows, lookups)
        w = np.arange(1, self.head + 1, dtype=np.float64) ** -cfg.alpha
        self.cdf = np.cumsum(w) / w.sum()
        self.tail_mass = cfg.tail_mass
        self.perm = np.random.default_rng((cfg.seed, 1_000 + index)).permutation(num_rows)  # rank -> id

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        tail = rng.random(n) < self.tail_mass
        ranks = np.searchsorted(self.cdf, rng.random(n), side="right")
        ranks = np.minimum(ranks, self.head - 1)
        ranks[tail] = rng.integers(0, self.num_rows, int(tail.sum()))
        return self.perm[ranks]


def make_batch(cfg: Config, dists: list[TableDistribution], step: int, rank: int) -> dict:
    """``{table: (values int64, lengths int64)}``; one history per sample, shared by all tables."""
    rng = np.random.default_rng((cfg.seed, step, rank))
    lengths = rng.integers(cfg.len_min, cfg.len_max + 1, cfg.batch)
    n = int(lengths.sum())
    out = {}
    for (name, _rows, _dim), d in zip(cfg.tables, dists, strict=True):
        out[name] = (torch.from_numpy(d.sample(rng, n)), torch.from_numpy(lengths.copy()))
    return out


def counted_orders(cfg: Config, dists: list[TableDistribution]) -> dict[str, np.ndarray]:
    """Hotness order per table: ids touched in the profiling batches (all ranks), most counted first."""
    if cfg.oracle_order:
        return {name: d.perm.copy() for (name, _r, _d), d in zip(cfg.tables, dists, strict=True)}
    counts = {name: np.zeros(rows, dtype=np.int64) for name, rows, _ in cfg.tables}
    for k in range(cfg.profile_steps):
        for r in range(cfg.world):
            for name, (values, _l) in make_batch(cfg, dists, 1_000_000 + k, r).items():
                counts[name] += np.bincount(values.numpy(), minlength=counts[name].size)
    return orders_by_count(counts)


# --- plan --------------------------------------------------------------------------------------------


def make_workload_and_view(cfg: Config):
    from flexshard.workloads.synthetic import head_rows_for, iteration_lookups, zipf_table
    from solvers.types import Workload
    from topology.views import uniform_view

    lookups = iteration_lookups(cfg.mean_len, REFERENCE_RANKS, cfg.batch)
    specs = tuple(
        zipf_table(
            name, rows, dim, cfg.mean_len, cfg.alpha, cfg.tail_mass, head_rows=head_rows_for(rows, lookups)
        )
        for name, rows, dim in cfg.tables
    )
    workload = Workload("bench-vs-torchrec", specs, batch_size_per_gpu=cfg.batch)
    view = uniform_view(cfg.groups, cfg.group_size, cfg.intra_GBps * 1e9, cfg.inter_GBps * 1e9)
    return workload, view


def write_bench_plan(cfg: Config, path: Path, orders: dict[str, np.ndarray]) -> dict:
    """Plan FlexShard at ``cfg.budget`` x row-wise memory; also price row-wise (no dedup, as TorchRec).
    The plan files name ``orders``, the hotness orders the ranks route the ids with."""
    from flexshard.plan_file import to_dict, write_plan
    from solvers.planner import budget_bytes, make_plan

    workload, view = make_workload_and_view(cfg)
    budget = budget_bytes(workload, view, cfg.budget)
    t0 = time.perf_counter()
    planned = make_plan("flexshard", workload, view, budget)
    plan_s = time.perf_counter() - t0
    write_plan(path, to_dict(planned.plan, workload, view, planned.report, "bench-vs-torchrec", orders))
    rw = make_plan("row_wise", workload, view, budget_bytes(workload, view, 1.0), dedup=False)
    rw_dedup = make_plan("row_wise", workload, view, budget_bytes(workload, view, 1.0), dedup=True)
    rw_path = path.with_name("plan_row_wise.json")  # the ablation: FlexShard's runtime, all rows cold
    write_plan(rw_path, to_dict(rw_dedup.plan, workload, view, rw_dedup.report, "bench-vs-torchrec", orders))
    if cfg.qcomms:  # FlexShard planned and run with bf16 on the wire
        bf16 = make_plan("flexshard", workload, view, budget, wire="bf16")
        write_plan(
            path.with_name("plan_bf16.json"),
            to_dict(bf16.plan, workload, view, bf16.report, "bench-vs-torchrec", orders),
        )
    tiers = [(tp.name, tp.hot_rows, tp.warm_rows, tp.cold_rows) for tp in planned.plan.tables]
    return {
        "plan_s": plan_s,
        "tiers": tiers,
        "chosen": planned.plan.solver.get("chosen", "tier optimizer"),
        "modeled": {
            "FlexShard": (planned.report.intra_group_bytes, planned.report.inter_group_bytes),
            "row-wise (no dedup)": (rw.report.intra_group_bytes, rw.report.inter_group_bytes),
            "row-wise (dedup)": (rw_dedup.report.intra_group_bytes, rw_dedup.report.inter_group_bytes),
        },
        "memory_per_gpu": {
            "FlexShard": planned.report.memory_per_gpu_bytes,
            "row-wise": rw.report.memory_per_gpu_bytes,
        },
    }


# --- the two systems -----------------------------------------------------------------------------


class System:
    """One system under test: ``step(input)`` runs forward + backward + optimizer step."""

    key = ""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sent: list[np.ndarray] = []
        self.got: list[np.ndarray] = []
        self.calls: dict[str, int] = {}
        self.inputs: list = []

    def step(self, batch) -> None:
        raise NotImplementedError

    def after_timed_step(self, index: int) -> None:  # noqa: B027  (optional hook)
        pass

    def result(self) -> dict:
        return {
            "times": self.times,
            "send": np.mean(self.sent, 0),
            "recv": np.mean(self.got, 0),
            "calls": {k: v / max(1, len(self.times)) for k, v in self.calls.items()},
        }


def timed_block(cfg: Config, system: System, warmup: int) -> None:
    """``warmup`` untimed steps then ``cfg.steps`` timed ones on the system's inputs (barrier before
    each step, outside the timing and the byte count; bytes and collectives by
    :func:`flexshard.bench.recorder.recording`). Python's collector is kept out of the block's steps (one
    collection before it), as ``flexshard bench`` keeps it."""
    with StepGarbageCollection(1):
        for index, batch in enumerate(system.inputs[cfg.warmup - warmup :]):
            dist.barrier()
            timed = index >= warmup
            with recording(cfg.group_size) as rec:
                t0 = time.perf_counter()
                system.step(batch)
                dt = time.perf_counter() - t0
            if timed:
                system.times.append(dt)
                system.sent.append(rec.bytes_sent.copy())
                system.got.append(rec.bytes_received.copy())
                for k, v in rec.counts.items():
                    system.calls[k] = system.calls.get(k, 0) + v
                system.after_timed_step(cfg.warmup - warmup + index)


def _loss(values: list[torch.Tensor]) -> torch.Tensor:
    return sum(0.5 * v.pow(2).sum() for v in values)


class FlexShardSystem(System):
    def __init__(self, cfg: Config, batches: list, plan_path: str, orders, key: str = "flexshard") -> None:
        super().__init__()
        self.key = key
        from flexshard.plan_file import read_plan
        from flexshard.runtime import ShardedSequenceEmbedding

        self.model = ShardedSequenceEmbedding(
            read_plan(plan_path), cfg.tables, orders, init=cfg.seed, optimizer="adagrad", lr=cfg.lr
        )
        self.inputs = batches
        self.own: list[np.ndarray] = []

    def step(self, batch) -> None:
        out = self.model(batch)
        _loss(list(out.values())).backward()
        self.model.step()

    def after_timed_step(self, index: int) -> None:
        self.own.append(self.model.traffic.bytes[:, :, 0].sum(axis=1))  # send side, all components

    def result(self) -> dict:
        res = super().result()
        res["own_counter_send"] = np.mean(self.own, 0)
        res["dedup"] = self.model.dedup
        return res


class TorchRecSystem(System):
    """:class:`flexshard.bench.systems.TorchRecRowWise` on the batches, with the bytes COMPUTED from the
    ids beside the measured ones and the rows its fused optimizer changed."""

    def __init__(self, cfg: Config, batches: list, dedup: bool = False, qcomms: bool = False) -> None:
        super().__init__()
        self.key = "torchrec_dedup" if dedup else "torchrec_bf16" if qcomms else "torchrec"
        self.tr = TorchRecRowWise(cfg.tables, cfg.lr, cfg.group_size, dedup=dedup, qcomms=qcomms)
        self.batches = batches
        self.inputs = [self.tr.prepare(b) for b in batches]
        self.computed: list[np.ndarray] = []
        self.before = self.tr.local_weights()

    def step(self, kjt) -> None:
        self.tr.step(kjt)

    def after_timed_step(self, index: int) -> None:
        """Bytes computed from the ids: as run, and as with the other dedup setting."""
        self.computed.append(self.tr.computed_bytes_sent(self.batches[index]))

    def result(self) -> dict:
        res = super().result()
        after = self.tr.local_weights()
        moved = sum(int((a != b).any(dim=1).sum()) for a, b in zip(after, self.before, strict=True))
        res["rows_updated"] = (moved, sum(int(b.shape[0]) for b in self.before))
        res["computed_send"] = np.mean(self.computed, 0)
        res["kernels"] = sorted({v[3] for v in self.tr.blocks.values()})
        res["block_rows"] = {name: int(v[1][0]) for name, v in self.tr.blocks.items()}
        res["optimizer"] = type(self.tr.dmp.fused_optimizer).__name__
        return res


# --- processes -----------------------------------------------------------------------------------


def _worker(rank: int, cfg: Config, port: int, plan_path: str, orders_path: str, outdir: str) -> None:
    out = Path(outdir)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.world
        )
        torch.set_num_threads(cfg.threads)
        keep_freed_memory()  # as the bench's ranks do (docs/cost_model.md 10.2.1c)
        dists = [TableDistribution(cfg, i, rows) for i, (_n, rows, _d) in enumerate(cfg.tables)]
        batches = [make_batch(cfg, dists, s, rank) for s in range(cfg.warmup + cfg.steps)]
        orders = dict(np.load(orders_path))
        systems: list[System] = [FlexShardSystem(cfg, batches, plan_path, orders)]
        if cfg.ablation:
            rw_plan = str(Path(plan_path).with_name("plan_row_wise.json"))
            systems.append(FlexShardSystem(cfg, batches, rw_plan, orders, key="flexshard_rw"))
        if cfg.qcomms:
            bf16_plan = str(Path(plan_path).with_name("plan_bf16.json"))
            systems.append(FlexShardSystem(cfg, batches, bf16_plan, orders, key="flexshard_bf16"))
        result = {}
        variants = (
            [] if cfg.skip_torchrec else [(False, False)] + ([(True, False)] if cfg.torchrec_dedup else [])
        )
        variants += [(False, True)] if cfg.qcomms and not cfg.skip_torchrec else []
        for dedup, qcomms in variants:
            key = "torchrec_dedup" if dedup else "torchrec_bf16" if qcomms else "torchrec"
            try:
                system = TorchRecSystem(cfg, batches, dedup, qcomms)
                dist.barrier()
                system.step(system.inputs[0])  # a trial step: a failure here drops only this system
                systems.append(system)
            except Exception:
                result[f"{key}_error"] = traceback.format_exc()
                (out / f"rank{rank}.{key}.err").write_text(result[f"{key}_error"])
        # rounds in a Williams design: each system at every position, after every other one
        for rnd in range(cfg.rounds):
            for i in round_order(rnd, len(systems)):
                system = systems[i]
                timed_block(cfg, system, cfg.warmup if rnd == 0 else min(1, cfg.warmup))
        for system in systems:
            result[system.key] = system.result()
        torch.save(result, out / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def launch(cfg: Config, plan_path: Path, orders_path: Path, outdir: Path) -> list[dict]:
    ctx = mp.start_processes(
        _worker,
        args=(cfg, free_port(), str(plan_path), str(orders_path), str(outdir)),
        nprocs=cfg.world,
        join=False,
        start_method="spawn",
    )
    try:
        wait_for_ranks(ctx, cfg.timeout_s, outdir, f"world {cfg.world}")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(cfg.world)]


# --- report --------------------------------------------------------------------------------------


def summarize(results: list[dict], key: str) -> dict:
    per_rank = [r[key] for r in results]
    steps = np.max(np.array([p["times"] for p in per_rank]), axis=0)  # slowest rank per step
    send = np.mean([p["send"] for p in per_rank], 0)
    recv = np.mean([p["recv"] for p in per_rank], 0)
    out = {
        "mean_ms": float(steps.mean() * 1e3),
        "median_ms": float(np.median(steps) * 1e3),
        "std_ms": float(steps.std() * 1e3),
        "intra": float(send[INTRA]),
        "inter": float(send[INTER]),
        "recv": recv.tolist(),
        "max_rank_send": np.max([p["send"] for p in per_rank], 0).tolist(),
        "calls": per_rank[0]["calls"],
    }
    if "own_counter_send" in per_rank[0]:
        out["check"] = np.mean([p["own_counter_send"] for p in per_rank], 0).tolist()
        out["check_what"] = "FlexShard's own traffic counter (send)"
    if "computed_send" in per_rank[0]:
        computed = np.mean([p["computed_send"] for p in per_rank], 0)  # [as run / other dedup, link]
        out["check"] = computed[0].tolist()
        out["check_what"] = "computed from ids and row blocks (8 B ids + fwd + bwd embeddings)"
        out["computed_other"] = computed[1].tolist()
        out["kernels"] = per_rank[0]["kernels"]
        out["optimizer"] = per_rank[0]["optimizer"]
        out["block_rows"] = per_rank[0]["block_rows"]
        out["rows_updated"] = [sum(p["rows_updated"][i] for p in per_rank) for i in range(2)]
    return out


def mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


def report(cfg: Config, plan_info: dict, results: list[dict]) -> tuple[str, dict]:
    lines = []
    labels = {
        "flexshard": f"FlexShard (budget {cfg.budget:g}x, plan from make_plan)",
        "flexshard_rw": "ablation: FlexShard runtime, row-wise plan (all rows cold, dedup)",
        "torchrec": "TorchRec 1.8 EmbeddingCollection, ROW_WISE, fused row-wise Adagrad",
        "torchrec_dedup": "TorchRec, same, with use_index_dedup=True",
        "flexshard_bf16": "FlexShard, planned and run with bf16 on the wire",
        "torchrec_bf16": "TorchRec, ROW_WISE, with its quantized comms (QCommsConfig bf16 both ways)",
    }
    systems = [(label, key) for key, label in labels.items() if all(key in r for r in results)]
    errors = {
        key: next(r[f"{key}_error"] for r in results if f"{key}_error" in r)
        for key in labels
        if any(f"{key}_error" in r for r in results)
    }
    summary = {key: summarize(results, key) for _label, key in systems}
    tables = ", ".join(f"{n} {r:,}x{d}" for n, r, d in cfg.tables)
    lines.append(
        f"world {cfg.world} = {cfg.groups} emulated groups of {cfg.group_size} (gloo, CPU, "
        f"{cfg.threads} thread(s) per rank, {os.cpu_count()} cores); tables: {tables}; "
        f"batch {cfg.batch}/rank, lengths {cfg.len_min}-{cfg.len_max}; per system {cfg.rounds} rounds of "
        f"{cfg.steps} timed steps (first after {cfg.warmup} warm-up steps, later after 1; rounds in a "
        f"Williams design of the systems' order); zipf alpha {cfg.alpha}, tail {cfg.tail_mass}; "
        f"order: {'oracle' if cfg.oracle_order else f'counted on {cfg.profile_steps} profiling steps'}"
    )
    lines.append("")
    lines.append(
        "FlexShard tiers (hot, warm, cold rows): "
        + "; ".join(f"{n}: {h:,}/{w:,}/{c:,}" for n, h, w, c in plan_info["tiers"])
        + f" ({plan_info['chosen']}; planned in {plan_info['plan_s']:.2f} s)"
    )
    lines.append("")
    lines.append(
        "Bytes: measured (hooked torch.distributed collectives), per rank per iteration, send side, "
        "MB = 1e6 B"
    )
    lines.append("")
    rows = []
    for label, key in systems:
        s = summary[key]
        step = f"{s['mean_ms']:.1f} ± {s['std_ms']:.1f} / {s['median_ms']:.1f}"
        rows.append([label, step, mb(s["intra"]), mb(s["inter"]), mb(s["intra"] + s["inter"])])
    header = ["system", "step time ms (mean ± std / median)", "intra-group MB", "inter-group MB", "total MB"]
    lines.append(study.md_table(header, rows))
    f = summary["flexshard"]
    names = {
        "torchrec": "TorchRec",
        "torchrec_dedup": "TorchRec with dedup",
        "flexshard_rw": "ablation (row-wise + dedup)",
    }
    lines.append("")
    pairs = [("flexshard", key, name) for key, name in names.items()]
    pairs += [
        ("flexshard_bf16", "torchrec_bf16", "TorchRec + quantized comms (both bf16)"),
        ("flexshard_bf16", "torchrec", "TorchRec default (FlexShard at bf16)"),
    ]
    for ours, key, name in pairs:
        if key in summary and ours in summary:
            f, t = summary[ours], summary[key]
            saved = (1 - f["inter"] / t["inter"]) * 100
            lines.append(
                f"- FlexShard / {name}: inter-group bytes {f['inter'] / t['inter']:.3f} ({saved:.1f}% "
                f"fewer); total bytes {(f['intra'] + f['inter']) / (t['intra'] + t['inter']):.3f}; "
                f"step time {f['mean_ms'] / t['mean_ms']:.2f}x"
            )
    lines.append("")
    lines.append("Cross-checks (MB per rank per iteration, intra / inter):")
    for _label, key in systems:
        s = summary[key]
        lines.append(
            f"- {key}: measured {mb(s['intra'])} / {mb(s['inter'])}; {s['check_what']}: "
            f"{mb(s['check'][0])} / {mb(s['check'][1])}; busiest rank sends "
            f"{mb(s['max_rank_send'][0])} / {mb(s['max_rank_send'][1])}; collectives per step on rank 0: "
            + ", ".join(f"{k} x{v}" for k, v in sorted(s["calls"].items()))
        )
    for key in ("torchrec", "torchrec_dedup"):
        if key not in summary:
            continue
        t = summary[key]
        if key == "torchrec":
            lines.append(
                f"- torchrec with index dedup (COMPUTED from the ids, unique per rank and table, as "
                f"use_index_dedup would send; that op has no CPU kernel): {mb(t['computed_other'][0])} / "
                f"{mb(t['computed_other'][1])}; FlexShard measured / this: inter "
                f"{f['inter'] / t['computed_other'][1]:.3f}, total "
                f"{(f['intra'] + f['inter']) / sum(t['computed_other']):.3f}"
            )
        lines.append(
            f"- {key}: compute kernels {t['kernels']}, fused optimizer {t['optimizer']}, "
            f"row blocks {t['block_rows']}; rows changed by its fused optimizer over all steps: "
            f"{t['rows_updated'][0]:,} of {t['rows_updated'][1]:,}"
        )
    lines.append(
        "- cost model (bottleneck rank, MB, intra / inter): "
        + "; ".join(f"{k}: {mb(v[0])} / {mb(v[1])}" for k, v in plan_info["modeled"].items())
        + "; memory per GPU (MB): "
        + ", ".join(f"{k} {mb(v)}" for k, v in plan_info["memory_per_gpu"].items())
    )
    for key, err in errors.items():
        tb = err.rstrip().splitlines()
        frames = [ln.strip() for ln in tb if ln.strip().startswith("File ")]
        final = next((ln for ln in tb if ln and not ln.startswith((" ", "Traceback"))), tb[-1])
        lines.append("")
        lines.append(f"{labels[key]} FAILED on CPU/gloo (full traceback in --json):")
        lines.append(f"    at {frames[-1] if frames else '?'}")
        lines.append(f"    {final[:400]}")
    return "\n".join(lines), summary


def parse_tables(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        name, rows, dim = item.split(":")
        out.append((name, int(float(rows)), int(dim)))
    return out


def run_config(cfg: Config) -> tuple[str, dict]:
    """Plan, count the hotness order, spawn the ranks: the report text and the ``--json`` payload."""
    with tempfile.TemporaryDirectory(prefix="bench_vs_torchrec.") as tmp:
        tmp = Path(tmp)
        dists = [TableDistribution(cfg, i, rows) for i, (_n, rows, _d) in enumerate(cfg.tables)]
        orders = counted_orders(cfg, dists)
        np.savez(tmp / "orders.npz", **orders)
        plan_info = write_bench_plan(cfg, tmp / "plan.json", orders)
        results = launch(cfg, tmp / "plan.json", tmp / "orders.npz", tmp)
    text, summary = report(cfg, plan_info, results)
    payload = {
        "config": asdict(cfg),
        "plan": plan_info,
        "summary": summary,
        "errors": {k: v for r in results for k, v in r.items() if k.endswith("_error")},
    }
    return text, payload


def write_json(path: str, payload: object) -> None:
    Path(path).write_text(json.dumps(payload, indent=1, default=str))


# --- study: the three documented configurations --------------------------------------------------


def run_study(base: Config) -> list[tuple[str, str, dict]]:
    """Each configuration of ``STUDY`` on ``base`` (fresh ranks each): ``(name, report text, payload)``."""
    runs = []
    for i, (name, overrides) in enumerate(STUDY, 1):
        print(f"[{i}/{len(STUDY)}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        text, payload = run_config(replace(base, **overrides))
        print(f"[{i}/{len(STUDY)}] done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        runs.append((name, text, payload))
    return runs


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def study_table(runs: list[tuple[str, str, dict]]) -> str:
    """One row per configuration: bytes of the three systems and FlexShard's ratios to the other two."""
    header = ["configuration", "inter-group MB (FlexShard / ablation / TorchRec)", "intra-group MB (same)"]
    ratios = "inter, total bytes, step time mean (median)"
    header += [f"FlexShard / TorchRec: {ratios}", f"FlexShard / ablation: {ratios}"]
    rows = []
    for name, _text, payload in runs:
        s = payload["summary"]
        f = s["flexshard"]
        cells = [name]
        for link in ("inter", "intra"):
            cells.append(" / ".join(mb(s[k][link]) if k in s else "n/a" for k, _l in STUDY_SYSTEMS))
        for key in ("torchrec", "flexshard_rw"):
            t = s.get(key)
            if t is None:
                cells.append("n/a")
                continue
            total = _ratio(f["intra"] + f["inter"], t["intra"] + t["inter"])
            step = f"{_ratio(f['mean_ms'], t['mean_ms'])} ({_ratio(f['median_ms'], t['median_ms'])})"
            cells.append(f"{_ratio(f['inter'], t['inter'])}, {total}, {step}")
        rows.append(cells)
    return study.md_table(header, rows)


def render_study(cfg: Config, runs: list[tuple[str, str, dict]], command: str, runtime_s: float) -> str:
    """``docs/results/torchrec_runtime.md``: command, versions, set-up, summary, per-configuration tables."""
    tables = ", ".join(f"{n} {r:,}x{d}" for n, r, d in cfg.tables)
    lines = [
        "# FlexShard runtime vs TorchRec row-wise, measured on CPU (gloo)",
        "",
        "**CPU timings with gloo over loopback, all ranks on this host's cores: they are not GPU / NCCL "
        "timings.** Loopback has no slower inter-group link, so saving inter-group bytes cannot shorten a "
        "step here. The byte counts do not depend on the hardware. Method and reading: "
        "[docs/torchrec_comparison.md](../torchrec_comparison.md).",
        "",
        study.generated(command, runtime_s, study.versions("torch", "torchrec", "fbgemm_gpu_cpu")),
        "",
        "## Set-up",
        "",
        f"- Tables {tables}; every sample is one history of {cfg.len_min}-{cfg.len_max} ids looked up in "
        f"every table; ids from Zipf({cfg.alpha}) head + {cfg.tail_mass} uniform tail, randomly permuted.",
        f'- FlexShard: `make_plan("flexshard")` at {cfg.budget:g}x row-wise memory, hotness order counted on '
        f'{cfg.profile_steps} profiling batches; ablation: FlexShard\'s runtime on `make_plan("row_wise", '
        "dedup=True)`; TorchRec: `EmbeddingCollection`, `ROW_WISE`, FUSED kernel, fused "
        "`EXACT_ROWWISE_ADAGRAD`, no index dedup (no CPU kernel).",
        f"- Per system {cfg.rounds} rounds of {cfg.steps} timed steps on the same batches (first after "
        f"{cfg.warmup} warm-up steps), rounds in a Williams design of the systems' order; "
        f"{cfg.threads} torch thread(s) per rank; a step's time is its slowest rank's; Python's garbage "
        "collector kept out of each round's steps (one collection before it).",
        "- Bytes: measured by hooking `torch.distributed` collectives during the timed steps, per rank per "
        "iteration, send side, MB = 1e6 B (all-reduce per-peer bytes computed from the payload).",
        "",
        "## Summary",
        "",
        study_table(runs),
        "",
        "Ratios are FlexShard's value over the other system's (bytes: per rank per iteration; step time: "
        "of the mean and, in brackets, of the median). Step time ratios are CPU/gloo only, on a machine "
        "shared with other jobs.",
        "",
        "![FlexShard vs TorchRec runtime](torchrec_runtime.png)",
    ]
    for name, text, _payload in runs:
        lines += ["", f"## {name[0].upper()}{name[1:]}", "", text]
    return "\n".join(lines) + "\n"


def study_figure(runs: list[tuple[str, str, dict]], path: Path) -> None:
    """Inter- and intra-group MB per iteration and step time (± std) per configuration and system."""
    fig, axes = study.subplots(1, 3, figsize=(16, 5.2))
    x = np.arange(len(runs))
    width = 0.27
    panels = (
        ("inter", "inter-group MB per rank per iteration"),
        ("intra", "intra-group MB per rank per iteration"),
        ("mean_ms", "step time, ms (mean ± std, CPU gloo)"),
    )
    for ax, (field_, title) in zip(axes, panels, strict=True):
        for j, (key, label) in enumerate(STUDY_SYSTEMS):
            vals, errs = [], []
            for _n, _t, payload in runs:
                s = payload["summary"].get(key)
                scale = 1.0 if field_ == "mean_ms" else 1e-6
                vals.append(s[field_] * scale if s else np.nan)
                errs.append(s["std_ms"] if s and field_ == "mean_ms" else 0.0)
            bars = ax.bar(
                x + (j - 1) * width,
                vals,
                width,
                yerr=errs if field_ == "mean_ms" else None,
                capsize=3,
                label=label,
                color=f"C{j}",
            )
            ax.bar_label(bars, fmt="%.0f" if field_ == "mean_ms" else "%.2f", fontsize=7, padding=2)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(x, [n.replace(", ", "\n") for n, _t, _p in runs], fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "FlexShard vs TorchRec row-wise (and FlexShard's runtime on the row-wise plan), measured on CPU "
        "with gloo over loopback\nbytes are hardware-independent; CPU gloo step times are NOT GPU timings",
        fontsize=11,
    )
    fig.tight_layout()
    study.save_figure(fig, path)


# --- CLI -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__)  # --no-write: with --study, print only
    p.add_argument("--world", type=int, default=4, help="ranks (4 or 8; 2 emulated groups)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--tables", default=DEFAULT_TABLES, help="name:rows:dim,... (default %(default)s)")
    p.add_argument("--batch", type=int, default=128, help="samples per rank")
    p.add_argument("--len-min", type=int, default=50)
    p.add_argument("--len-max", type=int, default=100)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--budget", type=float, default=2.0, help="FlexShard budget, x row-wise memory")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--alpha", type=float, default=0.87)
    p.add_argument("--tail-mass", type=float, default=0.045)
    p.add_argument("--intra-gbps", type=float, default=450.0, help="planner's intra-group GB/s")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="planner's inter-group GB/s")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--oracle-order", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--rounds", type=int, default=2, help="timed blocks per system, in the orders of a Williams design"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-torchrec", action="store_true")
    p.add_argument(
        "--no-ablation",
        action="store_true",
        help="skip FlexShard's runtime on the plain row-wise plan (all rows cold, dedup on)",
    )
    p.add_argument(
        "--torchrec-dedup",
        action="store_true",
        help="also try TorchRec with EmbeddingCollectionSharder(use_index_dedup=True) (its "
        "fbgemm::jagged_unique_indices has no CPU kernel in fbgemm-gpu-cpu 1.8: fails on CPU)",
    )
    p.add_argument(
        "--qcomms",
        action="store_true",
        help="also run both systems with bf16 on the wire: FlexShard planned with --wire-dtype bf16, "
        "TorchRec with its quantized comms (QCommsConfig forward and backward bf16)",
    )
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", help="also write the summary here (with --study: a list, one per configuration)")
    p.add_argument(
        "--study",
        action="store_true",
        help="run the three documented configurations (--world / --batch are set by each) and write "
        "docs/results/torchrec_runtime.md and .png",
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    cfg = Config(
        world=args.world,
        groups=args.groups,
        tables=parse_tables(args.tables),
        batch=args.batch,
        len_min=args.len_min,
        len_max=args.len_max,
        warmup=args.warmup,
        steps=args.steps,
        seed=args.seed,
        budget=args.budget,
        lr=args.lr,
        alpha=args.alpha,
        tail_mass=args.tail_mass,
        intra_GBps=args.intra_gbps,
        inter_GBps=args.inter_gbps,
        profile_steps=args.profile_steps,
        oracle_order=args.oracle_order,
        threads=args.threads,
        rounds=args.rounds,
        torchrec_dedup=args.torchrec_dedup,
        qcomms=args.qcomms,
        ablation=not args.no_ablation,
        skip_torchrec=args.skip_torchrec,
        timeout_s=args.timeout,
    )
    if not cfg.skip_torchrec and len({d for _n, _r, d in cfg.tables}) > 1:
        p.error("TorchRec's EmbeddingCollection needs one embedding dim for all tables (or --skip-torchrec)")
    worlds = [o["world"] for _n, o in STUDY] if args.study else [cfg.world]
    if any(w % cfg.groups for w in worlds):
        p.error(f"--world {worlds} is not a multiple of --groups {cfg.groups}")
    if not cfg.skip_torchrec:
        try:
            import torchrec  # noqa: F401
        except Exception as e:  # still run the FlexShard half
            print(f"TorchRec unavailable ({type(e).__name__}: {e}); running FlexShard only", file=sys.stderr)
            cfg.skip_torchrec = True
    if not args.study:
        text, payload = run_config(cfg)
        print(text)
        if args.json:
            write_json(args.json, payload)
        return 0
    runs = run_study(cfg)
    runtime = time.perf_counter() - t0
    for name, text, _payload in runs:
        print(f"\n## {name}\n\n{text}")
    if args.json:
        write_json(args.json, [{"name": name, **payload} for name, _t, payload in runs])
    if not args.no_write:
        shown = [
            a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--study", "--no-write")
        ]
        command = study.command(__file__, "--study", *shown)
        study.write_markdown(study.RESULTS / "torchrec_runtime.md", render_study(cfg, runs, command, runtime))
        study_figure(runs, study.RESULTS / "torchrec_runtime.png")
    print(f"runtime {runtime:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
