"""The rows a rank holds: one :class:`Shard` per (table, tier), with its gradients and optimizer state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

OPTIMIZERS = ("sgd", "adagrad")  # row-wise: one learning rate; Adagrad keeps one accumulator per row


@dataclass
class Shard:
    """The rows of one table in one tier that this rank holds, in slot order.

    ``grads`` and ``touched`` collect this step's gradient (summed over every lookup, from every rank)
    until :meth:`apply` uses and clears them.
    """

    ids: np.ndarray  # int64[rows]: the row ids, slot order
    weights: torch.Tensor  # float32[rows, dim]
    state: torch.Tensor  # float32[rows]: row-wise Adagrad accumulator (mean of squared gradients, summed)
    grads: torch.Tensor  # float32[rows, dim]
    touched: torch.Tensor  # uint8[rows]: received gradient this step

    @classmethod
    def of(cls, ids: np.ndarray, weights: torch.Tensor) -> Shard:
        rows = weights.shape[0]
        return cls(
            ids,
            weights,
            torch.zeros(rows, device=weights.device),
            torch.zeros_like(weights),
            torch.zeros(rows, dtype=torch.uint8, device=weights.device),
        )

    @property
    def num_rows(self) -> int:
        return int(self.weights.shape[0])

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    def add_gradient(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """Add ``grads[i]`` to row ``slots[i]`` (repeated slots add up) and mark the rows touched."""
        self.grads.index_add_(0, slots, grads)
        self.touched.index_fill_(0, slots, 1)

    def touched_rows(self) -> torch.Tensor:
        return torch.nonzero(self.touched).flatten()

    def apply(self, optimizer: str, lr: float, eps: float) -> None:
        """Row-wise SGD or Adagrad on the touched rows, then clear their gradients and marks."""
        rows = self.touched_rows()
        if rows.numel():
            g = self.grads.index_select(0, rows)
            w = self.weights
            if optimizer == "sgd":
                w.index_copy_(0, rows, w.index_select(0, rows) - lr * g)
            else:
                s_rows = self.state.index_select(0, rows) + g.pow(2).mean(dim=1)
                self.state.index_copy_(0, rows, s_rows)
                w.index_copy_(0, rows, w.index_select(0, rows) - lr * g / (s_rows.sqrt().unsqueeze(1) + eps))
            self.grads.index_fill_(0, rows, 0.0)  # gradients are non-zero only on touched rows
        self.touched.zero_()

    def clear_gradients(self) -> None:
        self.grads.zero_()
        self.touched.zero_()
