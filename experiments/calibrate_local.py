"""Local-work calibration of the time model: times each piece of a rank's local work with torch on this
machine and fits the seconds per unit that :class:`solvers.time_types.LocalRates` holds.

Pieces (as the runtime does them): ``dedup`` (``torch.unique(ids, return_inverse=True)``), ``route``
(the tier test by ``searchsorted`` over the sorted replicated ids, the owner by arithmetic, the sort into
destination order), ``gather`` (``index_select`` of rows), ``scatter_add`` (``index_add_`` of gradients),
``update`` (row-wise Adagrad on the touched rows: state, scale, write back), ``collective_call`` (an
8-byte ``all_reduce`` on a gloo group of one rank: the host's cost of issuing a collective), ``output``
(the benchmark's loss ``0.5 sum(v^2)`` and its backward, per output element), ``pack`` (the runtime's
own :func:`~flexshard.runtime.transfer.exchange_columns_async` on one peer, 3 tables of 64-dim vectors:
each value is copied once into the send buffer and once out of the receive buffer, units = 2 x values).

``host`` (``--host``): the runtime's own host work, measured on ``--ranks`` spawned gloo ranks in 2 groups
(the benchmark's set-up; one run per figure given) at ``--host-batches`` samples per rank (default 2,
where values cost nothing): the median step of the benchmark's row-wise, row_wise_group_dedup and
FlexShard plans (3 tables; 4, 6 and 10 collectives), less each collective's bare latency measured on
the same ranks (a tiny all-to-all or all-reduce, back to back) and the value work priced with rates
measured on the ranks at that batch, fitted over every run and batch as ``step_s + stage_s x
collectives`` at each run's share of the cores (divided by its ranks per core; the bench
multiplies it back, :meth:`LocalRates.shared`).

``--host-from JSON ...``: the host terms fitted instead to what ``flexshard bench --json`` records (or a
study's, docs/results/step_time.json) measured beyond the bench's own prediction less its host part
(:func:`calibrate_host.fit_host_to_bench`): the latency the bench's probes priced, the bandwidth and the
local rates it measured stay as they were, so the terms take up exactly what they leave of the step. The
records must have been priced with the stored terms (or ``--priced-with RATES``, a rates file); nothing is
timed, the other rates stay those. Prints each record's measured and modeled step before and after.

Sizes: batches of 64..1024 samples per rank at the default workload's ~158 ids per sample (item-side
tables), dims 32, 64 and 128 (the default tables' widths), ids drawn Zipf-like (alpha 0.87) from a
200,000-row table. Each point is the median of ``--repeats`` runs; a rate is the slope of time over
lookups (dedup, route) or over values moved (rows x dim: gather, scatter_add, update, output, pack),
fitted in relative error (:func:`_slope`).
One thread (``torch.set_num_threads(1)``), as each gloo rank of the runtime's tests runs. Run:

    nice .venv/bin/python experiments/calibrate_local.py [--out rates.json] [--repeats 5]

and copy the printed figures into ``solvers.time_types.DEFAULT_RATES`` with the date and machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexshard.local_rates import adagrad, output_loss, route  # noqa: E402
from flexshard.runtime.transfer import exchange_columns_async  # noqa: E402
from solvers.time_types import LocalRates  # noqa: E402

IDS_PER_SAMPLE = 158
BATCHES = (64, 128, 256, 512, 1024)
DIMS = (32, 64, 128)
ROWS = 200_000


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _zipf_ids(n: int, gen: np.random.Generator) -> torch.Tensor:
    ranks = np.arange(1, ROWS + 1, dtype=np.float64)
    p = ranks**-0.87
    return torch.from_numpy(gen.choice(ROWS, size=n, p=p / p.sum()).astype(np.int64))


def _exchange(tables: int, rows: int, dim: int) -> None:
    """The runtime's packing of ``tables`` columns of ``rows`` vectors into one all-to-all's send buffer
    and out of its receive buffer (:func:`flexshard.runtime.transfer.exchange_columns_async`, one peer)."""
    columns = [torch.ones(rows, dim) for _ in range(tables)]
    counts = np.full((1, tables), rows)
    exchange_columns_async("rows", columns, counts, counts, np.full(tables, dim)).wait()


def _slope(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y over x in relative error (each point weighted by 1/y), so
    that the largest sizes, past the caches and into page faults, do not set the rate of every size."""
    w = 1.0 / np.asarray(y)
    a = np.stack([np.asarray(x), np.ones(len(x))], axis=1) * w[:, None]
    (slope, intercept), *_ = np.linalg.lstsq(a, np.asarray(y) * w, rcond=None)
    return float(slope), float(intercept)


def measure(repeats: int) -> tuple[LocalRates, list[tuple]]:
    """The fitted rates and the table of measured points (piece, batch, dim, units, seconds)."""
    torch.set_num_threads(1)
    gen = np.random.default_rng(0)
    points: list[tuple] = []
    hot = torch.sort(_zipf_ids(2_000, gen).unique()).values
    for batch in BATCHES:
        ids = _zipf_ids(batch * IDS_PER_SAMPLE, gen)
        n = ids.numel()
        dedup = partial(torch.unique, ids, return_inverse=True)
        points.append(("dedup", batch, 0, n, _median_s(dedup, repeats)))
        points.append(("route", batch, 0, n, _median_s(partial(route, hot, ids), repeats)))
        uniq = torch.unique(ids)
        for dim in DIMS:
            weight, grads = torch.randn(ROWS, dim), torch.randn(n, dim)
            out, state = torch.zeros(ROWS, dim), torch.zeros(ROWS)
            timed = {
                "gather": (n * dim, partial(weight.index_select, 0, ids)),
                "scatter_add": (n * dim, partial(out.index_add_, 0, ids, grads)),
                "update": (uniq.numel() * dim, partial(adagrad, weight, state, uniq, grads[: uniq.numel()])),
            }
            for piece, (units, fn) in timed.items():
                points.append((piece, batch, dim, units, _median_s(fn, repeats)))
    for batch in BATCHES:  # the loss and its gradient over the step's output (the benchmark's loss)
        for dim in DIMS:
            out = torch.randn(batch * IDS_PER_SAMPLE, dim)
            points.append(("output", batch, dim, out.numel(), _median_s(partial(output_loss, out), repeats)))
    for batch in BATCHES:  # the runtime's own packing (one peer: its local-copy path, no collective)
        rows = batch * IDS_PER_SAMPLE // 3
        seconds = _median_s(partial(_exchange, 3, rows, 64), repeats)
        points.append(("pack", batch, 64, 2 * 3 * rows * 64, seconds))  # each value copied in and out
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        x = torch.zeros(2)
        call = _median_s(lambda: [dist.all_reduce(x) for _ in range(100)], repeats) / 100
        dist.destroy_process_group()
    fitted = {}
    for piece in ("dedup", "route", "gather", "scatter_add", "update", "output", "pack"):
        rows = [p for p in points if p[0] == piece]
        fitted[piece] = _slope([p[3] for p in rows], [p[4] for p in rows])[0]
    rates = LocalRates(
        dedup_s_per_lookup=max(fitted["dedup"], 0.0),
        route_s_per_lookup=max(fitted["route"], 0.0),
        gather_s_per_value=max(fitted["gather"], 0.0),
        scatter_add_s_per_value=max(fitted["scatter_add"], 0.0),
        update_s_per_value=max(fitted["update"], 0.0),
        collective_call_s=call,
        pack_s_per_value=max(fitted["pack"], 0.0),
        output_s_per_value=max(fitted["output"], 0.0),
        source=f"experiments/calibrate_local.py, {time.strftime('%Y-%m-%d')}, {platform.machine()} "
        f"{platform.processor() or platform.platform()}, torch {torch.__version__}, 1 thread",
    )
    return rates, points


def host_from_records(paths: list[Path], stored: LocalRates, out: Path | None) -> None:
    """``--host-from``: fit ``step_s`` and ``stage_s`` to the bench records in ``paths``, priced
    with ``stored``, and print each record's error before and after (and write the rates to ``out``)."""
    import json

    from calibrate_host import fit_host_to_bench
    from step_runs import WITHIN

    try:
        records = [r for path in paths for r in json.loads(path.read_text())]
        rates, table = fit_host_to_bench(records, stored)
    except KeyError as e:  # one line, no rates written
        raise SystemExit(
            f"calibrate_local --host-from: a record has no field {e!s}; bench --json writes it"
        ) from None
    except (OSError, ValueError, TypeError) as e:
        raise SystemExit(f"calibrate_local --host-from: {e!s}") from None
    head = f"{'ranks':>5} {'batch':>5} {'plan':<20} {'strategy':<22} {'measured':>9}"
    print(f"{head} {'before':>7} {'after':>7}  (ms; the model's error before and after the fit)")
    for nproc, batch, plan, key, measured, before, after in table:
        err = f"{before / measured - 1:+7.1%} {after / measured - 1:+7.1%}"
        print(f"{nproc:>5} {batch:>5} {str(plan)[:20]:<20} {key:<22} {measured:9.2f} {err}")
    within = [sum(abs(row[i] / row[4] - 1) <= WITHIN for row in table) for i in (5, 6)]
    print(f"within {WITHIN:.0%}: {within[0]} of {len(table)} before, {within[1]} after")
    for name in ("step_s", "stage_s", "table_stage_s", "table_s"):
        print(f"  {name:<14} {getattr(stored, name):.4g} s -> {getattr(rates, name):.4g} s")
    if out:
        rates.save(out)
        print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the rates JSON here (LocalRates.load reads it)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--host", action="store_true", help="also measure the runtime's host work (spawns ranks)")
    ap.add_argument(
        "--ranks", default="4", help="ranks of the --host runs, in 2 groups, comma-separated (default 4)"
    )
    ap.add_argument(
        "--host-batches", default="2", help="samples per rank of the --host run, comma-separated (default 2)"
    )
    ap.add_argument(
        "--host-from",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="fit only the host terms, to these bench records (see --priced-with); times nothing",
    )
    ap.add_argument(
        "--priced-with",
        type=Path,
        metavar="RATES",
        help="with --host-from: the rates file the records were priced with (default: the stored rates)",
    )
    args = ap.parse_args()
    if args.host_from:
        stored = LocalRates.load(args.priced_with) if args.priced_with else LocalRates.default()
        host_from_records(args.host_from, stored, args.out)
        return
    rates, points = measure(args.repeats)
    if args.host:
        from calibrate_host import measure_host

        batches = tuple(int(b) for b in args.host_batches.split(","))
        ranks = tuple(int(n) for n in args.ranks.split(","))
        rates, rows = measure_host(rates, ranks, batches=batches)
        print("host: strategy, ranks, batch, collectives, step ms, bare ms, model ms")
        for key, n, batch, collectives, step, bare, model in rows:
            ms = f"{step * 1e3:8.2f} {bare * 1e3:8.2f} {model * 1e3:8.2f}"
            print(f"  {key:<22} {n:>3} {batch:>5} {collectives:>3} {ms}")
    print(f"{'piece':<12} {'batch':>6} {'dim':>4} {'units':>10} {'ms':>9} {'ns/unit':>8}")
    for piece, batch, dim, units, seconds in points:
        per_unit_ns = seconds / units * 1e9
        print(f"{piece:<12} {batch:>6} {dim:>4} {units:>10,} {seconds * 1e3:>9.3f} {per_unit_ns:>8.3f}")
    print("\nfitted rates (slope over all sizes):")
    for name in LocalRates.FIELDS:
        print(f"  {name:<26} {getattr(rates, name):.4g} s")
    print(f"  source: {rates.source}")
    if args.out:
        rates.save(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
