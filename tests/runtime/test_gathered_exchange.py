""":func:`flexshard.runtime.transfer.exchange_gathered_async` (rows gathered straight into the send
buffer, received as per-peer views) delivers exactly what :func:`exchange_columns_async` of the gathered
columns delivers: on 3 real gloo ranks, on one rank (a local copy), with empty blocks and empty columns,
and for a column sent as it is (no index)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import run_function

from flexshard.runtime.transfer import exchange_columns_async, exchange_gathered_async

DIMS = (4, 1, 7)


def _case(rank: int, world: int, seed: int) -> tuple[list, list, np.ndarray, np.ndarray]:
    """Sources, indices (sorted by peer) and the split sizes every rank sends and receives; the counts
    of every rank come from one generator, so each rank knows what it receives."""
    counts = np.random.default_rng(seed).integers(0, 5, size=(world, world, len(DIMS)))  # [from, to, col]
    counts[:, :, 1] = 0 if seed % 2 else counts[:, :, 1]  # an empty column on odd seeds
    counts[0, :, 2] = 0  # rank 0 sends nothing of column 2
    gen = torch.Generator().manual_seed(100 * seed + rank)
    sources = [torch.randn(9, d, generator=gen) for d in DIMS]
    indices = [torch.randint(0, 9, (int(counts[rank, :, c].sum()),), generator=gen) for c in range(len(DIMS))]
    return sources, indices, counts[rank], counts[:, rank]


def _exchange_both(rank: int, world: int) -> list:
    out = []
    for seed in range(4):
        sources, indices, sent, received = _case(rank, world, seed)
        columns = [s.index_select(0, i) for s, i in zip(sources, indices, strict=True)]
        if seed >= 2:  # column 0 sent as it is (no index): its rows in order
            sources[0], indices[0] = columns[0], None
        want = exchange_columns_async("", columns, sent, received, np.array(DIMS)).wait()[0]
        got = exchange_gathered_async("", sources, indices, sent, received).wait()
        buffered = exchange_gathered_async("", sources, indices, sent, received, with_buffer=True).wait()
        out.append((want, got, received, buffered))
    return out


def _check(results: list) -> None:
    for want, got, received, (views_b, buffer, first) in results:
        assert len(got) == len(DIMS)
        for c, (w, views) in enumerate(zip(want, got, strict=True)):
            assert [v.shape for v in views] == [(int(n), DIMS[c]) for n in received[:, c]]
            assert torch.equal(torch.cat(views), w), c
            assert torch.equal(torch.cat(views_b[c]), w), c
            for p, v in enumerate(views_b[c]):
                lo = int(first[p, c])
                assert torch.equal(buffer[lo : lo + v.numel()].view(-1, DIMS[c]), v), (p, c)
        assert buffer.numel() == sum(int(n) * d for n, d in zip(received.sum(axis=0), DIMS, strict=True))


def test_one_rank_is_a_local_copy():
    _check(_exchange_both(0, 1))


def test_no_columns():
    empty = np.zeros((2, 0), dtype=np.int64)
    assert exchange_gathered_async("", [], [], empty, empty).wait() == []


@pytest.mark.slow
def test_three_ranks_deliver_the_gathered_columns_exactly():
    for results in run_function(_exchange_both, 3):
        _check(results)
