"""FlexShard inside TorchRec (an optional peer: the only package that imports torchrec).

* :class:`FlexShardSharder`: an ``EmbeddingCollection`` sharder for ``DistributedModelParallel``;
  :func:`flexshard_module_plan`: its entry in a ``ShardingPlan`` given to DMP;
* :class:`FlexShardEmbeddingCollection`: the sharded module (TorchRec's ``ShardedEmbeddingModule`` contract
  on the runtime's exchange protocol); :class:`FlexShardFusedOptimizer`: its ``fused_optimizer``;
* :data:`OPTIMIZERS`: the ``EmbOptimType`` values FlexShard runs (``fused_params["optimizer"]``).
"""

from flexshard.torchrec.fused_params import OPTIMIZERS, OptimizerSettings, optimizer_settings
from flexshard.torchrec.optimizer import FlexShardFusedOptimizer
from flexshard.torchrec.plan_source import PlanSource
from flexshard.torchrec.sharded_collection import FlexShardEmbeddingCollection
from flexshard.torchrec.sharder import FlexShardSharder, flexshard_module_plan

__all__ = [
    "OPTIMIZERS",
    "FlexShardEmbeddingCollection",
    "FlexShardFusedOptimizer",
    "FlexShardSharder",
    "OptimizerSettings",
    "PlanSource",
    "flexshard_module_plan",
    "optimizer_settings",
]
