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

:func:`time_pieces` runs every piece on one table's lookups alone; a piece's time is its mean over repeats
that span at least ``min_s`` seconds, so that on a machine whose cores the ranks share, the time slices
other ranks take are in it (a median of short runs would leave them out). :func:`time_in_turn` times the
pieces of every table one after the other instead, as a step runs them, so that each finds its inputs
where the others left the caches. :func:`rates_from_points` divides each piece's summed seconds by its
summed units over the points given (the rate at those sizes), and :func:`measured_rates` times in turn on
every rank of a job at once, on that rank's own batch, and takes the median over ranks: the rates of the
ranks as they run together at the run's sizes.
"""

from __future__ import annotations

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


PieceRun = tuple[str, int, Callable[[], object]]  # (piece, units, one run of it)


def piece_runs(
    ids: torch.Tensor,
    dim: int,
    num_rows: int,
    seed: int = 0,
    weight: torch.Tensor | None = None,
) -> list[PieceRun]:
    """Every piece (:data:`PIECES`, in that order) as one run on the lookups ``ids`` (int64, <
    ``num_rows``) of a table of ``num_rows`` rows of ``dim`` float32 values, on the ids' device, with its
    units. ``weight``: the table's rows to run on (``num_rows`` x ``dim`` float32 on the ids' device; the
    update piece changes them), else random ones made here."""
    device = ids.device
    n = int(ids.numel())
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if weight is None:
        weight = torch.randn(num_rows, dim, generator=gen).to(device)
    grads = torch.randn(n, dim, generator=gen).to(device)
    uniq = torch.unique(ids)
    hot = uniq[torch.randperm(uniq.numel(), generator=gen)[:HOT_IDS].to(device)].sort().values
    state, into = torch.zeros(num_rows, device=device), torch.zeros_like(weight)
    rows = weight.index_select(0, ids)
    return [
        ("dedup", n, lambda: torch.unique(ids, return_inverse=True)),
        ("route", n, lambda: route(hot, ids)),
        ("gather", n * dim, lambda: weight.index_select(0, ids)),
        ("scatter_add", n * dim, lambda: into.index_add_(0, ids, grads)),
        ("update", uniq.numel() * dim, lambda: adagrad(weight, state, uniq, grads[: uniq.numel()])),
        ("output", n * dim, lambda: output_loss(rows)),
        ("pack", 2 * n * dim, lambda: pack(list(rows.chunk(3)))),
    ]


def time_pieces(
    ids: torch.Tensor,
    dim: int,
    num_rows: int,
    min_s: float = MIN_S,
    seed: int = 0,
    weight: torch.Tensor | None = None,
) -> list[RatePoint]:
    """Every piece (:data:`PIECES`) of one table (:func:`piece_runs`) timed alone: each the mean of its
    repeats over ``min_s`` (:func:`mean_s`), so its inputs sit in whatever cache their size fits (the
    pieces' own speed; a step's are timed by :func:`time_in_turn`)."""
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else None
    return [
        RatePoint(piece, dim, units, mean_s(fn, min_s, sync))
        for piece, units, fn in piece_runs(ids, dim, num_rows, seed, weight)
    ]


def time_in_turn(
    runs: list[tuple[int, PieceRun]],
    min_s: float = MIN_S,
    sync: Callable[[], None] | None = None,
) -> list[RatePoint]:
    """Every run of ``runs`` ((dim, (piece, units, fn)) each) timed in turn, one after the other, as a step
    runs its pieces over every table: each finds its inputs where the others left the caches, not where
    repeating it alone would keep them (a piece whose tensors fit a cache runs several times faster
    alone: 2-4x at 5,000-20,000 lookups of dim 64 on a 2-core CPU with 2 MB of L2 and 32 MB of L3). One
    untimed turn, then turns until they took ``min_s`` per run in all (at least 3); a point per run: the
    mean seconds of one run. ``sync``: called after each run (``torch.cuda.synchronize`` for device
    work)."""
    if not runs:
        return []
    for _, (_, _, fn) in runs:
        fn()
    if sync:
        sync()
    seconds = [0.0] * len(runs)
    turns, total = 0, 0.0
    while turns < 3 or total < min_s * len(runs):
        for i, (_, (_, _, fn)) in enumerate(runs):
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            seconds[i] += time.perf_counter() - t0
        turns += 1
        total = sum(seconds)
    return [
        RatePoint(piece, dim, units, s / turns)
        for (dim, (piece, units, _)), s in zip(runs, seconds, strict=True)
    ]


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


def measured_rates(
    lookups: list[tuple[torch.Tensor, int, int]],
    base: LocalRates,
    min_s: float = MIN_S,
    repeats: int = REPEATS,
) -> LocalRates:
    """The local rates of this job's ranks as they run together: every rank times every piece on its own
    ``lookups`` (per table: ids, dim, rows) at once (after a barrier), each piece over every table in
    turn, piece after piece, as a step runs them (:func:`time_in_turn`), ``repeats`` times (a burst of
    other load falls on one repeat of each piece, not on every run of one piece); a rank's rate is the
    median over its repeats of :func:`rates_from_points`, and each rate is the median over ranks.
    ``base``: the host terms (collective calls, per-table and per-step host work) and any piece without
    lookups. Collective: every rank calls it. One process: no barrier."""
    import torch.distributed as dist

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    tables = [(dim, piece_runs(ids, dim, rows)) for ids, dim, rows in lookups if ids.numel()]
    runs = [(dim, each[i]) for i in range(len(PIECES)) for dim, each in tables]  # piece-major, as a step
    sync = torch.cuda.synchronize if any(ids.is_cuda for ids, _, _ in lookups) else None
    if several:
        dist.barrier()
    mine = median_rates(
        [
            rates_from_points(time_in_turn(runs, min_s, sync), base, base.source)
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
    ranks = f"{len(every)} rank{'s' if len(every) > 1 else ''}"
    return replace(
        base, **measured, source=f"measured on the job's {ranks} at the run's sizes; host: {base.source}"
    )
