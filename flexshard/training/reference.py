"""``--verify``: an unsharded reference trained on every rank's batch, and the comparison with it.

The reference holds full tables (``functional.embedding``), applies row-wise SGD / Adagrad written out
again to the rows any rank touched, and keeps a copy of the dense model and its optimizer. Each step the
sharded run's logits are compared with the reference's, and after the last step every row (weights and
optimizer state) of every copy a rank holds, and the dense parameters, within
``TOLERANCE * (1 + |reference|)`` (absolute up to 1, relative beyond: logits grow as training goes on,
and GPU ``index_add_`` sums in a nondeterministic order).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn import functional

from core.errors import FlexShardError
from flexshard.model import Batch, DenseOptimizer, SequenceRecModel, batch_logits, lookup_features
from flexshard.runtime import ShardedSequenceEmbedding

TOLERANCE = 1e-5


class VerifyError(FlexShardError):
    """A mismatch between the sharded run and the reference (exit status 1)."""


class Reference:
    """Unsharded single-process training with the same math: full tables (``functional.embedding``), row-wise
    SGD / Adagrad on the rows any rank touched, a copy of the dense model and its optimizer."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        dense: SequenceRecModel,
        dense_opt_state: dict | None,
        optimizer: str,
        lr: float,
        eps: float,
        user_table: str | None,
        device: torch.device,
    ) -> None:
        self.weights = {n: w.to(device).clone().requires_grad_(True) for n, w in weights.items()}
        self.state = {n: s.to(device).clone() for n, s in state.items()}
        self.dense = copy.deepcopy(dense)
        self.dense_opt = DenseOptimizer(self.dense.parameters(), optimizer, lr)
        if dense_opt_state is not None:
            self.dense_opt.load_state_dict(dense_opt_state)
        self.optimizer, self.lr, self.eps, self.user_table, self.device = (
            optimizer,
            lr,
            eps,
            user_table,
            device,
        )

    def step(self, batches: list[Batch]) -> list[torch.Tensor]:
        """One step on all ranks' batches (loss = sum over ranks of batch mean / world); the logits
        of each rank's batch."""
        world = len(batches)
        self.dense_opt.zero_grad()
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
        with torch.no_grad():
            for n, w in self.weights.items():
                g_full = w.grad if w.grad is not None else torch.zeros_like(w)
                rows = torch.unique(torch.cat(used[n])) if used[n] else torch.zeros(0, dtype=torch.int64)
                g = g_full[rows]
                if self.optimizer == "sgd":
                    w[rows] = w[rows] - self.lr * g
                else:
                    s = self.state[n]
                    s[rows] = s[rows] + g.pow(2).mean(dim=1)
                    w[rows] = w[rows] - self.lr * g / (s[rows].sqrt().unsqueeze(1) + self.eps)
                w.grad = None
        self.dense_opt.step()
        return outs


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max ``|a - b| / (1 + |b|)``: an absolute difference for values up to 1, relative beyond."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float(((a - b).abs() / (1 + b.abs())).max())


def step_mismatch(logits: torch.Tensor, reference_logits: torch.Tensor, rank: int, step: int) -> str:
    """'' when this rank's logits match the reference's, else a ``verify: FAILED`` line."""
    diff = max_diff(logits, reference_logits)
    if diff <= TOLERANCE:
        return ""
    return (
        f"verify: FAILED at step {step}: rank {rank}'s logits differ from the reference by "
        f"{diff:.3g} (> {TOLERANCE:g} x (1 + |reference|))"
    )


def final_check(module: ShardedSequenceEmbedding, dense, reference: Reference, rank: int) -> str:
    """'' if every row this rank holds (weights and optimizer state), and the dense parameters, match
    the reference, and every row of every table is held somewhere; else a ``verify: FAILED`` line."""
    rows = module.shard_rows()
    copies: dict[str, torch.Tensor] = {}
    for (name, _tier), (ids, _w, _s) in rows.items():  # collective part first: every rank runs it
        held = copies.setdefault(name, torch.zeros(reference.weights[name].shape[0], dtype=torch.int64))
        held[torch.as_tensor(ids, dtype=torch.int64)] += 1
    missing = ""
    for name, held in copies.items():
        total = held.to(module.device)
        dist.all_reduce(total)
        if bool((total < 1).any()) and not missing:
            missing = f"table {name!r} row {int(torch.nonzero(total < 1)[0])} is held by no rank"
    if missing:
        return f"verify: FAILED after the last step: {missing}"
    for (name, tier), (ids, w, s) in rows.items():
        idx = torch.as_tensor(ids, dtype=torch.int64)
        ref_w = reference.weights[name].detach().cpu()[idx]
        ref_s = reference.state[name].cpu()[idx]
        for what, got, want in (("weights", w, ref_w), ("optimizer state", s, ref_s)):
            diff = max_diff(got, want)
            if not diff <= TOLERANCE:
                rel = (got - want).abs() / (1 + want.abs())
                bad = int(ids[int(rel.reshape(len(ids), -1).max(1).values.argmax())])
                return (
                    f"verify: FAILED after the last step: rank {rank}, table {name!r} {tier} row {bad}: "
                    f"{what} differ from the reference by {diff:.3g} (> {TOLERANCE:g} x (1 + |reference|))"
                )
    for (pname, p), q in zip(dense.named_parameters(), reference.dense.parameters(), strict=True):
        diff = max_diff(p, q)
        if not diff <= TOLERANCE:
            return (
                f"verify: FAILED after the last step: rank {rank}, dense parameter {pname!r} differs from "
                f"the reference by {diff:.3g} (> {TOLERANCE:g} x (1 + |reference|))"
            )
    return ""
