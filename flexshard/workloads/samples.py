"""Batch formation from real histories: the one sampler training, the byte studies and ``flexshard stats``
agree on.

Every sample is drawn independently (a user uniformly, with replacement, among the users that can be
sampled; then the sampler's own random choices), so a batch of ``b`` samples per GPU on ``N`` GPUs is
``N b`` independent samples. :mod:`flexshard.workloads.touch` computes the exact per-row rates of this
sampler; its tests replay this module to check them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.arrays import block_positions
from core.errors import DataError

from .sequences import Sequences
from .touch import Sampling, eligible


@dataclass(frozen=True)
class SampleBatch:
    """One GPU's samples: ``history`` int64[sum(lengths)] item ids (oldest first per sample),
    ``candidates`` int64[B, 1 + negatives] (target first; ``[B, 0]`` for history samples) and
    ``users`` int64[B] raw user ids."""

    lengths: np.ndarray
    history: np.ndarray
    candidates: np.ndarray
    users: np.ndarray

    def item_ids(self) -> np.ndarray:
        """Every item id the batch looks up: the histories, then the candidates."""
        return np.concatenate([self.history, self.candidates.reshape(-1)])


class HistorySampler:
    """Draws :class:`SampleBatch` es of ``batch_size`` samples, a deterministic function of
    ``(seed, step, rank)``.

    ``next-item``: a cut ``c`` uniform in ``1..n-1``, the history window ``[c - window, c)``, the target
    ``c`` and ``negatives`` ids drawn uniformly from ``pool`` (default: every item of the histories).
    ``history``: the user's last ``window`` items (all of them without a window).
    """

    def __init__(
        self,
        histories: Sequences,
        sampling: Sampling,
        batch_size: int,
        seed: int,
        pool: np.ndarray | None = None,
    ) -> None:
        usable = histories.subset(eligible(histories.lengths, sampling))
        if not len(usable):
            raise DataError(f"histories: no user can be sampled ({sampling.describe()})")
        self.sampling, self.batch_size, self.seed = sampling, int(batch_size), seed
        self.users, self.items = usable.users, usable.items
        self.seq_len, self.offsets = usable.lengths, usable.offsets[:-1]
        self.pool = np.sort(np.asarray(pool, dtype=np.int64)) if pool is not None else np.unique(self.items)

    def batch(self, step: int, rank: int) -> SampleBatch:
        """The samples of ``rank`` at ``step``."""
        rng = np.random.default_rng([self.seed, step, rank, 2])
        b = self.batch_size
        s = rng.integers(0, self.users.size, b)
        n = self.seq_len[s]
        window = self.sampling.window
        if self.sampling.mode == "next-item":
            cut = 1 + np.floor(rng.random(b) * (n - 1)).astype(np.int64)  # target position, 1..n-1
            start = np.maximum(cut - window, 0)
        else:
            cut = n
            start = np.zeros(b, dtype=np.int64) if window is None else np.maximum(n - window, 0)
        lengths = cut - start
        begin = self.offsets[s] + start
        hist = self.items[block_positions(lengths, begin)]
        if self.sampling.mode == "next-item":
            target = self.items[self.offsets[s] + cut]
            neg = self.pool[rng.integers(0, self.pool.size, (b, self.sampling.negatives))]
            cand = np.concatenate([target[:, None], neg], axis=1).astype(np.int64)
        else:
            cand = np.zeros((b, 0), dtype=np.int64)
        return SampleBatch(lengths.astype(np.int64), hist, cand, self.users[s])
