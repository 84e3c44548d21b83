"""The time model's local-work rates, measured with torch on the machine at hand
(:class:`solvers.time_types.LocalRates`; solvers never import torch, so the measuring lives here).

Each piece is timed as the runtime does it, on given lookups of given tables:

* ``dedup``: ``torch.unique(ids, return_inverse=True)``; per lookup.
* ``route``: the tier test by ``searchsorted`` over the sorted replicated ids, the owner by arithmetic, the
  stable sort into destination order; per lookup.
* ``gather``: ``index_select`` of the looked-up rows; per value (a row of ``dim`` values costs ``dim``).
* ``scatter_add``: ``index_add_`` of the lookups' gradients into rows; per value.
* ``update``: row-wise Adagrad on the distinct rows (state, scale, write back); per value.
* ``output``: the benchmark's loss ``0.5 sum(v^2)`` over the looked-up rows and its backward; per value.
* ``pack``: the looked-up rows copied into one flat send buffer and out of a receive buffer into one
  tensor per table, as :func:`flexshard.runtime.transfer.exchange_columns_async` does (no collective);
  per value copied (2 per value: in and out).

:func:`time_pieces` runs every piece on one table's lookups; a piece's time is its mean over repeats that
span at least ``min_s`` seconds, so that on a machine whose cores the ranks share, the time slices other
ranks take are in it (a median of short runs would leave them out). :func:`rates_from_points` divides
each piece's summed seconds by its summed units over the points given (the rate at those sizes), and
:func:`measured_rates` does it on every rank of a job at once, on that rank's own batch, and takes the
median over ranks: the rates of the ranks as they run together at the run's sizes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from solvers.time_types import LocalRates

PIECES = ("dedup", "route", "gather", "scatter_add", "update", "output", "pack")
RATE_FIELD = {
    "dedup": "dedup_s_per_lookup",
    "route": "route_s_per_lookup",
    "gather": "gather_s_per_value",
    "scatter_add": "scatter_add_s_per_value",
    "update": "update_s_per_value",
    "output": "output_s_per_value",
    "pack": "pack_s_per_value",
}
MIN_S = 0.02  # seconds each piece is repeated for (at least 3 runs)
REPEATS = 3  # interleaved measurements of every piece; a rate is the median over them
WAIT_MIN_S = 0.1  # seconds of load-then-collective runs the collective wait is measured over
HOT_IDS = 2_000  # replicated ids the routing piece tests against (a sorted id list)
ROUTE_PEERS = 8  # owners of the routing piece's arithmetic


@dataclass(frozen=True)
class RatePoint:
    """One timed piece: ``units`` (lookups or values) in ``seconds`` (the mean of its repeats)."""

    piece: str
    dim: int
    units: int
    seconds: float


def mean_s(fn: Callable[[], object], min_s: float = MIN_S, sync: Callable[[], None] | None = None) -> float:
    """Mean seconds of ``fn()`` over repeats that take at least ``min_s`` in all (3 or more, after one
    warm-up run); ``sync``: called after each run (``torch.cuda.synchronize`` for device work)."""
    fn()
    if sync:
        sync()
    runs, t0 = 0, time.perf_counter()
    while True:
        fn()
        if sync:
            sync()
        runs += 1
        elapsed = time.perf_counter() - t0
        if runs >= 3 and elapsed >= min_s:
            return elapsed / runs


def route(hot: torch.Tensor, ids: torch.Tensor, peers: int = ROUTE_PEERS):
    """The tier test (searchsorted over the sorted replicated ids), the owner, the sort by destination."""
    pos = torch.searchsorted(hot, ids).clamp_(max=hot.numel() - 1)
    owner = torch.where(hot[pos] == ids, -1, ids % peers)
    return torch.sort(owner, stable=True)


def adagrad(weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """Row-wise Adagrad on ``rows``: accumulate the mean squared gradient, scale, write the rows back."""
    s = state.index_select(0, rows) + grads.pow(2).mean(dim=1)
    state.index_copy_(0, rows, s)
    weight.index_copy_(0, rows, weight.index_select(0, rows) - 0.01 * grads / (s.sqrt() + 1e-10).unsqueeze(1))


class HalfSquareSum(torch.autograd.Function):
    """``sum over values of 0.5 sum(v^2)`` as one autograd node: the same value, bit for bit, as
    ``sum(0.5 * v.pow(2).sum() for v in values)``, and the same gradient ``g * v`` (autograd's chain of
    add, mul, sum and pow backward nodes computes ``(g * 0.5) * (2 * v)``: the power-of-two factors are
    exact, so it is one rounding of ``g * v``), in one multiply per value instead of four nodes and
    three passes per value."""

    @staticmethod
    def forward(ctx, *values: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*values)
        return sum(0.5 * v.pow(2).sum() for v in values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(v * grad for v in ctx.saved_tensors)


def output_loss(out: torch.Tensor) -> None:
    """The benchmark's loss ``0.5 sum(v^2)`` over an output and its backward to the output's gradient
    (:class:`HalfSquareSum`, as the benchmark's step runs it)."""
    v = out.detach().requires_grad_()
    HalfSquareSum.apply(v).backward()


def pack(columns: list[torch.Tensor]) -> list[torch.Tensor]:
    """``columns`` copied into one flat buffer and out again, one tensor per column (the runtime's
    send and receive buffers of an all-to-all, without the collective)."""
    flat = torch.cat([c.reshape(-1) for c in columns])
    sizes = [c.numel() for c in columns]
    return [part.view(c.shape).clone() for part, c in zip(flat.split(sizes), columns, strict=True)]


def time_pieces(
    ids: torch.Tensor, dim: int, num_rows: int, min_s: float = MIN_S, seed: int = 0
) -> list[RatePoint]:
    """Every piece (:data:`PIECES`) timed on the lookups ``ids`` (int64, < ``num_rows``) of a table of
    ``num_rows`` rows of ``dim`` float32 values, on the ids' device."""
    device = ids.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    n = int(ids.numel())
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.randn(num_rows, dim, generator=gen).to(device)
    grads = torch.randn(n, dim, generator=gen).to(device)
    uniq = torch.unique(ids)
    hot = uniq[torch.randperm(uniq.numel(), generator=gen)[:HOT_IDS].to(device)].sort().values
    state, into = torch.zeros(num_rows, device=device), torch.zeros_like(weight)
    rows = weight.index_select(0, ids)
    timed = (
        ("dedup", n, lambda: torch.unique(ids, return_inverse=True)),
        ("route", n, lambda: route(hot, ids)),
        ("gather", n * dim, lambda: weight.index_select(0, ids)),
        ("scatter_add", n * dim, lambda: into.index_add_(0, ids, grads)),
        ("update", uniq.numel() * dim, lambda: adagrad(weight, state, uniq, grads[: uniq.numel()])),
        ("output", n * dim, lambda: output_loss(rows)),
        ("pack", 2 * n * dim, lambda: pack(list(rows.chunk(3)))),
    )
    return [RatePoint(piece, dim, units, mean_s(fn, min_s, sync)) for piece, units, fn in timed]


def rates_from_points(points: list[RatePoint], base: LocalRates, source: str) -> LocalRates:
    """``base`` with each piece's rate = its summed seconds over its summed units in ``points`` (pieces
    without points keep ``base``'s rate)."""
    rates = {}
    for piece in PIECES:
        got = [p for p in points if p.piece == piece and p.units > 0]
        if got:
            rates[RATE_FIELD[piece]] = sum(p.seconds for p in got) / sum(p.units for p in got)
    return replace(base, **rates, source=source)


def median_rates(every: list[LocalRates], source: str) -> LocalRates:
    """The per-field median of several measurements of the same rates (the first's other fields)."""
    values = np.median([[getattr(r, name) for name in LocalRates.FIELDS] for r in every], axis=0)
    return replace(every[0], **dict(zip(LocalRates.FIELDS, map(float, values), strict=True)), source=source)


def run_times_s(fn: Callable[[], object], runs: int) -> np.ndarray:
    """Seconds of each of ``runs`` runs of ``fn()`` after one warm-up run (a run count every rank agrees
    on: ``fn`` may be a collective, so no rank may stop before the others)."""
    fn()
    out = np.empty(runs)
    for i in range(runs):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
    return out


def paired_times_s(load: Callable[[], object], exchange: Callable[[], object], runs: int):
    """``runs`` pairs, after one warm-up pair, each ``load()``, ``load()`` again, then ``exchange()``:
    seconds of the first ``load()`` and of the whole pair (float64[runs] each). Every pair starts at the
    previous exchange, a point common to every rank; a change in other load falls on both loads of a
    pair alike."""
    alone, whole = np.empty(runs), np.empty(runs)
    for i in range(-1, runs):
        t0 = time.perf_counter()
        load()
        t1 = time.perf_counter()
        load()
        exchange()
        if i >= 0:
            alone[i], whole[i] = t1 - t0, time.perf_counter() - t0
    return alone, whole


def collective_wait_s(load: Callable[[], object], min_s: float = WAIT_MIN_S) -> float:
    """Seconds a small world all-to-all waits, beyond its bare latency, when the ranks arrive at it from
    local work, as a step's collectives do. Every rank runs, all ranks at once and the same number of
    times (enough for ``min_s`` of the slowest rank's ``load()``): the all-to-all alone (``bare``: the
    median over runs and ranks), then pairs of two ``load()`` and the all-to-all
    (:func:`paired_times_s`). Per pair, ``whole`` is the median over ranks of the pair's time and
    ``load`` the slowest rank's first ``load()`` (a step waits for the slowest rank, and the model prices
    its local work: uneven work is not a wait); the wait is ``max(0, median over pairs of (whole -
    2 load) - bare)``. Where
    ranks share cores, a rank descheduled by the others' work holds every rank at the collective; with a
    core per rank the wait is about 0. Collective: every rank calls it; one process: 0."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return 0.0
    world = dist.get_world_size()
    send, recv = torch.zeros(world), torch.empty(world)

    def exchange() -> None:
        dist.all_to_all_single(recv, send)

    dist.barrier()
    first = torch.tensor([mean_s(load, min_s / 4)], dtype=torch.float64)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    runs = max(5, math.ceil(min_s / max(float(first), 1e-6)))
    dist.barrier()
    bare = run_times_s(exchange, runs)
    dist.barrier()
    alone, whole = paired_times_s(load, exchange, runs)
    every: list = [None] * world
    dist.all_gather_object(every, (np.asarray(bare), np.asarray(alone), np.asarray(whole)))
    t_bare = float(np.median(np.concatenate([e[0] for e in every])))
    per_pair = np.median([e[2] for e in every], axis=0) - 2 * np.max([e[1] for e in every], axis=0)
    return max(0.0, float(np.median(per_pair)) - t_bare)


def measured_rates(
    lookups: list[tuple[torch.Tensor, int, int]],
    base: LocalRates,
    min_s: float = MIN_S,
    repeats: int = REPEATS,
    wait: bool = False,
) -> LocalRates:
    """The local rates of this job's ranks as they run together: every rank times every piece on its own
    ``lookups`` (per table: ids, dim, rows) at once (after a barrier), ``repeats`` times with the pieces
    interleaved (piece after piece, then again: a burst of other load falls on one repeat of each piece,
    not on every run of one piece); a rank's rate is the median over its repeats of
    :func:`rates_from_points`, and each rate is the median over ranks. ``base``: the host terms
    (collective calls, per-table and per-step host work) and any piece without lookups. ``wait``: also
    measure :func:`collective_wait_s` (the median of ``repeats``), with the value work of the rank's
    lookups (a gather and a scatter-add of every table) as the load. Collective: every rank calls it.
    One process: no barrier, no wait."""
    import torch.distributed as dist

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if several:
        dist.barrier()
    mine = median_rates(
        [
            rates_from_points(
                [p for ids, dim, rows in lookups if ids.numel() for p in time_pieces(ids, dim, rows, min_s)],
                base,
                base.source,
            )
            for _ in range(max(1, repeats))
        ],
        base.source,
    )
    values = [getattr(mine, RATE_FIELD[p]) for p in PIECES]
    every = [values]
    if several:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, values)
    median = np.median(np.asarray(every, dtype=np.float64), axis=0)
    measured = {RATE_FIELD[p]: float(v) for p, v in zip(PIECES, median, strict=True)}
    if wait and several:
        load = value_work(lookups)
        measured["collective_wait_s"] = float(
            np.median([collective_wait_s(load) for _ in range(max(1, repeats))])
        )
    ranks = f"{len(every)} rank{'s' if len(every) > 1 else ''}"
    return replace(
        base, **measured, source=f"measured on the job's {ranks} at the run's sizes; host: {base.source}"
    )


def value_work(lookups: list[tuple[torch.Tensor, int, int]]) -> Callable[[], None]:
    """A step's value work on ``lookups`` (per table: ids, dim, rows): a gather of every lookup's row and
    a scatter-add of its gradient, every table (the load :func:`collective_wait_s` arrives from)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    tables = [
        (ids, torch.randn(rows, dim, generator=gen).to(ids.device))
        for ids, dim, rows in lookups
        if ids.numel()
    ]

    def run() -> None:
        for ids, weight in tables:
            weight.index_add_(0, ids, weight.index_select(0, ids), alpha=0.0)

    return run
