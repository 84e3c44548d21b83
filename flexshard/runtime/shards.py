"""The rows a rank holds: one :class:`Shard` per (table, tier), with its gradients and optimizer state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flexshard.runtime.indexing import flat_nonzero
from flexshard.runtime.optimizers import OPTIMIZERS, Hyper, RowOptimizer
from flexshard.runtime.transfer import add_blocks

__all__ = ["OPTIMIZERS", "Shard"]


@dataclass
class Shard:
    """The rows of one table in one tier that this rank holds, in slot order.

    ``grads`` and ``touched`` collect this step's gradient (summed over every lookup, from every rank)
    until :meth:`apply` uses and clears them. ``states``: the optimizer's state of each row, by name
    (:mod:`flexshard.runtime.optimizers`), each with a leading rows dimension in slot order.
    """

    ids: np.ndarray  # int64[rows]: the row ids, slot order
    weights: torch.Tensor  # float32[rows, dim]
    states: dict[str, torch.Tensor]  # name -> float32[rows] or float32[rows, dim]
    grads: torch.Tensor  # float32[rows, dim]
    touched: torch.Tensor  # uint8[rows]: received gradient this step

    @classmethod
    def of(cls, ids: np.ndarray, weights: torch.Tensor, optimizer: RowOptimizer) -> Shard:
        """The rows ``ids`` with ``weights`` and ``optimizer``'s zero state."""
        rows, dim = weights.shape
        return cls(
            ids,
            weights,
            optimizer.new_states(rows, dim, weights.device),
            torch.zeros_like(weights),
            torch.zeros(rows, dtype=torch.uint8, device=weights.device),
        )

    @property
    def num_rows(self) -> int:
        return int(self.weights.shape[0])

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    def add_gradient(self, slots: torch.Tensor, grads: torch.Tensor | list[torch.Tensor]) -> None:
        """Add ``grads[i]`` to row ``slots[i]`` (repeated slots add up) and mark the rows touched. ``grads``:
        one tensor, or blocks in order (per-peer views of a receive buffer), added block by block without
        joining them (the same sums bit for bit: each row's terms in the same order)."""
        add_blocks(self.grads, slots, grads)
        self.touched.index_fill_(0, slots, 1)

    def touched_rows(self) -> torch.Tensor:
        return flat_nonzero(self.touched)

    def apply(self, optimizer: RowOptimizer, hyper: Hyper, step: int) -> None:
        """``optimizer``'s update of the touched rows (``step``: the module's iteration, from 1), then
        clear their gradients and marks. Vectorised over the touched rows."""
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
