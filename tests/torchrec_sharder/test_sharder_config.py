"""FlexShardSharder's settings without a process group: fused parameters, plan sources, what TorchRec's
planner and ShardingPlan see of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec is an optional peer (scripts/setup_torchrec.sh)")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import EmbeddingCollection, EmbeddingConfig  # noqa: E402

from core.errors import ConfigError, PlanMismatchError  # noqa: E402
from flexshard.runtime import OPTIMIZERS as RUNTIME_OPTIMIZERS  # noqa: E402
from flexshard.torchrec import (  # noqa: E402
    OPTIMIZERS,
    FlexShardSharder,
    PlanSource,
    flexshard_module_plan,
    optimizer_settings,
)
from flexshard.torchrec.plan_source import _restricted  # noqa: E402
from flexshard.workloads import zipf_table  # noqa: E402
from solvers.types import Workload  # noqa: E402


def test_fused_params_map_to_the_runtime_optimizers():
    assert optimizer_settings(None) == optimizer_settings({})  # fbgemm's defaults
    default = optimizer_settings(None)
    assert (default.optimizer, default.lr, default.eps, default.betas) == ("sgd", 0.01, 1e-8, (0.9, 0.999))
    assert OPTIMIZERS == {
        EmbOptimType.EXACT_SGD: "sgd",
        EmbOptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad",
        EmbOptimType.EXACT_ADAGRAD: "elementwise_adagrad",
        EmbOptimType.ADAM: "adam",
    }
    assert sorted(OPTIMIZERS.values()) == sorted(RUNTIME_OPTIMIZERS)  # every optimizer of the registry
    for kind, name in OPTIMIZERS.items():
        got = optimizer_settings(
            {
                "optimizer": kind,
                "learning_rate": 0.5,
                "eps": 1e-6,
                "beta1": 0.8,
                "beta2": 0.99,
                "weight_decay": 0,
            }
        )
        assert (got.optimizer, got.lr, got.eps, got.betas) == (name, 0.5, 1e-6, (0.8, 0.99))


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"optimizer": EmbOptimType.LAMB}, "fused_params: optimizer <EmbOptimType.LAMB"),
        ({"learning_rate": -1.0}, "fused_params: learning_rate: must be a finite number >= 0, got -1.0"),
        ({"eps": "small"}, "fused_params: eps must be a number, got 'small'"),
        ({"beta1": 1.0}, "fused_params: beta1: must be in [0, 1), got 1.0"),
        (
            {"weight_decay": 0.1},
            "fused_params: weight_decay must be 0 (FlexShardSharder has no decay), got 0.1",
        ),
        ({"momentum": 0.9}, "fused_params: key 'momentum' is not supported"),
    ],
)
def test_unsupported_fused_params_are_refused_in_one_line(params, names):
    with pytest.raises(ConfigError) as e:
        FlexShardSharder("plan.json", fused_params=params)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_a_plan_source_is_a_plan_or_statistics():
    with pytest.raises(ConfigError, match="exactly one of plan"):
        PlanSource()
    with pytest.raises(ConfigError, match="exactly one of plan"):
        PlanSource("plan.json", stats="stats.npz")
    with pytest.raises(ConfigError, match="objective: must be one of"):
        PlanSource(stats="stats.npz", objective="fast")


def test_statistics_are_restricted_to_the_collection_at_its_dims():
    workload = Workload(
        "w", (zipf_table("a", 100, 4, 3.0), zipf_table("b", 50, 4, 3.0)), batch_size_per_gpu=8
    )
    picked = _restricted(workload, [("b", 50, 16)])
    assert [(t.name, t.num_rows, t.dim) for t in picked.tables] == [("b", 50, 16)]
    assert np.array_equal(picked.tables[0].hist.prob, workload.tables[1].hist.prob)
    with pytest.raises(PlanMismatchError, match="no table 'c' in workload 'w'"):
        _restricted(workload, [("c", 10, 4)])
    assert workload.tables[1].dim == 4  # the input is not modified


def test_torchrec_sees_every_table_row_wise_fused():
    sharder = FlexShardSharder("plan.json")
    assert sharder.sharding_types("cpu") == sharder.sharding_types("cuda") == ["row_wise"]
    assert sharder.compute_kernels("row_wise", "cpu") == ["fused"]
    configs = [
        EmbeddingConfig(name="item", embedding_dim=8, num_embeddings=100, feature_names=["hist", "target"]),
        EmbeddingConfig(name="tag", embedding_dim=8, num_embeddings=30, feature_names=["tags"]),
    ]
    ec = EmbeddingCollection(tables=configs, device="meta")
    assert sorted(sharder.shardable_parameters(ec)) == ["item", "tag"]
    plan = flexshard_module_plan(ec, sharder, world_size=4)
    assert {n: (p.sharding_type, p.compute_kernel, p.ranks) for n, p in plan.items()} == {
        "item": ("row_wise", "fused", [0, 1, 2, 3]),
        "tag": ("row_wise", "fused", [0, 1, 2, 3]),
    }


def test_a_variable_batch_per_feature_is_refused():
    from torchrec import KeyedJaggedTensor

    from core.errors import BatchError
    from flexshard.torchrec import FlexShardEmbeddingCollection

    vbe = KeyedJaggedTensor(
        keys=["hist", "tags"],
        values=torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 2, 1]),
        stride_per_key_per_rank=[[2], [1]],
    )
    bare = object.__new__(FlexShardEmbeddingCollection)  # the check runs before any state is read
    with pytest.raises(BatchError, match="VBE"):
        FlexShardEmbeddingCollection.input_dist(bare, None, vbe)
