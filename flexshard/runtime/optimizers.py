"""The row optimizers of the sharded tables: one registry, each with its state per row and fbgemm's update.

Each optimizer updates only the rows that received gradient this step (``g``: the gradient summed over
every lookup of the row, from every rank), as fbgemm's exact (deduplicated) TBE kernels do; untouched rows
and their state do not change. The arithmetic is fbgemm_gpu's
(``fbgemm_gpu/codegen/genscript/optimizers.py``, pytorch/FBGEMM at 71d6f8b, functions ``sgd``,
``rowwise_adagrad``, ``adagrad`` and ``adam``; weight decay 0 only, so its terms are left out), in float32:

* ``sgd`` (``EXACT_SGD``): ``w -= lr * g``.
* ``rowwise_adagrad`` (``EXACT_ROWWISE_ADAGRAD``; alias ``adagrad``, its name before these four, so plans,
  flags and checkpoints that say ``adagrad`` keep their meaning): one accumulator per row,
  ``momentum1 += sum_d(g_d^2) / dim``; ``w -= g * (lr / (sqrt(momentum1) + eps))``.
* ``elementwise_adagrad`` (``EXACT_ADAGRAD``): one accumulator per element, ``momentum1 += g * g``;
  ``w -= lr * g / (sqrt(momentum1) + eps)``.
* ``adam`` (``ADAM``): per element ``momentum1 = beta1 * momentum1 + (1 - beta1) * g`` and
  ``momentum2 = beta2 * momentum2 + (1 - beta2) * g^2``;
  ``w -= lr * (momentum1 / (1 - beta1^t)) / (sqrt(momentum2 / (1 - beta2^t)) + eps)``. ``t`` is the
  module's iteration, not the row's: fbgemm's TBE increments its ``iter`` buffer once per training
  forward (``iter_cpu.add_(1)`` before the backward kernel, so the first step has ``t = 1``), for every
  table of the module, whether or not a row was looked up (``use_rowwise_bias_correction`` False, its
  default). Here ``t`` is :attr:`ShardedSequenceEmbedding.optimizer_step` after the step: the count of
  ``step()`` calls, the same on every rank and saved with checkpoints.

State names are fbgemm's (``momentum1``, ``momentum2``); every state tensor is float32 with a leading rows
dimension: ``[rows]`` per row, ``[rows, dim]`` per element.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from core.errors import ConfigError

ALIASES = {"adagrad": "rowwise_adagrad"}  # older name -> canonical name (same meaning)
STATE_BYTES = 4  # float32
States = dict[str, torch.Tensor]  # state name -> its rows


@dataclass(frozen=True)
class Hyper:
    """Hyper-parameters of the row optimizers (fbgemm's defaults for ``eps`` and the betas)."""

    lr: float
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    def problem(self) -> str:
        """'' when the values are usable, else one line naming the field and value."""
        for name, value in (("lr", self.lr), ("eps", self.eps)):
            if not (math.isfinite(value) and value >= 0):
                return f"{name}: must be a finite number >= 0, got {value!r}"
        for name, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                return f"{name}: must be in [0, 1), got {value!r}"
        return ""


@dataclass(frozen=True)
class RowOptimizer(ABC):
    """One row optimizer: its name, fbgemm's ``OptimType`` with the same arithmetic, its state per row
    (``per_row``: one float32 each; ``per_element``: ``dim`` float32 each) and :meth:`update`."""

    name: str
    fbgemm: str  # the member of fbgemm_gpu's OptimType / TorchRec's EmbOptimType
    per_row: tuple[str, ...] = ()
    per_element: tuple[str, ...] = ()
    # whether a row looked up with a zero gradient still changes (Adam: its moments decay and it moves);
    # if not, updating an untouched row as touched is harmless (the runtime's dense sync does)
    zero_gradient_moves: bool = False
    uses_step: bool = False  # whether update reads the iteration t (Adam's bias corrections)

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """State name -> its shape per row: ``()`` per row, ``(dim,)`` per element."""
        return {**{n: () for n in self.per_row}, **{n: (dim,) for n in self.per_element}}

    def state_bytes_per_row(self, dim: int) -> int:
        """Bytes of optimizer state one row of ``dim`` elements carries (what a plan prices)."""
        return STATE_BYTES * (len(self.per_row) + dim * len(self.per_element))

    def new_states(self, rows: int, dim: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Zero state for ``rows`` rows (fbgemm starts every accumulator and moment at 0)."""
        return {n: torch.zeros((rows, *s), device=device) for n, s in self.state_shapes(dim).items()}

    @abstractmethod
    def update(
        self, w: torch.Tensor, states: States, g: torch.Tensor, hyper: Hyper, step: int
    ) -> tuple[torch.Tensor, States]:
        """The updated rows and states of the touched rows ``w`` [n, dim] with gradient ``g`` [n, dim]
        (``states``: each state's rows); ``step``: the iteration t, counted from 1. Pure: returns new
        tensors."""


class _Sgd(RowOptimizer):
    def update(
        self, w: torch.Tensor, states: States, g: torch.Tensor, hyper: Hyper, step: int
    ) -> tuple[torch.Tensor, States]:  # noqa: ARG002
        return w - hyper.lr * g, {}


class _RowwiseAdagrad(RowOptimizer):
    def update(
        self, w: torch.Tensor, states: States, g: torch.Tensor, hyper: Hyper, step: int
    ) -> tuple[torch.Tensor, States]:  # noqa: ARG002
        m = states["momentum1"] + g.pow(2).sum(dim=1) / g.shape[1]
        multiplier = hyper.lr / (m.sqrt() + hyper.eps)
        return w - g * multiplier.unsqueeze(1), {"momentum1": m}


class _ElementwiseAdagrad(RowOptimizer):
    def update(
        self, w: torch.Tensor, states: States, g: torch.Tensor, hyper: Hyper, step: int
    ) -> tuple[torch.Tensor, States]:  # noqa: ARG002
        m = states["momentum1"] + g * g
        return w - hyper.lr * g / (m.sqrt() + hyper.eps), {"momentum1": m}


class _Adam(RowOptimizer):
    def update(
        self, w: torch.Tensor, states: States, g: torch.Tensor, hyper: Hyper, step: int
    ) -> tuple[torch.Tensor, States]:
        if step < 1:
            raise ValueError(f"adam: step must be >= 1, got {step}")
        m = states["momentum1"] * hyper.beta1 + g * (1.0 - hyper.beta1)
        v = states["momentum2"] * hyper.beta2 + g * g * (1.0 - hyper.beta2)
        c1, c2 = bias_corrections(hyper, step)
        w_new = w - hyper.lr * (m / c1 / ((v / c2).sqrt() + hyper.eps))
        return w_new, {"momentum1": m, "momentum2": v}


def bias_corrections(hyper: Hyper, step: int) -> tuple[float, float]:
    """Adam's ``1 - beta^t`` for both betas, as fbgemm computes them (``powf`` in float32)."""
    t = np.float32(step)
    return (
        float(np.float32(1.0) - np.power(np.float32(hyper.beta1), t)),
        float(np.float32(1.0) - np.power(np.float32(hyper.beta2), t)),
    )


REGISTRY: dict[str, RowOptimizer] = {
    o.name: o
    for o in (
        _Sgd("sgd", "EXACT_SGD"),
        _RowwiseAdagrad("rowwise_adagrad", "EXACT_ROWWISE_ADAGRAD", per_row=("momentum1",)),
        _ElementwiseAdagrad("elementwise_adagrad", "EXACT_ADAGRAD", per_element=("momentum1",)),
        _Adam(
            "adam",
            "ADAM",
            per_element=("momentum1", "momentum2"),
            zero_gradient_moves=True,
            uses_step=True,
        ),
    )
}
OPTIMIZERS = tuple(REGISTRY)  # canonical names
FBGEMM_NAMES = {o.fbgemm: o.name for o in REGISTRY.values()}  # OptimType / EmbOptimType member -> name
OPTIMIZER_CHOICES = OPTIMIZERS + tuple(ALIASES)  # what flags and files accept


def canonical(name: str) -> str:
    """The canonical name of ``name`` (an alias resolved); ConfigError naming the value if unknown."""
    resolved = ALIASES.get(name, name) if isinstance(name, str) else name
    if resolved not in REGISTRY:
        raise ConfigError(f"optimizer: must be one of {', '.join(OPTIMIZER_CHOICES)}, got {name!r}")
    return resolved


def row_optimizer(name: str) -> RowOptimizer:
    """The registered optimizer called ``name`` (or an alias of it)."""
    return REGISTRY[canonical(name)]


def state_bytes_per_row(name: str, dim: int) -> int:
    """Bytes of ``name``'s optimizer state per row of ``dim`` elements (sgd 0, rowwise_adagrad 4,
    elementwise_adagrad 4 dim, adam 8 dim)."""
    return row_optimizer(name).state_bytes_per_row(dim)


__all__ = [
    "ALIASES",
    "FBGEMM_NAMES",
    "OPTIMIZERS",
    "OPTIMIZER_CHOICES",
    "REGISTRY",
    "Hyper",
    "RowOptimizer",
    "bias_corrections",
    "canonical",
    "row_optimizer",
    "state_bytes_per_row",
]
