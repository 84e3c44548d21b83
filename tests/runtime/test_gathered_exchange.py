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


ONE_DIM = (5, 5, 5)  # every column one dim: the path a GPU gathers in two passes


def _one_dim_case(rank: int, world: int, seed: int) -> tuple[list, list, np.ndarray, np.ndarray]:
    """As :func:`_case`, every column of ``ONE_DIM``'s width."""
    counts = np.random.default_rng(seed).integers(0, 5, size=(world, world, len(ONE_DIM)))
    counts[:, :, 1] = 0 if seed % 2 else counts[:, :, 1]
    counts[:, 0, 2] = 0  # nobody sends rank 0 anything of column 2 (rank 0 keeps none of its own)
    gen = torch.Generator().manual_seed(100 * seed + rank)
    sources = [torch.randn(9, d, generator=gen) for d in ONE_DIM]
    indices = [
        torch.randint(0, 9, (int(counts[rank, :, c].sum()),), generator=gen) for c in range(len(ONE_DIM))
    ]
    return sources, indices, counts[rank], counts[:, rank]


def _staged_and_per_block(rank: int, world: int) -> list:
    """Both gathers of the same one-dim exchanges (``staged_gathers`` forced either way), with and
    without the buffer, and what exchange_columns_async delivers."""
    from flexshard.runtime import transfer

    out = []
    policy = transfer.staged_gathers
    try:
        for seed in range(4):
            sources, indices, sent, received = _one_dim_case(rank, world, seed)
            columns = [s.index_select(0, i) for s, i in zip(sources, indices, strict=True)]
            if seed >= 2:
                sources[0], indices[0] = columns[0], None
            want = exchange_columns_async("", columns, sent, received, np.array(ONE_DIM)).wait()[0]
            got = {}
            for staged in (True, False):
                transfer.staged_gathers = lambda *args, staged=staged: staged
                views = exchange_gathered_async("", sources, indices, sent, received).wait()
                buffered = exchange_gathered_async(
                    "", sources, indices, sent, received, with_buffer=True
                ).wait()
                got[staged] = (views, buffered)
            out.append((want, received, got))
    finally:
        transfer.staged_gathers = policy
    return out


def _check_staged(results: list) -> None:
    for want, received, got in results:
        (views_s, (bviews_s, buffer_s, first_s)), (views_p, (bviews_p, buffer_p, first_p)) = (
            got[True],
            got[False],
        )
        for c, w in enumerate(want):
            assert [v.shape for v in views_s[c]] == [(int(n), ONE_DIM[c]) for n in received[:, c]]
            assert torch.equal(torch.cat(views_s[c]), w), c
            assert torch.equal(torch.cat(bviews_s[c]), w), c
            for p, v in enumerate(bviews_s[c]):
                assert torch.equal(v, views_s[c][p]) and torch.equal(v, views_p[c][p]), (p, c)
                assert torch.equal(v, bviews_p[c][p]), (p, c)
                lo = int(first_s[p, c])
                assert torch.equal(buffer_s[lo : lo + v.numel()].view(-1, ONE_DIM[c]), v), (p, c)
        # the same buffer, block for block where it has rows, as the per-block gather lays it out
        assert torch.equal(buffer_s, buffer_p)
        has_rows = received > 0
        assert np.array_equal(first_s[has_rows], first_p[has_rows])


def test_the_staged_gather_lays_out_what_the_per_block_gather_does_on_one_rank():
    _check_staged(_staged_and_per_block(0, 1))


def test_staged_gathers_only_on_a_gpu_and_where_they_issue_fewer_ops():
    from flexshard.runtime.transfer import STAGED_INDEX_OPS, staged_gathers

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    many = np.ones((8, 3), dtype=np.int64)  # 24 blocks: 3 gathers + 5 (+ 5 with the buffer) fewer
    assert STAGED_INDEX_OPS == 5
    assert staged_gathers(gpu, many, 0, False) and staged_gathers(gpu, many, 0, True)
    assert not staged_gathers(cpu, many, 0, False)
    few = np.ones((2, 3), dtype=np.int64)  # 6 blocks: 3 + 5 = 8 ops staged
    assert not staged_gathers(gpu, few, 0, False)
    nine = np.ones((3, 3), dtype=np.int64)  # 9 blocks: 8 staged, 13 with the own block into the buffer
    assert staged_gathers(gpu, nine, 1, False) and not staged_gathers(gpu, nine, 1, True)
    nine[1] = 0  # 6 blocks, none its own
    assert not staged_gathers(gpu, nine, 1, False)
    wide = np.zeros((12, 3), dtype=np.int64)
    wide[:, 0] = 1  # 12 blocks of one column: 1 + 5 + 5 = 11 ops staged with the buffer
    assert staged_gathers(gpu, wide, 0, True)


@pytest.mark.slow
def test_three_ranks_staged_gather_delivers_the_gathered_columns_exactly():
    for results in run_function(_staged_and_per_block, 3):
        _check_staged(results)
