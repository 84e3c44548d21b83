"""TorchRec's fused parameters (``fused_params``) read as the runtime's optimizer settings.

A TorchRec sharder takes its embedding optimizer as ``fused_params = {"optimizer": EmbOptimType.X,
"learning_rate": lr, "eps": eps}``. :data:`OPTIMIZERS` is the one place that says which ``EmbOptimType``
values FlexShard runs and as which runtime optimizer (:data:`flexshard.runtime.shards.OPTIMIZERS`); a new
fused optimizer is one entry here plus its update in the runtime. Defaults are fbgemm's
(``SplitTableBatchedEmbeddingBagsCodegen``): EXACT_SGD, learning rate 0.01, eps 1e-8.

``EXACT_ROWWISE_ADAGRAD`` is fbgemm's row-wise Adagrad: per row ``s += mean(g^2)`` over the row's dim, then
``w -= lr * g / (sqrt(s) + eps)`` (fbgemm's rowwise_adagrad update without weight decay), which is what
:meth:`flexshard.runtime.shards.Shard.apply` does for ``"adagrad"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fbgemm_gpu.split_embedding_configs import EmbOptimType

from core.errors import ConfigError

# EmbOptimType -> the runtime's optimizer name. The one seam for new fused optimizers.
OPTIMIZERS: dict[EmbOptimType, str] = {
    EmbOptimType.EXACT_SGD: "sgd",
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: "adagrad",
}
KNOWN_KEYS = ("optimizer", "learning_rate", "eps")


@dataclass(frozen=True)
class OptimizerSettings:
    """The runtime's optimizer (a name of :data:`flexshard.runtime.shards.OPTIMIZERS`), learning rate and
    Adagrad's eps, as ``ShardedSequenceEmbedding`` takes them."""

    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8


def optimizer_settings(fused_params: dict[str, Any] | None) -> OptimizerSettings:
    """``fused_params`` (TorchRec's keys ``optimizer``, ``learning_rate``, ``eps``) as runtime settings;
    ConfigError naming the key and value for an optimizer FlexShard does not run or a key it ignores."""
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
    lr, eps = params.get("learning_rate", 0.01), params.get("eps", 1e-8)
    for key, value in (("learning_rate", lr), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"fused_params: {key} must be a non-negative number, got {value!r}")
    return OptimizerSettings(OPTIMIZERS[kind], float(lr), float(eps))
