"""A small sequence recommendation model on top of sequence embedding tables.

Per sample: the user's item history (one id per position in every *sequence table*; the tables'
embeddings are summed per position, plus a learned position embedding) is pooled by single-head
attention with each *candidate* item as the query (target attention, as in DIN); the pooled vector
(plus the user's embedding when a *user table* is given) is scored against the candidate's embedding
(the sum over the sequence tables of its ids). Candidates are the target (next) item followed by
``num_negatives`` random items:

* ``next-item``: sampled softmax, cross entropy over ``[target, negatives]`` with the target as label;
* ``click``: binary cross entropy, label 1 for the target and 0 for every negative.

The embeddings are not part of the dense module: :func:`lookup_features` gives the
``{table: (values, lengths)}`` input of one lookup per table (history ids, then the candidates' ids,
one per "sequence" of length 1), so a :class:`~flexshard.runtime.ShardedSequenceEmbedding` (training)
and plain full tables (the reference) feed the same :class:`SequenceRecModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from core.errors import CheckpointError, ConfigError
from flexshard.runtime import to_padded

OBJECTIVES = ("next-item", "click")


@dataclass
class Batch:
    """One rank's batch. ``history[t]``: int64[sum(lengths)] ids of sequence table ``t`` (every table
    has one id per history position); ``candidates[t]``: int64[B, 1 + K] (target first);
    ``users``: int64[B] ids of the user table, or None."""

    lengths: np.ndarray  # int64[B], >= 1
    history: dict[str, np.ndarray]
    candidates: dict[str, np.ndarray]
    users: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.lengths.size)


def lookup_features(
    batch: Batch, user_table: str | None = None, device: torch.device | str = "cpu"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{table: (values, lengths)}``: per sequence table the history ids then one length-1 entry per
    candidate; the user table (if any) one id per sample."""
    b = batch.size
    out = {}
    for name, hist in batch.history.items():
        cand = batch.candidates[name].reshape(-1)
        values = torch.as_tensor(np.concatenate([hist, cand]), dtype=torch.int64, device=device)
        lengths = torch.as_tensor(
            np.concatenate([batch.lengths, np.ones(cand.size, dtype=np.int64)]), dtype=torch.int64
        ).to(device)
        out[name] = (values, lengths)
    if user_table is not None and batch.users is not None:
        out[user_table] = (
            torch.as_tensor(batch.users, dtype=torch.int64, device=device),
            torch.ones(b, dtype=torch.int64, device=device),
        )
    return out


class SequenceRecModel(nn.Module):
    """The dense (replicated) part: position embedding, target attention, scoring (module docstring)."""

    def __init__(self, dim: int, max_len: int, objective: str = "next-item") -> None:
        super().__init__()
        if objective not in OBJECTIVES:
            raise ConfigError(f"objective: must be one of {OBJECTIVES}, got {objective!r}")
        self.dim, self.max_len, self.objective = int(dim), int(max_len), objective
        self.position = nn.Parameter(torch.randn(self.max_len, self.dim) * 0.02)
        self.query = nn.Linear(self.dim, self.dim)
        self.key = nn.Linear(self.dim, self.dim, bias=False)  # a key bias has zero gradient (softmax shift)
        self.value = nn.Linear(self.dim, self.dim)
        self.out = nn.Linear(self.dim, self.dim)

    def forward(
        self,
        history: torch.Tensor,
        mask: torch.Tensor,
        candidates: torch.Tensor,
        user: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, C]`` of ``candidates [B, C, D]`` given ``history [B, L, D]`` (``mask [B, L]``
        True on real positions, at least one per sample) and ``user [B, D]``."""
        h = history + self.position[: history.shape[1]]
        k, v = self.key(h), self.value(h)
        q = self.query(candidates)
        att = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(self.dim)  # [B, C, L]
        att = att.masked_fill(~mask[:, None, :], float("-inf"))
        pooled = self.out(torch.matmul(torch.softmax(att, dim=-1), v))  # [B, C, D]
        if user is not None:
            pooled = pooled + user[:, None, :]
        return (pooled * candidates).sum(-1)

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch; column 0 of ``logits`` is the target."""
        if self.objective == "next-item":
            labels = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
            return functional.cross_entropy(logits, labels)
        labels = torch.zeros_like(logits)
        labels[:, 0] = 1.0
        return functional.binary_cross_entropy_with_logits(logits, labels)


def batch_logits(
    model: SequenceRecModel,
    embeddings: dict[str, torch.Tensor],
    batch: Batch,
    user_table: str | None = None,
) -> torch.Tensor:
    """Logits ``[B, 1 + K]`` from the jagged outputs of one lookup of :func:`lookup_features`."""
    b = batch.size
    n_hist = int(batch.lengths.sum())
    seq = list(batch.history)
    dev = embeddings[seq[0]].device
    lengths = torch.as_tensor(batch.lengths, dtype=torch.int64, device=dev)
    n_cand = batch.candidates[seq[0]].shape[1]
    hist = sum(embeddings[name][:n_hist] for name in seq)
    cand = sum(embeddings[name][n_hist:] for name in seq).reshape(b, n_cand, -1)
    padded = to_padded(hist, lengths, model.max_len)
    mask = torch.arange(model.max_len, device=dev)[None, :] < lengths[:, None]
    user = embeddings[user_table] if user_table is not None and user_table in embeddings else None
    return model(padded, mask, cand, user)


DENSE_KINDS = {"sgd": "sgd", "rowwise_adagrad": "adagrad", "elementwise_adagrad": "adagrad", "adam": "adam"}


class DenseOptimizer:
    """Element-wise SGD, Adagrad or Adam on the dense (replicated) parameters, with ``torch.optim``'s math
    (Adagrad: ``sum += g * g; p -= lr * g / (sqrt(sum) + eps)``; Adam: ``torch.optim.Adam``'s
    ``m = lerp(m, g, 1 - b1)``, ``v = b2 v + (1 - b2) g^2``, ``p -= lr / (1 - b1^t) * m /
    (sqrt(v) / sqrt(1 - b2^t) + eps)``; no decay) but without constructing a ``torch.optim.Optimizer``,
    which imports ``torch._dynamo`` (seconds per process). ``kind``: an embedding optimizer's name
    (:data:`DENSE_KINDS`: both Adagrads take Adagrad here; ``adagrad`` is ``rowwise_adagrad``'s alias) or
    ``adagrad``. ``eps``: None for torch's default (1e-10 Adagrad, 1e-8 Adam)."""

    def __init__(
        self,
        params,
        kind: str,
        lr: float,
        eps: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
    ) -> None:
        if kind not in DENSE_KINDS and kind != "adagrad":
            raise ConfigError(f"optimizer: must be one of {', '.join(DENSE_KINDS)}, adagrad, got {kind!r}")
        self.params = list(params)
        self.kind = DENSE_KINDS.get(kind, kind)
        self.lr, self.betas = float(lr), (float(betas[0]), float(betas[1]))
        self.eps = float(eps if eps is not None else 1e-8 if self.kind == "adam" else 1e-10)
        self.sums = [torch.zeros_like(p) for p in self.params] if self.kind == "adagrad" else []
        self.moments = (
            [torch.zeros_like(p) for p in self.params for _ in range(2)] if self.kind == "adam" else []
        )  # m, v of each parameter in turn
        self.t = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.kind == "sgd":
                p.add_(p.grad, alpha=-self.lr)
            elif self.kind == "adagrad":
                self.sums[i].addcmul_(p.grad, p.grad, value=1)
                p.addcdiv_(p.grad, self.sums[i].sqrt().add_(self.eps), value=-self.lr)
            else:
                m, v = self.moments[2 * i], self.moments[2 * i + 1]
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2**self.t)).add_(self.eps)
                p.addcdiv_(m, denom, value=-self.lr / (1 - b1**self.t))

    def state_dict(self) -> dict:
        state = {
            "kind": self.kind,
            "lr": self.lr,
            "eps": self.eps,
            "sums": [s.detach().cpu().clone() for s in self.sums],
        }
        if self.kind == "adam":
            state.update(moments=[s.detach().cpu().clone() for s in self.moments], step=self.t)
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind or len(state.get("sums", [])) != len(self.sums):
            raise CheckpointError(
                f"dense optimizer state is for {state.get('kind')!r} with {len(state.get('sums', []))} "
                f"accumulators, this optimizer is {self.kind!r} with {len(self.sums)}"
            )
        if self.kind == "adam":
            step = state.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise CheckpointError(f"dense optimizer state: step {step!r} is not a count")
            self.t = step
        saved_all = list(state["sums"]) + list(state.get("moments", []) if self.kind == "adam" else [])
        mine = self.sums + self.moments
        if len(saved_all) != len(mine):
            raise CheckpointError(
                f"dense optimizer state: {len(saved_all)} tensors, this optimizer has {len(mine)}"
            )
        for k, (s, saved) in enumerate(zip(mine, saved_all, strict=True)):
            if not isinstance(saved, torch.Tensor) or saved.shape != s.shape:
                raise CheckpointError(
                    f"dense optimizer state: accumulator {k} is not a tensor of shape {list(s.shape)}"
                )
            s.copy_(saved.to(s.device))
