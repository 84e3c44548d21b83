"""The systems a benchmark step runs: FlexShard's runtime on a plan, and TorchRec's row-wise sharding.

Each takes its input in its own form (:meth:`prepare`, done before the timed steps) and runs forward,
backward and the optimizer step in :meth:`step` (a collective: every rank calls it with its own batch).
The loss is ``0.5 sum(v^2)`` over every looked-up vector, so every looked-up row gets a gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.vocabulary import Direction, LinkClass
from flexshard.local_rates import HalfSquareSum

Batch = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (values, lengths)


def _loss(values: list[torch.Tensor]) -> torch.Tensor:
    """The benchmark's loss ``0.5 sum(v^2)`` over every looked-up vector (:class:`HalfSquareSum`)."""
    return HalfSquareSum.apply(*values)


class RuntimeSystem:
    """:class:`~flexshard.runtime.ShardedSequenceEmbedding` on the plan file at ``plan_path``, row-wise
    Adagrad, rows initialised from ``seed``."""

    def __init__(
        self,
        key: str,
        plan_path: str,
        tables: list[tuple[str, int, int]],
        orders: dict[str, np.ndarray],
        seed: int,
        lr: float,
    ) -> None:
        from flexshard.plan_file import read_plan
        from flexshard.runtime import ShardedSequenceEmbedding

        self.key = key
        self.model = ShardedSequenceEmbedding(
            read_plan(plan_path), tables, orders, init=seed, optimizer="adagrad", lr=lr
        )

    def prepare(self, batch: Batch) -> Batch:
        return batch

    def step(self, batch: Batch) -> None:
        out = self.model(batch)
        _loss(list(out.values())).backward()
        self.model.step()

    def own_bytes_sent(self) -> np.ndarray:
        """The runtime's own count of the last step's bytes sent, per link class (B): what its byte
        counts price, and what they leave out (``ids``' error codes, shared words and padding)."""
        priced = self.model.traffic.bytes[:, :, Direction.SEND].sum(axis=1)
        return priced + self.model.protocol.unpriced_bytes_sent()


class TorchRecRowWise:
    """TorchRec's ``EmbeddingCollection`` in ``DistributedModelParallel``, every table ``ROW_WISE`` with the
    FUSED kernel and the fused ``EXACT_ROWWISE_ADAGRAD`` update (inside backward), as a TorchRec user
    shards by default. ``dedup``: its ``use_index_dedup`` (no CPU kernel in fbgemm-gpu-cpu 1.8);
    ``qcomms``: bf16 on the wire both ways (its ``QCommsConfig``). Needs one dim for every table.
    ``group``: the process group it shards over (None: every rank; its ``group_size`` ranks per node)."""

    key = "torchrec_row_wise"

    def __init__(
        self,
        tables: list[tuple[str, int, int]],
        lr: float,
        group_size: int,
        dedup: bool = False,
        qcomms: bool = False,
        group: Any = None,
    ) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingCollection, EmbeddingConfig
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.types import ShardingEnv, ShardingPlan

        group = dist.group.WORLD if group is None else group
        self.dedup, self.group_size = dedup, group_size
        self.element_bytes = 2 if qcomms else 4  # embeddings and gradients on the wire
        configs = [
            EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[name])
            for name, rows, dim in tables
        ]

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ec = EmbeddingCollection(tables=configs, device=torch.device("meta"))

            def forward(self, kjt: Any) -> Any:
                return self.ec(kjt)

        codecs = None
        if qcomms:
            from torchrec.distributed.fbgemm_qcomm_codec import (
                CommType,
                QCommsConfig,
                get_qcomm_codecs_registry,
            )

            codecs = get_qcomm_codecs_registry(
                QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.BF16)
            )
        sharder = EmbeddingCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": 1e-8},
            use_index_dedup=dedup,
            qcomm_codecs_registry=codecs,
        )
        model = Model()
        module_plan = construct_module_sharding_plan(
            model.ec,
            {name: row_wise(compute_kernel=EmbeddingComputeKernel.FUSED.value) for name, _r, _d in tables},
            sharder=sharder,
            local_size=group_size,
            world_size=dist.get_world_size(group),
            device_type="cpu",
        )
        if group is not dist.group.WORLD:  # placements name global ranks of the group
            ranks = dist.get_process_group_ranks(group)
            for ps in module_plan.values():
                for sh in ps.sharding_spec.shards:
                    sh.placement = torch.distributed._remote_device(f"rank:{ranks[sh.placement.rank()]}/cpu")
                ps.ranks = [ranks[r] for r in ps.ranks] if ps.ranks else ps.ranks
        self.dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(group),
            device=torch.device("cpu"),
            plan=ShardingPlan({"ec": module_plan}),
            sharders=[sharder],
        )
        self.keys = [name for name, _r, _d in tables]
        self.dims = {name: dim for name, _r, dim in tables}
        self.blocks = {}  # table -> (row offsets, rows, owner rank, kernel) of its row blocks
        for name, ps in module_plan.items():
            shards = ps.sharding_spec.shards
            self.blocks[name] = (
                np.asarray([sh.shard_offsets[0] for sh in shards]),
                np.asarray([sh.shard_sizes[0] for sh in shards]),
                np.asarray([sh.placement.rank() for sh in shards]),
                ps.compute_kernel,
            )

    def prepare(self, batch: Batch) -> Any:
        from torchrec import KeyedJaggedTensor

        return KeyedJaggedTensor(
            keys=self.keys,
            values=torch.cat([batch[k][0] for k in self.keys]),
            lengths=torch.cat([batch[k][1] for k in self.keys]),
        )

    def step(self, kjt: Any) -> None:
        out = self.dmp(kjt)
        _loss([out[k].values() for k in self.keys]).backward()  # the fused optimizer updates in backward

    def computed_bytes_sent(self, batch: Batch) -> np.ndarray:
        """Bytes this rank sends per link class, COMPUTED from the ids and the row blocks: 8-byte ids to
        each owner plus one vector forward and one gradient back per remote lookup; ``[as run, with the
        other dedup setting]`` x link class (dedup: unique ids per table)."""
        rank, out = dist.get_rank(), np.zeros((2, len(LinkClass)))
        for name, (values, _lengths) in batch.items():
            offs, sizes, ranks, _kernel = self.blocks[name]
            for d, ids in enumerate((values.numpy(), np.unique(values.numpy()))):
                owner = ranks[np.searchsorted(offs + sizes, ids, side="right")]
                peers, n = np.unique(owner[owner != rank], return_counts=True)
                link = np.where(peers // self.group_size == rank // self.group_size, 0, 1)
                per = values.element_size() + 2 * self.dims[name] * self.element_bytes
                np.add.at(out[d], link, n * per)
        return out if not self.dedup else out[::-1]

    def local_weights(self) -> list[torch.Tensor]:
        out = []
        for key, value in self.dmp.state_dict().items():
            if key.endswith(".weight") and hasattr(value, "local_shards"):
                out += [sh.tensor.detach().clone() for sh in value.local_shards()]
        return out
