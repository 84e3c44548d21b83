"""``--verify``: every step of the sharded run checked against the unsharded reference
(:class:`~flexshard.training.reference.Reference`) taking the same step from the same state.

One step ``k``:

1. the sharded run takes step ``k``; the reference takes it on every rank's batch, starting from the
   sharded run's state after step ``k - 1`` (rows and dense parameters: see 4);
2. the canonical copy of every row touched at step ``k`` (hot: rank 0's; warm: the first group's; cold:
   the owner's) is gathered on every rank;
3. checks, each failing on every rank with one ``verify: FAILED`` line:

   * every copy a rank holds of a touched row equals the canonical copy bit for bit (replicas stay
     equal), and every touched row has a canonical copy;
   * the normwise relative difference (:func:`normwise`) of this rank's logits, of the dense gradient
     (summed over ranks, before torch's optimizer), and of each table's update of the touched rows
     (weights, and the optimizer state: every state of the row packed into one vector,
     :func:`~flexshard.training.reference.pack`) is at most :func:`tolerance`;

4. the reference takes the canonical rows and the dense parameters: the next step starts from the same
   state, so rounding is judged one step at a time and never compounds. (Training is chaotic: with
   Adagrad, summation order alone drifts a free-running reference apart by 1e-5 in a few steps, and bf16
   by 1e-1.)

After the last step every row of every copy must equal the reference bit for bit (the reference followed
the run), and every row of every table must be held by some rank.

Tolerance: ``TOLERANCE_UNITS`` times the unit roundoff of the wire dtype (2^-24 for fp32, where the
difference is summation order; 2^-8 bf16; 2^-11 fp16), relative to a size. A vector is rounded at most
four times on its way (forward once; a gradient at the requester, the rail peer, and in the replica
sync). For the logits and the dense gradient the size is their norm. For a table's update it is the
update's condition norm (the reference's ``weights_scale`` / ``state_scale``): how far the updated values
move, to first order, when every term of a row's gradient sum (one per lookup) moves by its own
magnitude; that is the update's own norm where the terms agree in sign and far more where they cancel.
On top, each row's sum of ``k`` terms may be taken in another order (a GPU's atomic adds do): another
``TOLERANCE_UNITS`` float32 unit roundoffs times ``sqrt(k)`` times the condition, per row
(:func:`update_allowance`). Judged against its own norm, Adagrad's accumulator update failed falsely on an
H100 at batch 2048. The constant was set from the measured grids (docs/results/verify_grid.md).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from core.errors import FlexShardError
from core.errors import agreed as mark_agreed
from core.vocabulary import Tier, WireDtype
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.agreement import agreed_message
from flexshard.training.reference import Reference, ReferenceStep, pack

UNIT_ROUNDOFF = {WireDtype.FP32: 2.0**-24, WireDtype.BF16: 2.0**-8, WireDtype.FP16: 2.0**-11}
TOLERANCE_UNITS = 16.0
STORAGE_ROUNDINGS = 2  # the run's and the reference's float32 result each rounded once


class VerifyError(FlexShardError):
    """A mismatch between the sharded run and the reference (exit status 1)."""


def tolerance(wire: WireDtype) -> float:
    """The largest normwise relative difference accepted for one step at wire precision ``wire``."""
    return TOLERANCE_UNITS * UNIT_ROUNDOFF[wire]


def describe_tolerance(wire: WireDtype) -> str:
    """The tolerance as the run states it."""
    exponent = int(round(-np.log2(UNIT_ROUNDOFF[wire])))
    return f"{tolerance(wire):.2g} = {TOLERANCE_UNITS:g} x the {wire} unit roundoff 2^-{exponent}"


def normwise(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(||got - want||, ||want||)`` in 2-norms: the difference, and the size of what was computed."""
    return difference(got, want), _norm(want)


def difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want||`` in the 2-norm (in float64)."""
    return float(torch.linalg.vector_norm(got.detach().double().cpu() - want.detach().double().cpu()))


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.detach().double().cpu()))


def allowed_difference(tol: float, size: float, value_norm: float = 0.0) -> float:
    """The largest accepted ``||got - want||``: ``tol`` relative to the computed ``size``, plus the float32
    rounding of a stored value of norm ``value_norm`` on each side (``2 x 2^-24 x value_norm``; the
    updated rows and accumulators are stored in float32 whatever the wire)."""
    return tol * size + STORAGE_ROUNDINGS * UNIT_ROUNDOFF[WireDtype.FP32] * value_norm


_ORDER = (
    f"{TOLERANCE_UNITS:g} float32 unit roundoffs x sqrt(terms) for each row's sum in another order, plus "
    "float32 storage rounding"
)


def update_allowance(
    tol: float, scale: torch.Tensor, terms: torch.Tensor, value_norm: float
) -> tuple[float, float]:
    """``(the largest accepted ||got - want||, the condition norm ||scale||)`` for a table's update of
    ``terms[r]`` gradient terms per row ``r``, whose first-order condition is ``scale`` (rows first; see
    :class:`~flexshard.training.reference.ReferenceStep`): the wire's ``tol`` x ``||scale||`` (each term
    rounded on the wire), plus ``TOLERANCE_UNITS`` float32 unit roundoffs x ``||sqrt(terms) x scale||`` (a
    k-term float32 sum taken in another order: a GPU's atomic adds), plus the storage rounding of a
    stored value of norm ``value_norm``."""
    per_row = terms.double().sqrt().reshape(-1, *([1] * (scale.dim() - 1)))
    size, order = _norm(scale), _norm(scale.double() * per_row)
    fp32 = TOLERANCE_UNITS * UNIT_ROUNDOFF[WireDtype.FP32]
    return allowed_difference(tol, size, value_norm) + fp32 * order, size


class Verifier:
    """The ``--verify`` protocol of one rank (see the module docstring). Collective: every rank calls
    :meth:`check_step` once per step and :meth:`finish` once."""

    def __init__(self, module: ShardedSequenceEmbedding, reference: Reference, rank: int) -> None:
        self.module, self.reference, self.rank = module, reference, rank
        self.tolerance = tolerance(module.wire_dtype)
        layout = module.plan_file.layout
        first_group = int(layout.group_of_rank[rank]) == 0
        self.canonical = {Tier.HOT: rank == 0, Tier.WARM: first_group, Tier.COLD: True}
        self.largest = (0.0, "", 0)  # (share of its allowance, what, step): this rank's closest call
        self.step = 0

    def check_step(
        self, step: int, batches: list, logits: torch.Tensor, dense: torch.nn.Module, dense_grads: list
    ) -> None:
        """Step ``step``'s checks (``batches``: every rank's; ``dense_grads``: this run's summed dense
        gradients), then the reference takes the run's state. Raises :class:`VerifyError` on every rank."""
        self.step = step
        ref = self.reference.step(batches, step)  # t = the training step, not the module's own count
        canon = self._gather_canonical(ref)
        message = self._copies_problem(ref, canon) or self._difference_problem(
            ref, canon, logits, dense_grads
        )
        agreed = agreed_message(
            f"verify: FAILED at step {step}: {message}" if message else "", self.module.device
        )
        if agreed:
            raise mark_agreed(VerifyError(agreed))
        for name, (ids, w, s) in canon.items():
            self.reference.set_rows(name, ids, w, s)
        self.reference.load_dense(dense)

    def finish(self) -> str:
        """Every row of every copy equal to the reference, every row held somewhere (collective). Returns
        the closest call over all ranks and steps: the largest difference in unit roundoffs of the wire
        dtype (its share of the allowance x 16), what it was and at which step."""
        rows = self.module.shard_rows()
        message = _unheld_row(rows, self.reference, self.module.device)
        for (name, tier), (ids, w, states) in rows.items():
            s = pack(self.module.row_optimizer, states, w.shape[0])
            if message:
                break
            idx = torch.as_tensor(ids, dtype=torch.int64)
            want = self.reference.weights[name].detach().cpu()[idx], self.reference.state[name].cpu()[idx]
            row = _first_unequal(idx, (w, s), want)
            if row is not None:
                message = (
                    f"rank {self.rank}, table {name!r} {tier} row {row} differs from the state the "
                    "reference followed"
                )
        message = f"verify: FAILED after the last step: {message}" if message else ""
        agreed = agreed_message(message, self.module.device)
        if agreed:
            raise mark_agreed(VerifyError(agreed))
        calls: list = [None] * dist.get_world_size()
        dist.all_gather_object(calls, self.largest)
        share, what, step = max(calls, key=lambda c: c[0])
        if not what:  # no difference was ever above 0 (or no step was compared)
            return "largest difference 0: every compared value equal to the reference's"
        return (
            f"largest difference {share * TOLERANCE_UNITS:.2f} of the {TOLERANCE_UNITS:g} unit roundoffs "
            f"allowed ({what}, step {step})"
        )

    # --- parts -----------------------------------------------------------------------------------

    def _gather_canonical(
        self, ref: ReferenceStep
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per table the canonical copies of the touched rows, sorted by id, from every rank (collective).
        A row with no canonical copy is left out (:meth:`_copies_problem` reports it)."""
        mine = {}
        for (t, tier), shard in self.module.shards.items():
            name = self.module.table_names[t]
            if self.canonical[tier] and shard.num_rows:
                held = _held_rows(shard, ref.rows[name].numpy(), self.module.row_optimizer)
                if held[0].numel():
                    mine.setdefault(name, []).append(held)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        canon = {}
        for name in ref.rows:
            parts = [p for theirs in everyone for p in theirs.get(name, [])]
            dim = ref.weights[name].shape[1]
            ids = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, dtype=torch.int64)
            w = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dim)
            s = torch.cat([p[2] for p in parts]) if parts else torch.zeros(0)
            order = torch.argsort(ids)
            canon[name] = (ids[order], w[order], s[order])
        return canon

    def _copies_problem(self, ref: ReferenceStep, canon: dict) -> str:
        """'' when every touched row has one canonical copy and every other copy this rank holds equals it."""
        for name, rows in ref.rows.items():
            ids = canon[name][0]
            if ids.numel() != rows.numel() or not torch.equal(ids, rows):
                missing = np.setdiff1d(rows.numpy(), ids.numpy())
                what = (
                    f"row {int(missing[0])} has no copy" if missing.size else "a row has two canonical copies"
                )
                return f"table {name!r}: {what}"
        for (t, tier), shard in self.module.shards.items():
            if self.canonical[tier]:
                continue  # these rows are the canonical copies themselves
            name = self.module.table_names[t]
            ids, w, s = canon[name]
            mine, mw, ms = _held_rows(shard, ids.numpy(), self.module.row_optimizer)
            at = torch.from_numpy(np.searchsorted(ids.numpy(), mine.numpy()))
            row = _first_unequal(mine, (mw, ms), (w[at], s[at]))
            if row is not None:
                return (
                    f"rank {self.rank}'s copy of table {name!r} {tier.label} row {row} differs from the "
                    "row's other copy (replicas must stay bitwise equal)"
                )
        return ""

    def _difference_problem(
        self, ref: ReferenceStep, canon: dict, logits: torch.Tensor, dense_grads: list
    ) -> str:
        """'' when every normwise difference is within its allowance, else the first that is not."""
        flat = torch.cat([g.reshape(-1).cpu() for g in dense_grads]) if dense_grads else torch.zeros(0)
        ref_flat = torch.cat([g.reshape(-1) for g in ref.dense_grads]) if ref.dense_grads else torch.zeros(0)
        described = describe_tolerance(self.module.wire_dtype)
        checks = []  # (what, difference, allowed, why that much)
        for what, (diff, size) in (
            (f"rank {self.rank}'s logits", normwise(logits, ref.logits[self.rank])),
            ("the dense gradient", normwise(flat, ref_flat)),
        ):
            why = f"the computed norm {size:.3g} x tolerance {described}"
            checks.append((what, diff, allowed_difference(self.tolerance, size), why))
        for name, (_ids, w, s) in canon.items():
            for what, got, want, scale in (
                ("update of the touched rows", w, ref.weights[name], ref.weights_scale[name]),
                ("optimizer state update", s, ref.state[name], ref.state_scale[name]),
            ):
                allowed, size = update_allowance(self.tolerance, scale, ref.terms[name], _norm(want))
                why = f"the update's condition norm {size:.3g} x tolerance {described}, plus {_ORDER}"
                checks.append((f"table {name}'s {what}", difference(got, want), allowed, why))
        for what, diff, allowed, why in checks:
            if allowed > 0 and diff / allowed > self.largest[0]:
                self.largest = (diff / allowed, what, self.step)
            if not diff <= allowed:
                return (
                    f"{what} differs from the reference by {diff:.3g} (2-norm; {allowed:.3g} allowed: {why})"
                )
        return ""


def _first_unequal(ids: torch.Tensor, got: tuple, want: tuple) -> int | None:
    """The first id whose (weights, state) in ``got`` differ from ``want`` in any bit, or None."""
    (w, s), (want_w, want_s) = got, want
    same = s == want_s
    bad = ~((w == want_w).all(dim=1) & (same.flatten(1).all(dim=1) if same.dim() > 1 else same))
    return int(ids[int(torch.nonzero(bad)[0])]) if bool(bad.any()) else None


def _held_rows(shard, ids: np.ndarray, optimizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``shard`` whose ids are in ``ids``: (ids, weights, ``optimizer``'s state packed by
    :func:`~flexshard.training.reference.pack`) on the CPU."""
    hit = np.isin(shard.ids, ids)
    sel = torch.from_numpy(np.nonzero(hit)[0]).to(shard.weights.device)
    return (
        torch.from_numpy(shard.ids[hit]),
        shard.weights.index_select(0, sel).cpu(),
        pack(optimizer, {n: s.index_select(0, sel) for n, s in shard.states.items()}, sel.numel()).cpu(),
    )


def _unheld_row(rows: dict, reference: Reference, device: torch.device) -> str:
    """'' when every row of every table is held by some rank, else which is not (collective)."""
    copies: dict[str, torch.Tensor] = {}
    for (name, _tier), (ids, _w, _s) in rows.items():
        held = copies.setdefault(name, torch.zeros(reference.weights[name].shape[0], dtype=torch.int64))
        held[torch.as_tensor(ids, dtype=torch.int64)] += 1
    for name, held in copies.items():
        total = held.to(device)
        dist.all_reduce(total)
        if bool((total < 1).any()):
            return f"table {name!r} row {int(torch.nonzero(total < 1)[0])} is held by no rank"
    return ""
