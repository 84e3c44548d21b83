"""The fused optimizer of a FlexShard-sharded ``EmbeddingCollection``, as TorchRec's ``CombinedOptimizer``
takes it.

TorchRec's own fused optimizers update rows inside backward and their ``step()`` does nothing. FlexShard
updates in ``step()``: the replica sync (hot and warm gradients summed over their copies) and then the
update of every row that received gradient, so that every copy of a row gets the same update
(:meth:`flexshard.runtime.ShardedSequenceEmbedding.step`). ``step()`` is therefore collective: every rank
calls it once per training step (``CombinedOptimizer.step`` and TorchRec's train pipelines do).
"""

from __future__ import annotations

from typing import Any

from torchrec.optim.fused import FusedOptimizer

from flexshard.runtime import ShardedSequenceEmbedding


class FlexShardFusedOptimizer(FusedOptimizer):
    """``step()`` runs the module's replica sync and update with the learning rate of
    ``param_groups[0]["lr"]`` (so TorchRec's and torch's schedulers can change it); ``zero_grad`` clears
    the rows' accumulated gradients. Parameters: each (table, tier) shard's rows this rank holds, keyed
    ``"{table}.{tier}"``; state: their row-wise Adagrad accumulators (``"momentum1"``, as fbgemm names
    it) when the optimizer is ``"adagrad"``."""

    def __init__(self, embedding: ShardedSequenceEmbedding) -> None:
        self._embedding = embedding
        params, state = {}, {}
        for (t, tier), shard in embedding.shards.items():
            params[f"{embedding.table_names[t]}.{tier.label}"] = shard.weights
            if shard.states:  # fbgemm's names: momentum1 (and Adam's momentum2)
                state[shard.weights] = dict(shard.states)
        group = {
            "params": list(params.values()),
            "lr": embedding.lr,
            "eps": embedding.eps,
            "beta1": embedding.betas[0],
            "beta2": embedding.betas[1],
        }
        super().__init__(params, state, [group])

    def step(self, closure: Any = None) -> None:
        """Replica sync and row update on every rank (collective); ``closure`` is not supported."""
        if closure is not None:
            raise ValueError("closure: FlexShardFusedOptimizer.step takes no closure")
        group = next(iter(self.param_groups))
        self._embedding.lr, self._embedding.eps = float(group["lr"]), float(group["eps"])
        self._embedding.betas = (float(group["beta1"]), float(group["beta2"]))
        self._embedding.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._embedding.zero_grad(set_to_none)
