"""Moving samples between ranks: two all-to-alls on the global group, their bytes counted.

A sample travels as one fixed-width int64 record (its history length, every sequence table's candidates,
its user id) and its history ids (one int64 per position and sequence table). The record counts are the
swap counts every rank knows (:class:`~flexshard.batching.assign.SwapPlan`), and the history sizes
follow from the lengths in the records, so no split sizes are exchanged. The received batch holds the
samples by source rank, each source's in the order it sent them.
"""

from __future__ import annotations

import numpy as np
import torch

from core.ranks import RankLayout
from core.traffic import Traffic
from core.vocabulary import INDEX_BYTES, Component, LinkClass
from flexshard.model import Batch
from flexshard.runtime.transfer import exchange_columns


def exchange_samples(
    batch: Batch,
    dest: np.ndarray,
    counts: np.ndarray,
    layout: RankLayout,
    rank: int,
    device: torch.device,
) -> tuple[Batch, Traffic]:
    """Send each sample of ``batch`` to rank ``dest[s]`` (``counts[r, d]``: samples rank ``r`` sends rank
    ``d``, for every pair); return the samples this rank receives and the bytes it sent and received per
    link class (component ``ids``; its own samples are not counted). Collective."""
    names = list(batch.history)
    world = layout.num_ranks
    order = np.argsort(dest, kind="stable")
    lengths = batch.lengths[order]
    parts = [lengths[:, None], *(batch.candidates[n][order] for n in names)]
    if batch.users is not None:
        parts.append(np.asarray(batch.users)[order][:, None])
    record = np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.int64)
    width = record.shape[1]
    sent, got = counts[rank], counts[:, rank]
    (records,) = exchange_columns(
        [torch.from_numpy(record).to(device)], sent[:, None], got[:, None], np.array([width])
    )
    records = records.cpu().numpy()
    positions = _history_positions(batch.lengths, order)
    got_lengths = records[:, 0]
    hist_sent = np.bincount(np.repeat(np.arange(world), sent), weights=lengths, minlength=world)
    hist_got = np.bincount(np.repeat(np.arange(world), got), weights=got_lengths, minlength=world)
    hist_sent, hist_got = hist_sent.astype(np.int64), hist_got.astype(np.int64)
    columns = [torch.from_numpy(np.ascontiguousarray(batch.history[n][positions])).to(device) for n in names]
    k = len(names)
    histories = exchange_columns(
        columns, np.repeat(hist_sent[:, None], k, 1), np.repeat(hist_got[:, None], k, 1), np.ones(k, np.int64)
    )
    col = 1
    candidates = {}
    for n in names:
        w = batch.candidates[n].shape[1]
        candidates[n] = np.ascontiguousarray(records[:, col : col + w])
        col += w
    users = np.ascontiguousarray(records[:, col]) if batch.users is not None else None
    history = {n: h.cpu().numpy() for n, h in zip(names, histories, strict=True)}
    placed = Batch(np.ascontiguousarray(got_lengths), history, candidates, users)
    return placed, peer_traffic(layout, rank, sent * width + hist_sent * k, got * width + hist_got * k)


def _history_positions(lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """int64[sum(lengths)]: the history positions of the samples ``order``, sample after sample."""
    starts = np.cumsum(lengths) - lengths
    n = lengths[order]
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(starts[order], n) + within


def peer_traffic(layout: RankLayout, rank: int, words_sent: np.ndarray, words_got: np.ndarray) -> Traffic:
    """The int64 words sent to and received from each peer, as ``ids`` bytes per link class (this rank
    excluded)."""
    out = Traffic.zeros()
    others = np.arange(layout.num_ranks) != rank
    link = layout.link_class(rank, np.arange(layout.num_ranks))
    for lc in LinkClass:
        peers = others & (link == lc)
        out.add(lc, Component.IDS, float(words_sent[peers].sum()) * INDEX_BYTES,
                float(words_got[peers].sum()) * INDEX_BYTES)  # fmt: skip
    return out
