"""``FlexShardSharder``: TorchRec's ``EmbeddingCollection`` sharded by a FlexShard plan inside
``DistributedModelParallel``, next to TorchRec's own sharders for every other module."""

from __future__ import annotations

import os
from typing import Any

import networkx as nx
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import BaseEmbeddingSharder, EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingCollection

from core.errors import ConfigError
from flexshard.plan_file import PlanFile
from flexshard.torchrec.fused_params import optimizer_settings
from flexshard.torchrec.plan_source import PlanSource
from flexshard.torchrec.sharded_collection import FlexShardEmbeddingCollection
from solvers.types import Workload

# What TorchRec's planner and ShardingPlan see of a FlexShard table (see FlexShardSharder).
SHARDING_TYPE = ShardingType.ROW_WISE.value
COMPUTE_KERNEL = EmbeddingComputeKernel.FUSED.value


class FlexShardSharder(BaseEmbeddingSharder[EmbeddingCollection]):
    """Shards an ``EmbeddingCollection`` with a FlexShard plan (tiers, group fetch, dedup, wire dtype):
    ``DistributedModelParallel(model, sharders=[FlexShardSharder(...), EmbeddingBagCollectionSharder()])``.

    The FlexShard plan is ``plan`` (a :class:`~flexshard.plan_file.PlanFile` or the path of one from
    ``flexshard plan``), or is made when the module is sharded from ``stats`` (a ``Workload`` or a stats
    file from ``flexshard stats``) and ``topology`` (a graph, a topology JSON or a preset; default
    H100-class hosts of ``groups`` NVLink groups of consecutive ranks), with ``strategy``, ``budget``,
    ``dedup`` and ``objective`` as ``flexshard plan`` takes them (:class:`PlanSource`). ``orders``: each
    table's hotness order (touched ids hottest first; default a stats file's). The plan must be for the
    job's world size and groups and the collection's tables (name, rows, dim), else one
    ``PlanMismatchError`` line on every rank.

    ``fused_params``: TorchRec's ``{"optimizer": EmbOptimType.EXACT_SGD | EXACT_ROWWISE_ADAGRAD |
    EXACT_ADAGRAD | ADAM, "learning_rate": lr, "eps": eps, "beta1": b1, "beta2": b2}``
    (:mod:`flexshard.torchrec.fused_params`; ``weight_decay`` 0 only). The update runs in the
    module's ``fused_optimizer.step()`` (replica sync, then the rows), which DMP's ``fused_optimizer`` and
    TorchRec's ``CombinedOptimizer`` call. ``seed``: the rows of a collection on the meta device (one with
    real weights keeps them). ``layout``, ``timeout_s``: as
    :class:`flexshard.runtime.ShardedSequenceEmbedding`.

    TorchRec's ShardingPlan: every table of the collection appears as ``ROW_WISE`` with the ``FUSED``
    kernel, the nearest of TorchRec's sharding types (rows split over every rank). With ``plan=None``,
    DMP's planner therefore enumerates, prices and places FlexShard's tables as row-wise tables (its
    memory and time estimates for them are row-wise's, not the FlexShard plan's) and never fails on them;
    :func:`flexshard_module_plan` builds the same entry for a plan given to DMP. Either way the ranks and
    row ranges in the ParameterSharding are ignored: rows live where the FlexShard plan puts them.
    """

    def __init__(
        self,
        plan: PlanFile | str | os.PathLike | None = None,
        *,
        stats: Workload | str | os.PathLike | None = None,
        topology: nx.Graph | str | os.PathLike | None = None,
        groups: int = 1,
        strategy: str = "flexshard",
        budget: float = 2.0,
        dedup: bool = True,
        objective: str = "step",
        orders: dict[str, np.ndarray] | None = None,
        fused_params: dict[str, Any] | None = None,
        seed: int = 0,
        layout: str = "exact",
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(fused_params)
        self._settings = optimizer_settings(fused_params)  # refused here, before any sharding
        self.source = PlanSource(plan, stats, topology, groups, strategy, budget, dedup, objective, orders)
        self._seed, self._layout, self._timeout_s = seed, layout, timeout_s

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> FlexShardEmbeddingCollection:
        """The collection sharded by the FlexShard plan (collective: every rank, same order)."""
        names = [c.name for c in module.embedding_configs()]
        if sorted(params) != sorted(names):
            raise ConfigError(
                f"plan: the ShardingPlan of {module_fqn or 'the module'!r} lists tables {sorted(params)}, "
                f"the collection has {sorted(names)}; FlexShardSharder shards every table of it "
                "(flexshard_module_plan builds its entry)"
            )
        tables = [(c.name, int(c.num_embeddings), int(c.embedding_dim)) for c in module.embedding_configs()]
        plan_file, orders = self.source.resolve(tables)
        return FlexShardEmbeddingCollection(
            module,
            plan_file,
            env,
            self._settings,
            orders,
            self._seed,
            device,
            self._layout,
            self._timeout_s,
        )

    def shardable_parameters(self, module: EmbeddingCollection) -> dict[str, nn.Parameter]:
        return {name.split(".")[0]: param for name, param in module.embeddings.named_parameters()}

    def sharding_types(self, compute_device_type: str) -> list[str]:  # noqa: ARG002
        return [SHARDING_TYPE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:  # noqa: ARG002
        return [COMPUTE_KERNEL]

    @property
    def module_type(self) -> type[EmbeddingCollection]:
        return EmbeddingCollection

    @property
    def sharded_module_type(self) -> type[FlexShardEmbeddingCollection]:
        return FlexShardEmbeddingCollection


def flexshard_module_plan(
    module: EmbeddingCollection,
    sharder: FlexShardSharder,
    world_size: int | None = None,
    device_type: str = "cpu",
) -> EmbeddingModuleShardingPlan:
    """The ``EmbeddingModuleShardingPlan`` entry of ``module`` for a ShardingPlan given to DMP: every
    table ``ROW_WISE`` / ``FUSED`` over ``world_size`` ranks (default: the job's), as
    :class:`FlexShardSharder` describes. ``ShardingPlan({"path.to.ec": flexshard_module_plan(...), ...})``."""
    world = dist.get_world_size() if world_size is None else int(world_size)
    return construct_module_sharding_plan(
        module,
        {c.name: row_wise(compute_kernel=COMPUTE_KERNEL) for c in module.embedding_configs()},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type=device_type,
    )
