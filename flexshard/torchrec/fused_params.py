"""TorchRec's fused parameters (``fused_params``) read as the runtime's optimizer settings.

A TorchRec sharder takes its embedding optimizer as ``fused_params = {"optimizer": EmbOptimType.X,
"learning_rate": lr, "eps": eps, "beta1": b1, "beta2": b2}``. :data:`OPTIMIZERS` maps every
``EmbOptimType`` the runtime's registry implements (:data:`flexshard.runtime.optimizers.FBGEMM_NAMES`:
``EXACT_SGD``, ``EXACT_ROWWISE_ADAGRAD``, ``EXACT_ADAGRAD``, ``ADAM``) to its runtime name, so a new row
optimizer of the registry is a fused optimizer here with no change. Defaults are fbgemm's
(``SplitTableBatchedEmbeddingBagsCodegen``): EXACT_SGD, learning rate 0.01, eps 1e-8, betas 0.9 and
0.999. ``weight_decay`` is accepted only as 0 (the registry's updates have no decay term); any other value,
and any other key, is one ConfigError line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fbgemm_gpu.split_embedding_configs import EmbOptimType

from core.errors import ConfigError
from flexshard.runtime.optimizers import FBGEMM_NAMES, Hyper

# EmbOptimType -> the runtime's optimizer name, from the registry (the one seam for new fused optimizers)
OPTIMIZERS: dict[EmbOptimType, str] = {EmbOptimType[member]: name for member, name in FBGEMM_NAMES.items()}
KNOWN_KEYS = ("optimizer", "learning_rate", "eps", "beta1", "beta2", "weight_decay")


@dataclass(frozen=True)
class OptimizerSettings:
    """The runtime's optimizer (a name of :data:`flexshard.runtime.optimizers.OPTIMIZERS`) and its
    hyper-parameters (learning rate; eps of Adagrad and Adam; Adam's betas), as
    ``ShardedSequenceEmbedding`` takes them."""

    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)


def optimizer_settings(fused_params: dict[str, Any] | None) -> OptimizerSettings:
    """``fused_params`` (TorchRec's keys :data:`KNOWN_KEYS`) as runtime settings; ConfigError naming the key
    and value for an optimizer FlexShard does not run, a value out of range, a non-zero ``weight_decay`` or
    a key it ignores."""
    params = dict(fused_params or {})
    unknown = sorted(k for k in params if k not in KNOWN_KEYS)
    if unknown:
        raise ConfigError(
            f"fused_params: key {unknown[0]!r} is not supported by FlexShardSharder (supported: {KNOWN_KEYS})"
        )
    kind = params.get("optimizer", EmbOptimType.EXACT_SGD)
    if kind not in OPTIMIZERS:
        names = ", ".join(k.name for k in OPTIMIZERS)
        raise ConfigError(f"fused_params: optimizer {kind!r} is not supported by FlexShardSharder ({names})")
    decay = params.get("weight_decay", 0.0)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or decay != 0:
        raise ConfigError(
            f"fused_params: weight_decay must be 0 (FlexShardSharder has no decay), got {decay!r}"
        )
    defaults = OptimizerSettings()
    values = {}
    for key, field in (("learning_rate", "lr"), ("eps", "eps"), ("beta1", "beta1"), ("beta2", "beta2")):
        value = params.get(key, getattr(defaults, field))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"fused_params: {key} must be a number, got {value!r}")
        values[field] = float(value)
    problem = Hyper(values["lr"], values["eps"], values["beta1"], values["beta2"]).problem()
    if problem:
        field, rest = problem.split(":", 1)
        raise ConfigError(f"fused_params: {'learning_rate' if field == 'lr' else field}:{rest}")
    return OptimizerSettings(OPTIMIZERS[kind], **values)
