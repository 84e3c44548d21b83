"""The unsharded reference of ``--verify``: full tables, the same model and the same row-wise optimizer,
taking one step on every rank's batch (the checks are in :mod:`flexshard.training.verify`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional

from flexshard.model import Batch, SequenceRecModel, batch_logits, lookup_features
from flexshard.runtime.optimizers import Hyper, RowOptimizer, States, bias_corrections, row_optimizer


@dataclass
class ReferenceStep:
    """What one reference step computed. Rows are the ids any rank looked up, sorted, per table."""

    logits: list[torch.Tensor]  # per rank: the logits of its batch
    rows: dict[str, torch.Tensor]  # per table: int64 ids touched
    weights: dict[str, torch.Tensor]  # per table: [rows, dim] after the step
    state: dict[str, torch.Tensor]  # per table: the packed state (:func:`pack`) of the rows after the step
    dense_grads: list[torch.Tensor]  # per dense parameter: the gradient of the global loss
    # per table: how far each updated value moves when every term of the gradient's sums moves by its own
    # magnitude (the update's first-order condition): [rows, dim] for the weights, packed for the state
    weights_scale: dict[str, torch.Tensor]
    state_scale: dict[str, torch.Tensor]
    # per table: [rows] how many terms (lookups, over every rank) each row's gradient sums
    terms: dict[str, torch.Tensor]


class Reference:
    """Unsharded single-process training with the same math: full tables (``functional.embedding``) and
    the runtime's optimizer update (:mod:`flexshard.runtime.optimizers`) on the rows any rank touched;
    ``state``: per table every row's optimizer state packed into one tensor (:func:`pack`). The dense
    model is a copy whose parameters the verifier sets before each step (:meth:`load_dense`); the dense
    optimizer is torch's and is not redone here."""

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
        betas: tuple[float, float] = (0.9, 0.999),
    ) -> None:
        self.weights = {n: w.to(device).clone().requires_grad_(True) for n, w in weights.items()}
        self.state = {n: s.to(device).clone() for n, s in state.items()}
        self.dense = copy.deepcopy(dense)
        self.row_optimizer = row_optimizer(optimizer)
        self.optimizer, self.lr, self.eps = self.row_optimizer.name, lr, eps
        self.hyper = Hyper(float(lr), float(eps), float(betas[0]), float(betas[1]))
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

    def step(self, batches: list[Batch], t: int = 1) -> ReferenceStep:
        """One step on all ranks' batches (loss = sum over ranks of batch mean / world); ``t``: the
        module's iteration of this step (Adam's bias correction)."""
        world = len(batches)
        for p in self.dense.parameters():
            p.grad = None
        total, outs, used = None, [], {n: [] for n in self.weights}
        terms: dict[str, list] = {n: [] for n in self.weights}  # per table: (ids, |gradient of each lookup|)
        for b in batches:
            feats = lookup_features(b, self.user_table, self.device)
            emb = {n: functional.embedding(v, self.weights[n]) for n, (v, _l) in feats.items()}
            for n, (v, _l) in feats.items():
                used[n].append(v)
                emb[n].register_hook(_keep_abs(terms[n], v))
            logits = batch_logits(self.dense, emb, b, self.user_table)
            outs.append(logits.detach())
            loss = self.dense.loss(logits) / world
            total = loss if total is None else total + loss
        total.backward()
        rows, after, s_after, w_scale, s_scale, k = {}, {}, {}, {}, {}, {}
        with torch.no_grad():
            for n, w in self.weights.items():
                g_full = w.grad if w.grad is not None else torch.zeros_like(w)
                r = torch.unique(torch.cat(used[n])) if used[n] else torch.zeros(0, dtype=torch.int64)
                r = r.to(self.device)
                g = g_full[r]
                rows[n] = r.cpu()
                a, k[n] = _abs_sums(terms[n], r, g)
                opt, dim = self.row_optimizer, w.shape[1]
                before = unpack(opt, self.state[n][r], dim)
                w[r], states = opt.update(w[r], before, g, self.hyper, t)
                self.state[n][r] = pack(opt, states, r.numel())
                scales = update_scales(opt, g, a, states, self.hyper, t)
                w_scale[n], s_scale[n] = (x.cpu() for x in scales)
                after[n], s_after[n] = w[r].cpu(), self.state[n][r].cpu()
                w.grad = None
        dense_grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu()
            for p in self.dense.parameters()
        ]
        return ReferenceStep(outs, rows, after, s_after, dense_grads, w_scale, s_scale, k)


def _keep_abs(into: list, ids: torch.Tensor):  # noqa: ANN202 (a tensor hook)
    """A hook on a lookup's output that keeps ``(ids, |its gradient|)``, one row per looked-up id."""

    def hook(grad: torch.Tensor) -> None:
        into.append((ids.reshape(-1), grad.detach().reshape(-1, grad.shape[-1]).abs()))

    return hook


def _abs_sums(terms: list, rows: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per touched row (``rows`` sorted) of the gradient ``g``: ``[len(rows), dim]`` the sum of the absolute
    values of the terms it sums (one per lookup, over every rank's batch), and ``[len(rows)]`` (on the CPU)
    how many. The first is ``|g|`` where the terms agree in sign and far more where they cancel: rounding
    each term moves ``g`` by at most that many unit roundoffs."""
    a = torch.zeros_like(g)
    k = torch.zeros(rows.numel(), dtype=g.dtype, device=g.device)
    for ids, mags in terms:
        at = torch.searchsorted(rows, ids.to(rows.device))
        a.index_add_(0, at, mags.to(a.dtype))
        k.index_add_(0, at, torch.ones(at.numel(), dtype=k.dtype, device=k.device))
    return a, k.cpu()


def pack(optimizer: RowOptimizer, states: States, rows: int) -> torch.Tensor:
    """``rows`` rows' optimizer states as one tensor: ``[rows]`` when there is one value per row (zeros
    for SGD, which has none: what the verifier compares), else ``[rows, S]`` (each state flattened, in the
    optimizer's order: per-row states, then per-element ones)."""
    names = optimizer.per_row + optimizer.per_element
    if not names:
        return torch.zeros(rows)
    sizes = [int(np.prod(states[n].shape[1:], dtype=np.int64)) for n in names]
    packed = torch.cat([states[n].reshape(rows, size) for n, size in zip(names, sizes, strict=True)], dim=1)
    return packed.squeeze(1) if packed.shape[1] == 1 else packed


def unpack(optimizer: RowOptimizer, packed: torch.Tensor, dim: int) -> States:
    """The named states of :func:`pack`'s tensor (rows of dim ``dim``)."""
    shapes = optimizer.state_shapes(dim)
    names = optimizer.per_row + optimizer.per_element
    if not names:
        return {}  # SGD: pack's zeros stand for no state
    sizes = [int(np.prod(shapes[n], dtype=np.int64)) for n in names]
    rows, out, at = packed.shape[0], {}, 0
    flat = packed.reshape(rows, sum(sizes))
    for n, size in zip(names, sizes, strict=True):
        out[n] = flat[:, at : at + size].reshape(rows, *shapes[n])
        at += size
    return out


def update_scales(
    optimizer: RowOptimizer, g: torch.Tensor, a: torch.Tensor, after: States, hyper: Hyper, t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """First-order condition of ``optimizer``'s update of the touched rows (gradient ``g``, each element
    moving by ``a``, :func:`_abs_sums`; ``after``: the states after the step): how far the weights
    ([rows, dim]) and the packed state (:func:`pack`) move. In float64."""
    lr, eps = hyper.lr, hyper.eps
    if optimizer.name == "sgd":
        return lr * a, torch.zeros(g.shape[0], dtype=torch.float64, device=g.device)
    if optimizer.name == "rowwise_adagrad":
        return _adagrad_scales(g, a, after["momentum1"], lr, eps)
    g, a = g.double(), a.double()
    if optimizer.name == "elementwise_adagrad":
        m = after["momentum1"].double()
        dm = 2.0 * g.abs() * a  # d(g^2) = 2 g dg
        root = m.sqrt()
        rho = root + eps
        through_m = torch.where(root > 0, dm / (2.0 * root * rho).clamp_min(torch.finfo(m.dtype).tiny), 0.0)
        return (lr / rho) * (a + g.abs() * through_m), dm
    # adam: m' = b1 m + (1 - b1) g, v' = b2 v + (1 - b2) g^2, w' = w - lr (m' / c1) / (sqrt(v' / c2) + eps)
    m, v = after["momentum1"].double(), after["momentum2"].double()
    c1, c2 = bias_corrections(hyper, t)
    dm, dv = (1.0 - hyper.beta1) * a, 2.0 * (1.0 - hyper.beta2) * g.abs() * a
    r = (v / c2).sqrt()
    d = r + eps
    dr = torch.where(r > 0, dv / (2.0 * c2 * r).clamp_min(torch.finfo(v.dtype).tiny), 0.0)
    weights = (lr / (c1 * d)) * (dm + m.abs() * dr / d)
    return weights, torch.cat([dm, dv], dim=1)


def _adagrad_scales(
    g: torch.Tensor, a: torch.Tensor, s: torch.Tensor, lr: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """First-order condition of a row-wise Adagrad step: how far the accumulator's update ``mean(g^2)``
    ([rows]) and the weights' update ``-lr g / (sqrt(s) + eps)`` ([rows, dim]) move when each gradient
    element ``g_d`` moves by ``a_d`` (:func:`_abs_sums`); ``s`` is the accumulator after the step.
    In float64."""
    g, a, s = g.double(), a.double(), s.double()
    dim = g.shape[1]
    state = (2.0 / dim) * (g.abs() * a).sum(dim=1)  # d mean(g^2) = (2 / dim) sum_d g_d dg_d
    root = s.sqrt()
    rho = root + eps
    # d rho / rho through s (d sqrt(s) = ds / (2 sqrt(s))); a row whose gradient is zero moves by nothing
    through_s = torch.where(root > 0, state / (2.0 * root * rho).clamp_min(torch.finfo(s.dtype).tiny), 0.0)
    weights = (lr / rho).unsqueeze(1) * (a + g.abs() * through_s.unsqueeze(1))
    return weights, state
