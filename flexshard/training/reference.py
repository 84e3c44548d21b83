"""The unsharded reference of ``--verify``: full tables, the same model and the same row-wise optimizer,
taking one step on every rank's batch (the checks are in :mod:`flexshard.training.verify`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.nn import functional

from flexshard.model import Batch, SequenceRecModel, batch_logits, lookup_features


@dataclass
class ReferenceStep:
    """What one reference step computed. Rows are the ids any rank looked up, sorted, per table."""

    logits: list[torch.Tensor]  # per rank: the logits of its batch
    rows: dict[str, torch.Tensor]  # per table: int64 ids touched
    weights_before: dict[str, torch.Tensor]  # per table: [rows, dim] before the step
    weights: dict[str, torch.Tensor]  # per table: [rows, dim] after the step
    state_before: dict[str, torch.Tensor]  # per table: [rows] Adagrad accumulator before the step
    state: dict[str, torch.Tensor]  # per table: [rows] after the step
    dense_grads: list[torch.Tensor]  # per dense parameter: the gradient of the global loss


class Reference:
    """Unsharded single-process training with the same math: full tables (``functional.embedding``) and
    row-wise SGD / Adagrad on the rows any rank touched. The dense model is a copy whose parameters the
    verifier sets before each step (:meth:`load_dense`); the dense optimizer is torch's and is not redone
    here."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        dense: SequenceRecModel,
        optimizer: str,
        lr: float,
        eps: float,
        user_table: str | None,
        device: torch.device,
    ) -> None:
        self.weights = {n: w.to(device).clone().requires_grad_(True) for n, w in weights.items()}
        self.state = {n: s.to(device).clone() for n, s in state.items()}
        self.dense = copy.deepcopy(dense)
        self.optimizer, self.lr, self.eps = optimizer, lr, eps
        self.user_table, self.device = user_table, device

    def load_dense(self, dense: torch.nn.Module) -> None:
        """Take ``dense``'s parameters (the sharded run's, after its step)."""
        with torch.no_grad():
            for p, q in zip(self.dense.parameters(), dense.parameters(), strict=True):
                p.copy_(q)

    def set_rows(self, name: str, ids: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Overwrite rows ``ids`` of table ``name`` (weights and optimizer state)."""
        with torch.no_grad():
            self.weights[name][ids.to(self.device)] = weights.to(self.device)
            self.state[name][ids.to(self.device)] = state.to(self.device)

    def step(self, batches: list[Batch]) -> ReferenceStep:
        """One step on all ranks' batches (loss = sum over ranks of batch mean / world)."""
        world = len(batches)
        for p in self.dense.parameters():
            p.grad = None
        total, outs, used = None, [], {n: [] for n in self.weights}
        for b in batches:
            feats = lookup_features(b, self.user_table, self.device)
            emb = {n: functional.embedding(v, self.weights[n]) for n, (v, _l) in feats.items()}
            for n, (v, _l) in feats.items():
                used[n].append(v)
            logits = batch_logits(self.dense, emb, b, self.user_table)
            outs.append(logits.detach())
            loss = self.dense.loss(logits) / world
            total = loss if total is None else total + loss
        total.backward()
        rows, before, after, s_before, s_after = {}, {}, {}, {}, {}
        with torch.no_grad():
            for n, w in self.weights.items():
                g_full = w.grad if w.grad is not None else torch.zeros_like(w)
                r = torch.unique(torch.cat(used[n])) if used[n] else torch.zeros(0, dtype=torch.int64)
                r = r.to(self.device)
                g = g_full[r]
                rows[n], before[n], s_before[n] = r.cpu(), w[r].cpu(), self.state[n][r].cpu()
                if self.optimizer == "sgd":
                    w[r] = w[r] - self.lr * g
                else:
                    s = self.state[n]
                    s[r] = s[r] + g.pow(2).mean(dim=1)
                    w[r] = w[r] - self.lr * g / (s[r].sqrt().unsqueeze(1) + self.eps)
                after[n], s_after[n] = w[r].cpu(), self.state[n][r].cpu()
                w.grad = None
        dense_grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu()
            for p in self.dense.parameters()
        ]
        return ReferenceStep(outs, rows, before, after, s_before, s_after, dense_grads)
