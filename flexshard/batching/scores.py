"""What a sample's lookups cost across groups, per group it could be processed in.

A sample's lookups are its history ids, its candidates (sequence tables) and its user id (the user
table), as :func:`flexshard.model.lookup_features` sends them. Only cold lookups can cross groups (hot rows
are on every GPU, warm rows in every group). A cold lookup of a row owned in group ``k`` stays inside the
group when the sample is processed in ``k``, and crosses the fabric otherwise: one id out and one
embedding and one gradient back, ``INDEX_BYTES + 2 * vector bytes`` (:func:`lookup_bytes`).
:func:`group_scores` sums those bytes per (sample, group): the inter-group bytes saved by processing the
sample there. Moving a sample to another group costs its ids once across the fabric
(:func:`sample_bytes`), which the scores subtract for every group but the sample's own.
"""

from __future__ import annotations

import numpy as np

from core.vocabulary import FLOAT32_BYTES, INDEX_BYTES, WireDtype
from flexshard.model import Batch
from solvers import wire

HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads consecutive ids over groups


def lookup_bytes(dim: int, wire_dtype: WireDtype) -> int:
    """Bytes one remote lookup moves (:func:`solvers.wire.lookup_messages` of one lookup asked): its id,
    then its embedding forward and its gradient backward."""
    vector = wire.vector_bytes(dim, FLOAT32_BYTES, wire_dtype)
    return int(sum(wire.lookup_messages(1, 0, vector).values()))


def sample_lookups(batch: Batch, user_table: str | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per table ``(ids, sample)``: every lookup of the batch and the index of the sample it belongs to."""
    b = batch.size
    out = {}
    for name, hist in batch.history.items():
        cand = batch.candidates[name]
        ids = np.concatenate([hist, cand.reshape(-1)])
        owner = np.concatenate(
            [np.repeat(np.arange(b), batch.lengths), np.repeat(np.arange(b), cand.shape[1])]
        )
        out[name] = (ids.astype(np.int64, copy=False), owner)
    if user_table is not None and batch.users is not None:
        out[user_table] = (np.asarray(batch.users, dtype=np.int64), np.arange(b))
    return out


def sample_bytes(batch: Batch) -> np.ndarray:
    """int64[B]: bytes of each sample's record when it moves: its length, history ids, candidates and user,
    int64 each (:func:`flexshard.batching.exchange.exchange_samples`)."""
    per = 1 + batch.lengths * len(batch.history)
    per = per + sum(c.shape[1] for c in batch.candidates.values()) + (0 if batch.users is None else 1)
    return per.astype(np.int64) * INDEX_BYTES


def hashed_group(name: str, ids: np.ndarray, num_groups: int) -> np.ndarray:
    """A group for every id of table ``name``, the same on every rank and unrelated to the plan."""
    salt = np.uint64(sum(name.encode()) * 0x100000001B3 % (1 << 63))
    with np.errstate(over="ignore"):
        h = (ids.astype(np.uint64) ^ salt) * HASH_MULTIPLIER
    return ((h >> np.uint64(32)) % np.uint64(num_groups)).astype(np.int64)


def group_scores(
    batch_size: int,
    cold: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    weights: dict[str, int],
    num_groups: int,
) -> np.ndarray:
    """float64[B, G]: per sample and group, the bytes of the sample's cold rows that sit in that group.
    ``cold[table] = (ids, sample, group)`` of each cold lookup; ``weights[table]``: its
    :func:`lookup_bytes`. A row looked up ``n`` times in the batch counts ``1 / n`` per lookup: with dedup
    it is fetched once, so its bytes are shared by the samples that use it."""
    score = np.zeros(batch_size * num_groups)
    for name, (ids, sample, group) in cold.items():
        _distinct, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        share = float(weights[name]) / counts[inverse]
        score += np.bincount(sample * num_groups + group, weights=share, minlength=score.size)
    return score.reshape(batch_size, num_groups)
