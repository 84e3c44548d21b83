""":func:`flexshard.runtime.transfer.exchange_columns_async` of several 1-D id columns (the ``ids``
stage: joined, transposed to (peer, column) order by one gather and back by another) delivers each
column's blocks from every peer in peer order, exactly: every id names its sender, column, receiver and
place, so the receiver checks each one against what every sender sent it. On 3 real gloo ranks, with
empty blocks, an empty column and a column only one rank sends; and the transposition on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import run_function

from flexshard.runtime.transfer import exchange_columns_async, transposed_blocks

COLUMNS = 4
CPU = torch.device("cpu")


def _counts(world: int, seed: int) -> np.ndarray:
    """int64[from, to, column]: ids each rank sends each rank in each column (the same on every rank)."""
    counts = np.random.default_rng(seed).integers(0, 4, size=(world, world, COLUMNS))
    counts[:, :, 1] = 0  # a column nobody sends
    counts[1:, :, 3] = 0  # a column only rank 0 sends
    return counts


def _sent(sender: int, counts: np.ndarray) -> list[torch.Tensor]:
    """Sender's columns, sorted by receiver: id = sender * 10^6 + column * 10^4 + receiver * 100 + i."""
    world = counts.shape[0]
    return [
        torch.as_tensor(
            [
                sender * 10**6 + c * 10**4 + to * 100 + i
                for to in range(world)
                for i in range(counts[sender, to, c])
            ],
            dtype=torch.int64,
        )
        for c in range(COLUMNS)
    ]


def _exchange(rank: int, world: int) -> list:
    out = []
    for seed in range(3):
        counts = _counts(world, seed)
        got = exchange_columns_async(
            "ids", _sent(rank, counts), counts[rank], counts[:, rank], np.ones(COLUMNS)
        )
        out.append(got.wait()[0])
    return out


@pytest.mark.slow
def test_three_ranks_receive_every_column_in_peer_order():
    world = 3
    for rank, results in enumerate(run_function(_exchange, world)):
        for seed, got in enumerate(results):
            counts = _counts(world, seed)
            for c in range(COLUMNS):
                want = [_sent(p, counts)[c] for p in range(world)]
                want = torch.cat([w[(w // 100) % 100 == rank] for w in want])
                assert torch.equal(got[c], want), (rank, seed, c)


def test_transposed_blocks_reorders_blocks_by_hand():
    # the blocks of each layout in (a, b) order, then in (b, a) order: a0b0, a1b0, a0b1, a1b1
    # first: a0b0=[0], a0b1=[1, 2], a1b0 empty, a1b1=[3, 4, 5] (already in order)
    # second: a0b0=[0, 1], a0b1=[2], a1b0=[3], a1b1=[4, 5]
    # (two layouts in one call: each index is into its own buffer)
    first, second = transposed_blocks([np.array([[1, 2], [0, 3]]), np.array([[2, 1], [1, 2]])], CPU)
    assert first.tolist() == [0, 1, 2, 3, 4, 5]
    assert second.tolist() == [0, 1, 3, 2, 4, 5]
    (alone,) = transposed_blocks([np.array([[2, 1], [1, 2]])], CPU)
    assert alone.tolist() == [0, 1, 3, 2, 4, 5]
