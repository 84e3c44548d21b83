"""Local-work calibration of the time model: times each piece of a rank's local work with torch on this
machine and fits the seconds per unit that :class:`solvers.time_types.LocalRates` holds.

Pieces (as the runtime does them): ``dedup`` (``torch.unique(ids, return_inverse=True)``), ``route``
(the tier test by ``searchsorted`` over the sorted replicated ids, the owner by arithmetic, the sort into
destination order), ``gather`` (``index_select`` of rows), ``scatter_add`` (``index_add_`` of gradients),
``update`` (row-wise Adagrad on the touched rows: state, scale, write back) and ``collective_call`` (an
8-byte ``all_reduce`` on a gloo group of one rank: the host's cost of issuing a collective).

Sizes: batches of 64..1024 samples per rank at the default workload's ~158 ids per sample (item-side
tables), dims 32, 64 and 128 (the default tables' widths), ids drawn Zipf-like (alpha 0.87) from a
200,000-row table. Each point is the median of ``--repeats`` runs; a rate is the least-squares slope of
time over lookups (dedup, route) or over values moved (rows x dim: gather, scatter_add, update).
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


def _route(hot: torch.Tensor, ids: torch.Tensor):
    """The tier test (searchsorted over the sorted replicated ids), the owner, the sort by destination."""
    pos = torch.searchsorted(hot, ids).clamp_(max=hot.numel() - 1)
    owner = torch.where(hot[pos] == ids, -1, ids % 8)
    return torch.sort(owner, stable=True)


def _adagrad(weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """Row-wise Adagrad on ``rows``: accumulate the mean squared gradient, scale, write the rows back."""
    s = state.index_select(0, rows) + grads.pow(2).mean(dim=1)
    state.index_copy_(0, rows, s)
    weight.index_copy_(0, rows, weight.index_select(0, rows) - 0.01 * grads / (s.sqrt() + 1e-10).unsqueeze(1))


def _slope(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y over x."""
    a = np.stack([np.asarray(x), np.ones(len(x))], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(a, np.asarray(y), rcond=None)
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
        points.append(("route", batch, 0, n, _median_s(partial(_route, hot, ids), repeats)))
        uniq = torch.unique(ids)
        for dim in DIMS:
            weight, grads = torch.randn(ROWS, dim), torch.randn(n, dim)
            out, state = torch.zeros(ROWS, dim), torch.zeros(ROWS)
            timed = {
                "gather": (n * dim, partial(weight.index_select, 0, ids)),
                "scatter_add": (n * dim, partial(out.index_add_, 0, ids, grads)),
                "update": (uniq.numel() * dim, partial(_adagrad, weight, state, uniq, grads[: uniq.numel()])),
            }
            for piece, (units, fn) in timed.items():
                points.append((piece, batch, dim, units, _median_s(fn, repeats)))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        x = torch.zeros(2)
        call = _median_s(lambda: [dist.all_reduce(x) for _ in range(100)], repeats) / 100
        dist.destroy_process_group()
    fitted = {}
    for piece in ("dedup", "route", "gather", "scatter_add", "update"):
        rows = [p for p in points if p[0] == piece]
        fitted[piece] = _slope([p[3] for p in rows], [p[4] for p in rows])[0]
    rates = LocalRates(
        dedup_s_per_lookup=max(fitted["dedup"], 0.0),
        route_s_per_lookup=max(fitted["route"], 0.0),
        gather_s_per_value=max(fitted["gather"], 0.0),
        scatter_add_s_per_value=max(fitted["scatter_add"], 0.0),
        update_s_per_value=max(fitted["update"], 0.0),
        collective_call_s=call,
        source=f"experiments/calibrate_local.py, {time.strftime('%Y-%m-%d')}, {platform.machine()} "
        f"{platform.processor() or platform.platform()}, torch {torch.__version__}, 1 thread",
    )
    return rates, points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the rates JSON here (LocalRates.load reads it)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rates, points = measure(args.repeats)
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
