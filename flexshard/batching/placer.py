"""The sample-placement step of the input pipeline: per global batch, which rank trains on which sample.

:class:`SamplePlacer` scores each of this rank's samples per group (:mod:`~flexshard.batching.scores`:
the inter-group bytes its cold rows would save there, minus the cost of moving it), finds the samples
that gain by moving, agrees symmetric swaps with the rail peers (:mod:`~flexshard.batching.assign`: one
all-gather of ``G`` counts per rank) and moves the samples (:mod:`~flexshard.batching.exchange`). The
all-gather and the move are counted in the step's ``ids`` bytes. The global batch is the same set of
samples and every rank still trains on ``B``: the loss (the mean over the global batch) and the
gradients are the same up to float summation order.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from core.traffic import Traffic
from core.vocabulary import SamplePlacement, Tier
from flexshard.batching.assign import SwapPlan, destinations, want_counts, wanted_moves
from flexshard.batching.exchange import exchange_samples, peer_traffic
from flexshard.batching.scores import group_scores, hashed_group, lookup_bytes, sample_bytes, sample_lookups
from flexshard.model import Batch
from flexshard.runtime import ShardedSequenceEmbedding


class SamplePlacer:
    """Places each global batch's samples on ranks for ``module``'s plan (``mode``: see
    :class:`~core.vocabulary.SamplePlacement`). ``traffic``: the last move's bytes; ``seconds``: the last
    decision's wall time (scores and assignment, without the move)."""

    def __init__(
        self, mode: SamplePlacement | str, module: ShardedSequenceEmbedding, user_table: str | None
    ) -> None:
        self.mode = SamplePlacement.parse(mode)
        self.module, self.user_table = module, user_table
        self.layout = module.plan_file.layout
        self.traffic = Traffic.zeros()
        self.seconds = 0.0

    def scores(self, batch: Batch) -> np.ndarray:
        """float64[B, G]: the inter-group bytes each sample's cold lookups would save in each group, less
        the bytes of moving it there (none for its own group)."""
        m, groups = self.module, self.layout.num_groups
        cold, weights = {}, {}
        for name, (ids, sample) in sample_lookups(batch, self.user_table).items():
            t = m.table_names.index(name)
            tier, owner, _slot = (x.numpy() for x in m.routing[t].lookup(torch.from_numpy(ids)))
            is_cold = tier == int(Tier.COLD)
            if self.mode is SamplePlacement.OWNER:
                group = self.layout.group_of_rank[owner[is_cold]]
            else:
                group = hashed_group(name, ids[is_cold], groups)
            cold[name] = (ids[is_cold], sample[is_cold], group)
            weights[name] = lookup_bytes(m.dims[t], m.wire_dtype)
        score = group_scores(batch.size, cold, weights, groups)
        move = sample_bytes(batch).astype(np.float64)
        home = int(self.layout.group_of_rank[m.rank])
        score -= move[:, None]
        score[:, home] += move
        return score

    def place(self, batch: Batch) -> Batch:
        """This rank's samples after placement (collective: every rank calls it once per step)."""
        if self.mode is SamplePlacement.OFF:
            self.traffic, self.seconds = Traffic.zeros(), 0.0
            return batch
        start = time.perf_counter()
        rank, groups = self.module.rank, self.layout.num_groups
        best, gain = wanted_moves(self.scores(batch), int(self.layout.group_of_rank[rank]))
        wants = self._all_wants(want_counts(best, gain, groups))
        plan = SwapPlan.between_rail_peers(wants, self.layout, batch.size)
        dest = destinations(best, gain, plan.counts[rank], self.layout, rank)
        self.seconds = time.perf_counter() - start
        placed, self.traffic = exchange_samples(
            batch, dest, plan.counts, self.layout, rank, self.module.device
        )
        self._count_wants()
        return placed

    def _all_wants(self, mine: np.ndarray) -> np.ndarray:
        """int64[N, G]: every rank's want counts (one all-gather)."""
        send = torch.from_numpy(mine).to(self.module.device)
        out = [torch.empty_like(send) for _ in range(self.layout.num_ranks)]
        dist.all_gather(out, send)
        return torch.stack(out).cpu().numpy()

    def _count_wants(self) -> None:
        """Add the all-gather of want counts to :attr:`traffic`: ``G`` int64 to and from every other rank."""
        words = np.full(self.layout.num_ranks, self.layout.num_groups)
        self.traffic += peer_traffic(self.layout, self.module.rank, words, words)
