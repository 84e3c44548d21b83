"""The rows a rank holds: one :class:`Shard` per (table, tier), with its gradients and optimizer state, and
the :class:`ShardBank` that holds the shards of one dim as row ranges of one tensor per quantity, so that
the optimizer step is one update over every table and tier (:func:`banked_shards`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from core.arrays import block_bounds
from flexshard.runtime.device_rules import gpu_paths
from flexshard.runtime.indexing import flat_nonzero
from flexshard.runtime.optimizers import OPTIMIZERS, Hyper, RowOptimizer
from flexshard.runtime.transfer import add_blocks

__all__ = ["OPTIMIZERS", "Shard", "ShardBank", "banked_shards", "touched_rows_of"]

K = TypeVar("K")  # a shard's key (the runtime's: (table, tier))


@dataclass
class HeldRows:
    """Rows this rank holds in slot order, with what the optimizer step needs of them.

    ``grads`` and ``touched`` collect this step's gradient (summed over every lookup, from every rank)
    until :meth:`apply` uses and clears them. ``states``: the optimizer's state of each row, by name
    (:mod:`flexshard.runtime.optimizers`), each with a leading rows dimension in slot order.
    """

    weights: torch.Tensor  # float32[rows, dim]
    states: dict[str, torch.Tensor]  # name -> float32[rows] or float32[rows, dim]
    grads: torch.Tensor  # float32[rows, dim]
    touched: torch.Tensor  # uint8[rows]: received gradient this step

    @property
    def num_rows(self) -> int:
        return int(self.weights.shape[0])

    def touched_rows(self) -> torch.Tensor:
        return flat_nonzero(self.touched)

    def apply(self, optimizer: RowOptimizer, hyper: Hyper, step: int) -> None:
        """``optimizer``'s update of the touched rows (``step``: the module's iteration, from 1), written
        back in place, then clear their gradients and marks. Vectorised over the touched rows."""
        if not self.num_rows:
            return
        rows = self.touched_rows()
        if rows.numel():
            g = self.grads.index_select(0, rows)
            before = {n: s.index_select(0, rows) for n, s in self.states.items()}
            w, after = optimizer.update(self.weights.index_select(0, rows), before, g, hyper, step)
            self.weights.index_copy_(0, rows, w)
            for n, s in after.items():
                self.states[n].index_copy_(0, rows, s)
            self.grads.index_fill_(0, rows, 0.0)  # gradients are non-zero only on touched rows
        self.touched.zero_()

    def clear_gradients(self) -> None:
        self.grads.zero_()
        self.touched.zero_()


@dataclass
class Shard(HeldRows):
    """The rows of one table in one tier that this rank holds, in slot order (``ids``), with their
    gradients and optimizer state (:class:`HeldRows`)."""

    ids: np.ndarray = field(kw_only=True)  # int64[rows]: the row ids, slot order
    # the bank whose row ranges these rows are (banked_shards), and the bank row of slot 0
    bank: HeldRows | None = field(default=None, kw_only=True, repr=False, compare=False)
    bank_start: int = field(default=0, kw_only=True)

    @classmethod
    def of(cls, ids: np.ndarray, weights: torch.Tensor, optimizer: RowOptimizer) -> Shard:
        """The rows ``ids`` with ``weights`` and ``optimizer``'s zero state."""
        rows, dim = weights.shape
        return cls(
            weights,
            optimizer.new_states(rows, dim, weights.device),
            torch.zeros_like(weights),
            torch.zeros(rows, dtype=torch.uint8, device=weights.device),
            ids=ids,
        )

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    def add_gradient(self, slots: torch.Tensor, grads: torch.Tensor | list[torch.Tensor]) -> None:
        """Add ``grads[i]`` to row ``slots[i]`` (repeated slots add up) and mark the rows touched. ``grads``:
        one tensor, or blocks in order (per-peer views of a receive buffer), added block by block without
        joining them (the same sums bit for bit: each row's terms in the same order)."""
        add_blocks(self.grads, slots, grads)
        self.touched.index_fill_(0, slots, 1)


@dataclass
class ShardBank(HeldRows):
    """The shards of one dim on one device as row ranges of one tensor per quantity: ``weights``,
    ``grads``, ``touched`` and each optimizer state hold every banked shard's rows, shard after shard,
    and each :class:`Shard` is views of its range. :meth:`apply` updates every touched row of every
    shard at once: the same values bit for bit as each shard's own (a row's update reads only that
    row's gradient, state and weights), in one set of ops instead of one per shard."""


def touched_rows_of(shards: list[Shard]) -> list[torch.Tensor]:
    """Per shard the slots of its touched rows, ascending (:meth:`HeldRows.touched_rows`). With the GPU's
    op choices (:func:`~flexshard.runtime.device_rules.gpu_paths`) where every shard is a row range of
    one bank: one ``torch.nonzero`` over the bank's marks and one host copy of where each shard's rows
    fall among them (two device syncs, where one per shard was as many as the shards); else one
    :func:`~flexshard.runtime.indexing.flat_nonzero` per shard. The same slots either way."""
    bank = shards[0].bank if shards else None
    if bank is None or not gpu_paths(bank.touched.device) or any(s.bank is not bank for s in shards):
        return [s.touched_rows() for s in shards]
    rows = flat_nonzero(bank.touched)  # the bank's touched rows, ascending
    starts = np.array([s.bank_start for s in shards], dtype=np.int64)
    ends = starts + np.array([s.num_rows for s in shards], dtype=np.int64)
    edges = torch.as_tensor(np.concatenate([starts, ends]), device=rows.device)
    at = torch.searchsorted(rows, edges).cpu().numpy()
    lo, hi = at[: len(shards)], at[len(shards) :]
    return [rows[a:b] - int(s) if s else rows[a:b] for a, b, s in zip(lo, hi, starts, strict=True)]


def banked_shards(
    parts: dict[K, tuple[np.ndarray, torch.Tensor]], optimizer: RowOptimizer
) -> tuple[dict[K, Shard], list[ShardBank]]:
    """A :class:`Shard` for every ``key: (ids, weights)`` of ``parts`` (weights ``[len(ids), dim]``
    float32, copied), banked by (dim, device) in the order given, and the banks, with ``optimizer``'s
    zero state."""
    by_bank: dict[tuple[int, torch.device], list[K]] = {}
    for key, (_, w) in parts.items():
        by_bank.setdefault((int(w.shape[1]), w.device), []).append(key)
    shards: dict[K, Shard] = {}
    banks = []
    for (dim, device), keys in by_bank.items():
        sizes = [int(parts[k][1].shape[0]) for k in keys]
        weights = torch.empty(sum(sizes), dim, device=device)
        bank = ShardBank(
            weights,
            optimizer.new_states(weights.shape[0], dim, device),
            torch.zeros_like(weights),
            torch.zeros(weights.shape[0], dtype=torch.uint8, device=device),
        )
        starts = block_bounds(sizes).tolist()
        for key, lo, hi in zip(keys, starts[:-1], starts[1:], strict=True):
            ids, w = parts[key]
            weights[lo:hi].copy_(w)
            shards[key] = Shard(
                weights[lo:hi],
                {n: s[lo:hi] for n, s in bank.states.items()},
                bank.grads[lo:hi],
                bank.touched[lo:hi],
                ids=ids,
                bank=bank,
                bank_start=lo,
            )
        banks.append(bank)
    return {k: shards[k] for k in parts}, banks
