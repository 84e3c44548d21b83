"""The runtime's host work per step and per collective, measured on spawned gloo ranks (used by
``experiments/calibrate_local.py --host``; its docstring says how).

At each batch size asked (samples per rank) the ranks run the benchmark's row-wise, row_wise_group_dedup
and FlexShard plans in alternation; the value work is priced with rates measured on the ranks at once at
that batch (:func:`flexshard.local_rates.measured_rates`, as ``flexshard bench --rates measured`` prices
it), so what is left of the step after the bare collectives and the value work is the host work the
bench adds to its predictions. Batch 2 has next to no value work; larger batches add what a batch-2 fit
misses on ranks that share cores (work between collectives long enough to be descheduled).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexshard.runtime.host_memory import keep_freed_memory  # noqa: E402
from flexshard.training.garbage import StepGarbageCollection  # noqa: E402
from solvers.time_types import LatencyTable, LocalRates  # noqa: E402

BATCHES = (2,)  # samples per rank (the default: the values' work is negligible)
STRATEGIES = ("row_wise", "row_wise_group_dedup", "flexshard")


def _median_call_s(fn, calls: int = 50) -> float:
    dist.barrier()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rank(
    rank: int, ranks: int, groups: int, steps: int, rates: LocalRates, batches: tuple, out: str
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=ranks)
    torch.set_num_threads(1)
    keep_freed_memory()  # as the bench's ranks do
    rows = []
    for batch in batches:
        rows += _batch_rows(rank, ranks, groups, steps, rates, batch, out)
    x = torch.zeros(ranks)
    a2a = _median_call_s(lambda: dist.all_to_all_single(torch.empty_like(x), x))
    ar = _median_call_s(lambda: dist.all_reduce(x))
    if rank == 0:
        rows = [
            (k, b, c, step, calls.count("all_to_all") * a2a + calls.count("all_reduce") * ar, m)
            for k, b, c, step, calls, m in rows
        ]
        Path(out, "host.json").write_text(json.dumps({"rows": rows, "a2a": a2a, "ar": ar}))
    dist.barrier()
    dist.destroy_process_group()


def _batch_rows(
    rank: int, ranks: int, groups: int, steps: int, base: LocalRates, batch: int, out: str
) -> list:
    """Rank 0: (strategy, batch, collectives, median step s of the slowest rank, the stages' kinds,
    modeled value work s) per strategy at ``batch``; other ranks: []. Collective."""
    from flexshard.bench.data import default_data
    from flexshard.bench.plans import h100_view
    from flexshard.bench.systems import RuntimeSystem
    from flexshard.local_rates import measured_rates
    from flexshard.plan_file import to_dict
    from solvers.planner import budget_bytes, make_plan
    from solvers.tier_program import OptimizerConfig
    from solvers.time_model import step_time

    data = default_data(batch, 0, ranks)
    w, view = data.workload, h100_view(ranks, groups)
    shared: list = [None]
    if rank == 0:
        made = {}
        for key in STRATEGIES:
            budget = budget_bytes(w, view, 2.0 if key == "flexshard" else 1.0)
            config = OptimizerConfig(step_time=False) if key == "flexshard" else None
            made[key] = make_plan(key, w, view, budget, dedup=True, config=config)
        docs = {k: to_dict(p.plan, w, view, p.report, "calibrate", data.orders) for k, p in made.items()}
        shared = [({k: p.plan for k, p in made.items()}, docs)]
    dist.broadcast_object_list(shared, src=0)
    plans, docs = shared[0]
    systems = []
    for key in STRATEGIES:
        path = Path(out) / f"plan_{key}_{batch}_{rank}.json"
        path.write_text(json.dumps(docs[key]))
        systems.append(RuntimeSystem(key, str(path), data.tables, data.orders, 0, 0.01))
    batches = [data.make_batch(s, rank) for s in range(4 + steps)]
    lookups = [
        (v, dim, rows) for (v, _n), (_t, rows, dim) in zip(batches[-1].values(), data.tables, strict=True)
    ]
    times: dict[str, list[float]] = {s.key: [] for s in systems}
    for s in systems:
        for b in batches[:3]:
            s.step(b)
    # Python's collector out of the timed steps and the rates, as the benchmark's rounds keep it
    with StepGarbageCollection(1) as collector:
        rates = measured_rates(lookups, base)  # on a batch past the timed ones, every rank at once
        for r in range(steps):  # alternating, as the benchmark runs them
            collector.after_step(r)  # untimed, before each round
            for s in systems:
                dist.barrier()
                t0 = time.perf_counter()
                s.step(batches[3 + r])
                times[s.key].append(time.perf_counter() - t0)
    every: list = [None] * ranks
    dist.all_gather_object(every, times)
    if rank != 0:
        return []
    rows = []
    for key in STRATEGIES:
        step = float(np.median(np.max([e[key] for e in every], axis=0)))  # slowest rank per step
        st = step_time(w, view, plans[key], LatencyTable(), rates)
        rows.append((key, batch, st.collectives, step, [s.kind for s in st.stages], st.total_s))
    return rows


def measure_host(
    rates: LocalRates, ranks: tuple = (4,), groups: int = 2, steps: int = 20, batches: tuple = BATCHES
) -> tuple[LocalRates, list]:
    """``rates`` with ``step_s`` and ``stage_s`` measured (module docstring) on each number of
    ``ranks`` at every batch of ``batches`` (samples per rank), fitted over them all at each run's share
    of the cores, and the table of (strategy, ranks, batch, collectives, median step s, bare collectives
    s, modeled value work s)."""
    base = replace(rates, step_s=0.0, stage_s=0.0, table_stage_s=0.0, table_s=0.0)
    rows, shares = [], []
    for n in ranks:
        factor = max(1.0, n / (os.cpu_count() or 1))
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(
                _rank,
                args=(n, groups, steps, base.shared(factor), tuple(batches), out),
                nprocs=n,
                start_method="spawn",
            )
            got = json.loads(Path(out, "host.json").read_text())
        for k, batch, c, step, bare, model in got["rows"]:
            rows.append((k, n, batch, c, step, bare, model))
            shares.append((k, c, step / factor, bare / factor, model / factor))  # per rank's share
    return fit_host(rates, shares, 1.0), rows


def fit_host(rates: LocalRates, rows: list, factor: float) -> LocalRates:
    """``rates`` with ``step_s`` and ``stage_s`` fitted by least squares to ``rows`` (strategy,
    collectives, median step s, bare collectives s, modeled value work s): ``step - bare - modeled =
    step_s + stage_s x collectives``, divided by ``factor`` (the ranks per core of the run); no term per
    table (``table_stage_s`` 0: at the same lookups the steps do not grow with the tables,
    docs/cost_model.md section 10.2.1b)."""
    a = np.array([[1.0, c] for _k, c, _s, _b, _m in rows])
    host = np.array([s - b - m for _k, _c, s, b, m in rows])
    (step_s, stage_s), *_ = np.linalg.lstsq(a, host, rcond=None)
    step_s, stage_s = max(step_s, 0.0) / factor, max(stage_s, 0.0) / factor
    return replace(rates, step_s=step_s, stage_s=stage_s, table_stage_s=0.0, table_s=0.0)


def priced_with(record: dict, stored: LocalRates) -> bool:
    """Whether a bench record's host terms are ``stored``'s at its ranks per core (what
    :func:`fit_host_to_bench` needs of every runtime record)."""
    rates = record["local_rates"]
    share = rates["step_s"] / stored.step_s
    return all(
        np.isclose(rates.get(name, 0.0), share * getattr(stored, name), rtol=1e-6)
        for name in ("stage_s", "table_stage_s", "table_s")
    )


def fit_host_to_bench(records: list[dict], stored: LocalRates) -> tuple[LocalRates, list]:
    """``stored`` with ``step_s`` and ``stage_s`` fitted to ``flexshard bench --json`` records (or a
    study's, e.g. docs/results/step_time.json) priced with ``stored``'s host terms: what each runtime
    strategy's measured median step leaves after its prediction less the prediction's host part, fitted
    in relative error as ``step_s + stage_s x collectives`` (no term per table: ``table_stage_s`` 0)
    times the record's ranks per core and shared-core factor (the ratio of its host part to ``stored``'s
    host work, :meth:`LocalRates.host_s`). So the host terms take up what the bench's own latency,
    bandwidth and local rates leave of the step, where ``measure_host`` subtracts a tiny collective's
    latency instead. Records without a ``host`` part (before 2026-11-28) are priced with a shared-core
    factor of 1 (exact for even owners' shares). Returns the rates and per record (ranks, batch, plan,
    strategy, measured, modeled before, modeled after), ms."""
    if stored.step_s <= 0 or stored.stage_s + stored.table_stage_s <= 0:
        raise ValueError(
            f"step_s, stage_s, table_stage_s: the rates the records were priced with have no host terms to "
            f"scale ({stored.step_s:.4g}, {stored.stage_s:.4g}, {stored.table_stage_s:.4g} s)"
        )
    used = []
    for r in records:
        if not r.get("plan_tables") or "step_ms_median" not in r:
            continue  # TorchRec (its own measured step stands in for the local work) or skipped
        rates, collectives = r["local_rates"], r["collectives_per_step"]
        share = rates["step_s"] / stored.step_s  # the record's ranks per core
        if not priced_with(r, stored):
            raise ValueError(
                f"local_rates: record {r['strategy']} was priced with other host terms than the stored ones "
                f"(step_s {rates['step_s']:.4g}, stage_s {rates.get('stage_s', 0.0):.4g}, table_stage_s "
                f"{rates.get('table_stage_s', 0.0):.4g} s); fit it against the rates it was priced with "
                "(calibrate_local.py --priced-with RATES)"
            )
        stored_ms = stored.host_s(len(r["plan_tables"]), collectives) * 1e3
        host_ms = r.get("predicted_parts_ms", {}).get("host", share * stored_ms)
        used.append((r, collectives, host_ms / stored_ms, r["predicted_step_ms"] - host_ms))
    if len(used) < 2:
        raise ValueError(f"records: {len(used)} runtime strategies with a plan; the fit needs 2 or more")
    measured = np.array([r["step_ms_median"] for r, *_ in used])
    a = np.array([[unit, unit * c] for _r, c, unit, _rest in used]) / measured[:, None]
    b = np.array([m - rest for m, (_r, _c, _unit, rest) in zip(measured, used, strict=True)]) / measured
    (step_ms, stage_ms), *_ = np.linalg.lstsq(a, b, rcond=None)
    if min(step_ms, stage_ms) < 0:  # the negative term at 0, the other refitted alone
        col = 1 if step_ms < 0 else 0
        (only,), *_ = np.linalg.lstsq(a[:, [col]], b, rcond=None)
        step_ms, stage_ms = (0.0, max(only, 0.0)) if col else (max(only, 0.0), 0.0)
    fitted = replace(stored, step_s=step_ms / 1e3, stage_s=stage_ms / 1e3, table_stage_s=0.0, table_s=0.0)
    table = [
        (
            r.get("nproc", ""),
            r.get("batch", ""),
            r.get("planned_for", r.get("plan_for", "")),
            r["strategy"],
            r["step_ms_median"],
            r["predicted_step_ms"],
            rest + unit * (step_ms + stage_ms * c),
        )
        for r, c, unit, rest in used
    ]
    return fitted, table
