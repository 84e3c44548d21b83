"""One benchmark rank (spawned locally or launched by torchrun), and the local spawn of ``--nproc`` ranks.

Every rank loads the same data, takes part in the quick probe (``--plan-for probed``, or when the time
model can use it), receives the plans rank 0 makes, builds every system, and runs the same batches through
each: ``--warmup`` untimed steps per system, then (when ``--warmup`` is not 0) passes of one untimed
step of every system until no rank's heap grew in a pass, at most ``--settle``
(:mod:`flexshard.bench.settle`), then ``--rounds`` rounds (Python's automatic garbage collection off,
a collection before every block, untimed: :mod:`flexshard.training.garbage`; ``--auto-gc`` leaves it
on), each running every system in turn
for ``--steps`` timed steps, in the orders of a Williams design (:mod:`flexshard.bench.rotation`: over
4 rounds of 4 strategies each runs once at every position and follows every other once), each block
after one untimed step of its system (when ``--warmup`` is not 0: the first step after a switch pays for
the previous system's caches and allocations). Round ``r``'s step ``k`` is the same batch for every
system.
The quick probe runs :data:`PLAN_MEASUREMENTS` times before the rounds and again after every round, and
with ``--rates measured`` the local rates are measured the same way: the plans are made with the medians
of the first, the predictions priced with the medians of all (:func:`flexshard.bench.plans.measured_view`,
:func:`rate_measurer`). TorchRec's local work, which the model does not price, is its timed steps' own
(:func:`flexshard.bench.results.thread_cpu_s`).
A step is timed on each rank between a barrier and the end of its optimizer update, in wall time, the
process's CPU and the calling thread's CPU; the collectives and bytes of the timed steps are recorded
(:mod:`flexshard.bench.recorder`). Rank 0 gathers what every rank
measured and returns the records (:mod:`flexshard.bench.results`).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.osutil import on_a_free_port
from flexshard import logs
from flexshard.bench import results
from flexshard.bench.config import RATES_CHOICES, BenchConfig
from flexshard.bench.data import BenchData, default_data, stats_data
from flexshard.bench.plans import (
    TORCHREC,
    make_plans,
    measured_view,
    plan_view,
    probe_ranks,
    repriced,
    view_figures,
)
from flexshard.bench.recorder import recording
from flexshard.bench.rotation import round_order
from flexshard.bench.settle import minor_faults, settle
from flexshard.bench.shared_host import concurrent_all_to_all_Bps, shared_bandwidth_view
from flexshard.bench.systems import RuntimeSystem, TorchRecRowWise
from flexshard.local_rates import measured_rates, median_rates
from flexshard.progress import Progress
from flexshard.runtime.host_memory import keep_freed_memory
from flexshard.runtime.local import end_rank, never_started, preload, start_ranks, wait_for_ranks
from flexshard.training.garbage import StepGarbageCollection
from solvers.time_types import LocalRates
from topology.views import ClusterView

log = logging.getLogger(__name__)


# measurements of each machine figure before the plans are made: a plan for this machine chosen on one
# flipped between near-equal plans that the medians then priced 5% apart (8 ranks, batch 1,024, 2026-11-27)
PLAN_MEASUREMENTS = 3
INTERRUPTED_LINE = "flexshard bench: interrupted; no results (the ranks were stopped)"


class Interrupted(Exception):  # noqa: N818  (not an error: Ctrl-C)
    """Ctrl-C in the parent of spawned ranks (the ranks were stopped)."""


def load_data(cfg: BenchConfig, world: int) -> BenchData:
    """The run's tables and batches (the same on every rank)."""
    if cfg.workload == "default":
        return default_data(cfg.batch, cfg.seed, world)
    from flexshard import workloads

    workload, orders, _vocab = workloads.load_workload_full(cfg.workload)
    return stats_data(workload, orders, cfg.batch, cfg.seed)


def torchrec_problem(cfg: BenchConfig, data: BenchData) -> str:
    """Why TorchRec's row-wise cannot run here ('' when it can)."""
    if not cfg.torchrec:
        return "left out (--no-torchrec)"
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if len({dim for _n, _r, dim in data.tables}) > 1:
        return "its EmbeddingCollection needs one dim for all tables"
    if dist.get_backend() != "gloo":
        return "the benchmark runs it on CPU (gloo) only"
    return ""


def _build(cfg: BenchConfig, data: BenchData, plans: dict, tmp: Path) -> tuple[list[Any], dict[str, str]]:
    """The systems in run order, and those that failed to start (key -> the error's last line)."""
    import json

    systems: list[Any] = []
    failed: dict[str, str] = {}
    for key, sp in plans.items():
        if sp.document is not None:
            path = tmp / f"plan_{key}.json"
            path.write_text(json.dumps(sp.document))
            systems.append(RuntimeSystem(key, str(path), data.tables, data.orders, cfg.seed, cfg.lr))
            continue
        try:
            systems.append(TorchRecRowWise(data.tables, cfg.lr, cfg.group_size))
        except Exception as e:  # the run goes on without it, on every rank (agreed below)
            failed[key] = traceback.format_exception_only(e)[-1].strip()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, failed)
    for got in every:
        failed = {**got, **failed}
    return [s for s in systems if s.key not in failed], failed


def threads_per_core(cfg: BenchConfig) -> float:
    """This host's torch threads per core: its ranks (torchrun's LOCAL_WORLD_SIZE, else ``--nproc``) times
    ``--threads`` over its cores; more than 1 where the ranks share cores. (Not the topology's
    ``ranks_per_core``, which counts ranks over the cores a probe recorded per host.)"""
    here = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.nproc))
    return here * cfg.threads / (os.cpu_count() or 1)


def machine_rates(cfg: BenchConfig, data: BenchData | None = None) -> LocalRates:
    """The local-work rates the predictions are priced with (``--rates``). Host terms (collective calls,
    per-table and per-step host work): this machine's stored figures, times the ranks that share a core
    (this host's ranks x ``--threads`` over its cores: 4 ranks on 2 cores do their host work at half
    speed; this host's ranks: torchrun's LOCAL_WORLD_SIZE, else ``--nproc``). Value work: ``measured`` on
    every rank at once on a batch of the run (not a timed one), :func:`flexshard.local_rates.
    measured_rates` (collective; needs ``data``); ``stored``: the stored figures with the same factor; a
    file: :meth:`LocalRates.load`, as written."""
    if cfg.rates not in RATES_CHOICES:
        return LocalRates.load(cfg.rates)
    stored = LocalRates.default().shared(threads_per_core(cfg))
    if cfg.rates == "stored" or data is None:
        return stored
    batch = data.make_batch(cfg.warmup + cfg.timed_steps, dist.get_rank())  # one past the timed batches
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    lookups = [
        (values.to(device) if device else values, dim, rows)
        for (values, _lengths), (_name, rows, dim) in zip(batch.values(), data.tables, strict=True)
    ]
    return measured_rates(lookups, stored)


def rate_measurer(cfg: BenchConfig, data: BenchData) -> Any:
    """A function that measures, on every rank at once, the rates the predictions use
    (:func:`machine_rates`); each call measures again (the bench calls it before the rounds and after
    each round, and prices with the medians). Collective: every rank calls it."""

    def measure() -> LocalRates:
        # under the timed steps' garbage collection: none inside (a full collection first), unless --auto-gc
        with StepGarbageCollection(1 if cfg.gc else 0):
            return machine_rates(cfg, data)

    return measure


def medians(taken: list[LocalRates]) -> LocalRates:
    """The per-field median of the rates measured (the count of measurements in its source)."""
    rates = median_rates(taken, taken[0].source)
    if len(taken) > 1:
        rates = replace(rates, source=f"{rates.source}; median of {len(taken)} measurements")
    return rates


def row_bytes(data: BenchData, rank: int) -> int:
    """Bytes of the rows ``rank``'s first batch looks up (float32, every lookup): the size of a step's
    largest exchange, at which the shared host's all-to-all bandwidth is measured (every rank must use
    the same: rank 0's)."""
    batch = data.make_batch(0, rank)
    return sum(
        int(values.numel()) * dim * 4
        for (values, _lengths), (_name, _rows, dim) in zip(batch.values(), data.tables, strict=True)
    )


def machine_view(probes: list, concurrent: list[float]) -> ClusterView:
    """The running job's view from its probes' medians; with ``concurrent`` (the all-to-all bandwidths
    measured with every rank at once on a shared host), every link class priced at most at their median
    (:mod:`flexshard.bench.shared_host`)."""
    view = measured_view(probes)
    return shared_bandwidth_view(view, float(np.median(concurrent))) if concurrent else view


def run_rank(cfg: BenchConfig) -> list[dict[str, Any]] | None:
    """Run the benchmark on this rank of the initialised process group; rank 0 returns the records."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.threads)
    kept = dist.get_backend() == "gloo" and keep_freed_memory()  # CPU steps: host memory reused
    data = load_data(cfg, world)
    probe_s = min(cfg.timeout_s, 120.0)
    # the plans are made on the medians of PLAN_MEASUREMENTS of each figure (probe, shared bandwidth,
    # rates), the predictions on these and one more of each after every round
    probes = [probe_ranks(cfg.groups, probe_s) for _ in range(PLAN_MEASUREMENTS)]
    # on gloo every rank's exchange shares the host's cores: its bandwidth with every rank at once
    shared_host = dist.get_backend() == "gloo"
    sharing = threads_per_core(cfg) if shared_host else 1.0  # the predictions' ranks per core
    exchange_bytes = row_bytes(data, 0)  # rank 0's batch, the same size on every rank
    concurrent = (
        [concurrent_all_to_all_Bps(exchange_bytes) for _ in range(PLAN_MEASUREMENTS)] if shared_host else []
    )
    machine = machine_view(probes, concurrent)
    planned_for = plan_view(cfg.plan_for, machine, world, cfg.groups)
    skipped = torchrec_problem(cfg, data)  # the records say why (one line under the table)
    measure = rate_measurer(cfg, data)  # measured again after every round (collective)
    taken = [measure() for _ in range(PLAN_MEASUREMENTS if cfg.rates == "measured" else 1)]
    rates = medians(taken)
    shared: list[Any] = [None]
    if rank == 0:
        made = make_plans(
            data,
            planned_for,
            machine,
            cfg.budget,
            not skipped,
            cfg.objective,
            rates,
            gpu_host=cfg.gpu_host,
            threads_per_core=sharing,
        )
        shared = [made]
    dist.broadcast_object_list(shared, src=0)
    plans = shared[0]
    with tempfile.TemporaryDirectory(prefix="flexshard-bench-") as tmp:
        systems, failed = _build(cfg, data, plans, Path(tmp))
    batches = [data.make_batch(s, rank) for s in range(cfg.warmup + cfg.timed_steps)]

    def again() -> None:  # collective, after every round
        probes.append(probe_ranks(cfg.groups, probe_s))
        if shared_host:
            concurrent.append(concurrent_all_to_all_Bps(exchange_bytes))
        if cfg.rates == "measured":
            taken.append(measure())

    measured = _run_blocks(cfg, systems, batches, rank == 0, again)
    rates = medians(taken)
    machine = machine_view(probes, concurrent)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, measured)
    if rank != 0:
        return None
    notes = {TORCHREC: skipped} if skipped else {}
    notes.update(failed)
    # TorchRec's local work (the model prices the runtime's, not TorchRec's): its timed steps' own
    torchrec_local = None
    if TORCHREC in measured["systems"] and cfg.rates == "measured":
        torchrec_local = results.thread_cpu_s(gathered, TORCHREC, threads_per_core(cfg))
    plans = repriced(plans, data.workload, machine, rates, torchrec_local, sharing)
    recs = results.records(cfg, gathered, plans, notes)
    priced = {"source": rates.source, **{name: getattr(rates, name) for name in LocalRates.FIELDS}}
    for r in recs:
        if "skipped" not in r:
            r["plan_view"] = view_figures(planned_for)
            r["local_rates"] = priced  # what the prediction priced local work with
            r["probes"] = len(probes)  # the quick probes whose medians the prediction is priced on
            if concurrent:  # bytes/s a rank sent in an all-to-all of every rank at once (median)
                r["concurrent_all_to_all_Bps"] = float(np.median(concurrent))
            r["host_memory_kept"] = kept  # runtime.host_memory: freed host memory reused, not returned
            r["settle_passes"] = measured["settle_passes"]  # warm-up passes until the heaps settled
            r["python_gc"] = "before each block" if cfg.gc else "automatic"  # flexshard.training.garbage
            if r["strategy"] == TORCHREC and torchrec_local is not None:
                r["torchrec_local_ms"] = torchrec_local * 1e3  # its own local work, measured
    return recs


def _run_blocks(
    cfg: BenchConfig, systems: list[Any], batches: list[Any], show: bool, between: Any = None
) -> dict[str, Any]:
    """Warm-up, then the alternating rounds; this rank's times, bytes and collectives per system.
    ``between``: called after every round (a collective; e.g. measuring the rates again)."""
    inputs = {s.key: [s.prepare(b) for b in batches] for s in systems}
    kept = ("times", "cpu", "thread", "faults", "sent", "own", "per_step", "blocks")  # lists; "counts" a dict
    out: dict[str, Any] = {s.key: {k: [] for k in kept} | {"counts": {}} for s in systems}
    order: list[str] = []
    on_gpu = dist.get_backend() == "nccl"
    total = len(systems) * (cfg.warmup + cfg.timed_steps)
    with Progress(total, "bench", enabled=None if show else False) as bar:
        for s in systems:
            for i in range(cfg.warmup):
                dist.barrier()
                s.step(inputs[s.key][i])
                bar.advance(f"warm-up {s.key}")

        def one_pass(i: int) -> None:  # every strategy once, on the batches in turn (their sizes vary)
            bar.note(f"warm-up until the heaps settle, pass {i + 1}")
            for s in systems:
                dist.barrier()
                s.step(inputs[s.key][i % len(batches)])

        settled = settle(one_pass, cfg.settle if cfg.warmup else 0)
        collector = StepGarbageCollection(1 if cfg.gc else 0)
        with collector:  # no automatic collection inside a timed step; one before every block
            _rounds(cfg, systems, inputs, out, order, collector, on_gpu, bar, between)
    for got in out.values():
        got["sent"] = np.asarray(got["sent"])
        got["own"] = np.asarray(got["own"]) if got["own"] else None
    return {"systems": out, "order": order, "settle_passes": settled}


def _rounds(
    cfg: BenchConfig,
    systems: list[Any],
    inputs: dict[str, list[Any]],
    out: dict[str, Any],
    order: list[str],
    collector: StepGarbageCollection,
    on_gpu: bool,
    bar: Progress,
    between: Any,
) -> None:
    """The alternating rounds of timed blocks (:func:`_run_blocks`), appending to ``out`` and ``order``;
    with ``--auto-gc`` off, ``collector`` collects before every block, untimed."""
    for r in range(cfg.rounds):  # a Williams design: balanced for position and for the strategy before
        for s in [systems[i] for i in round_order(r, len(systems))]:
            if cfg.gc:
                collector.collect()
            got = out[s.key]
            got["blocks"].append(len(order))
            order.append(s.key)
            if cfg.warmup:  # one untimed step first: the switch from the previous strategy (its
                # caches, its allocations) is not charged to this block's first timed step
                dist.barrier()
                s.step(inputs[s.key][0])
            for k in range(cfg.steps):
                batch = inputs[s.key][cfg.warmup + r * cfg.steps + k]
                dist.barrier()
                with recording(cfg.group_size) as rec:
                    faults0 = minor_faults()
                    t0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
                    s.step(batch)
                    # the calling thread's CPU, not its waits: before a GPU's synchronize, which may spin
                    thread = time.thread_time() - thread0
                    if on_gpu:  # the step's kernels, not only their launch
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    cpu = time.process_time() - cpu0  # every thread of this rank: gloo's too
                    faults = minor_faults() - faults0
                got["times"].append(dt)
                got["cpu"].append(cpu)
                got["thread"].append(thread)
                got["faults"].append(faults)
                got["sent"].append(rec.bytes_sent.copy())
                got["per_step"].append(rec.collectives)
                for kind, n in rec.counts.items():
                    got["counts"][kind] = got["counts"].get(kind, 0) + n
                if isinstance(s, RuntimeSystem):
                    got["own"].append(s.own_bytes_sent())
                bar.advance(f"round {r + 1} {s.key}")
        if between is not None:
            between()


# --- local ranks ----------------------------------------------------------------------------------


def _rank_main(rank: int, cfg: BenchConfig, port: int, outdir: str) -> None:
    """A spawned rank: Ctrl-C is the parent's to handle (it stops the ranks)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cfg.nproc))
    try:
        logs.configure(cfg.log_level)
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # TorchRec's import warns
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.nproc
        )
        records = run_rank(cfg)
        if rank == 0:
            torch.save(records, Path(outdir) / "records.pt")
        end_rank()  # barrier, destroy, os._exit(0): no interpreter teardown (its SIGABRT race)
    except BaseException:
        (Path(outdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def spawn_local(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Run the benchmark on ``cfg.nproc`` local gloo ranks (:func:`~flexshard.runtime.local.start_ranks`);
    rank 0's records. ``RuntimeError`` with the
    ranks' tracebacks when one fails or the run passes ``cfg.timeout_s``; :class:`Interrupted` on
    Ctrl-C (the ranks are killed either way). A run that never started
    (:func:`flexshard.runtime.local.never_started`: its rendezvous port was taken, or gloo's mesh failed to
    form; nothing ran) starts again on another port, up to ``RENDEZVOUS_TRIES`` times
    (:func:`core.osutil.on_a_free_port`)."""

    preload(__name__)  # every rank's module, imported once where the ranks are forked

    def once(port: int) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="flexshard-bench-") as outdir:
            ctx = start_ranks(_rank_main, (cfg, port, outdir), cfg.nproc)
            try:
                wait_for_ranks(ctx, cfg.timeout_s, outdir, "flexshard bench")
            except KeyboardInterrupt:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(timeout=5.0)
                raise Interrupted from None
            return torch.load(Path(outdir) / "records.pt", weights_only=False)

    return on_a_free_port(once, lambda err: isinstance(err, RuntimeError) and never_started(str(err)))
