"""The ``ids`` stage with headers (:mod:`flexshard.runtime.headed_ids`): on 4 real gloo ranks in 2 groups,
batch after batch, every rank receives exactly the columns every sender sent it (each id names its
sender, column, receiver and place), the split sizes and every sender's error code; the capacities grow
the same on every rank; the overflow all-to-all is issued exactly when some block is past its capacity
(the first batch, and a batch larger than any before), never when a batch failed; and the padding is
never read. The index arithmetic by hand on one rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import run_function

from flexshard.runtime.collective_count import count_collectives
from flexshard.runtime.features import ERROR_WORDS
from flexshard.runtime.headed_ids import QUANTUM_IDS, IdCapacity, IdStage, _split_blocks

COLUMNS = 3
GROUPS = np.array([0, 0, 1, 1])  # 4 ranks in 2 groups
CPU = torch.device("cpu")
# ids per block a batch draws from (batch 3 is far larger: it overflows the capacity batch 1 left)
BATCH_HIGH = [30, 30, 30, 400, 30]
FAILED_BATCH, FAILED_RANK = 4, 2


def _mask(world: int) -> np.ndarray:
    """bool[from, to, column]: column 2 only within a group (like the group fetch's ids)."""
    same = GROUPS[:, None] == GROUPS[None, :]
    mask = np.ones((world, world, COLUMNS), dtype=bool)
    mask[:, :, 2] = same
    return mask


def _counts(world: int, batch: int) -> np.ndarray:
    """int64[from, to, column]: ids each rank sends each rank in each column (the same on every rank)."""
    counts = np.random.default_rng(batch).integers(0, BATCH_HIGH[batch], size=(world, world, COLUMNS))
    counts[:, :, 1] = 0 if batch == 2 else counts[:, :, 1]  # a batch with an empty column
    return np.where(_mask(world), counts, 0)


def _sent(sender: int, counts: np.ndarray) -> list[torch.Tensor]:
    """Sender's columns, sorted by receiver: id = sender * 10^6 + column * 10^5 + receiver * 10^4 + i."""
    world = counts.shape[0]
    return [
        torch.as_tensor(
            [
                sender * 10**6 + c * 10**5 + to * 10**4 + i
                for to in range(world)
                for i in range(counts[sender, to, c])
            ],
            dtype=torch.int64,
        )
        for c in range(COLUMNS)
    ]


def _run(rank: int, world: int) -> list:
    mask = _mask(world)[rank]  # what this rank sends each peer: error code + the columns that reach it
    header_mask = np.concatenate([np.ones((world, ERROR_WORDS), bool), mask], axis=1)
    stage = IdStage(header_mask, GROUPS[rank] == GROUPS, CPU)
    out = []
    for batch in range(len(BATCH_HIGH)):
        counts = _counts(world, batch)
        err = torch.zeros(ERROR_WORDS, dtype=torch.int64)
        columns = _sent(rank, counts)
        sent = counts[rank]
        if batch == FAILED_BATCH and rank == FAILED_RANK:
            err[:] = torch.tensor([3, 1, 7, 0])
            sent, columns = np.zeros_like(sent), None
        before = (stage.capacity.same, stage.capacity.other)
        with count_collectives() as counted:
            got = stage.issue(err, sent, columns, None).wait()
        out.append((before, counted.names, got.recv_counts, [c.tolist() for c in got.codes], got.columns))
    # two batches in flight (a pipeline's order): issuing the second reads the first's headers first, so
    # its capacity is the same on every rank; then both are waited for, the later one first
    err = torch.zeros(ERROR_WORDS, dtype=torch.int64)
    first = stage.issue(err, _counts(world, 3)[rank], _sent(rank, _counts(world, 3)), None)
    second = stage.issue(err, _counts(world, 0)[rank], _sent(rank, _counts(world, 0)), None)
    out.append((second.wait().columns, first.wait().columns))
    return out


@pytest.mark.slow
def test_four_ranks_receive_every_column_its_codes_and_agree_on_capacity():
    world = 4
    results = run_function(_run, world)
    for batch in range(len(BATCH_HIGH)):
        counts = _counts(world, batch)
        capacities = {r[batch][0] for r in results}
        assert len(capacities) == 1, (batch, capacities)  # every rank the same, before each batch
        same, other = capacities.pop()
        if batch == 0:
            assert (same, other) == (0, 0)
        for rank, per_batch in enumerate(results):
            _before, names, recv_counts, codes, columns = per_batch[batch]
            failed = batch == FAILED_BATCH
            sent = counts.copy()
            if failed:
                sent[FAILED_RANK] = 0
            assert np.array_equal(recv_counts, sent[:, rank]), (batch, rank)
            want_codes = [[0] * ERROR_WORDS for _ in range(world)]
            if failed:
                want_codes[FAILED_RANK] = [3, 1, 7, 0]
            assert codes == want_codes
            # some sender past its capacity for some peer (every rank sees the same: its header)
            cap_of = np.where(GROUPS[:, None] == GROUPS[None, :], same, other)
            overflow = bool((sent.sum(axis=2) > cap_of).any())
            assert names == (["ids", "ids_overflow"] if overflow and not failed else ["ids"]), (batch, rank)
            if failed:
                assert columns is None
                continue
            assert (batch in (0, 3)) == overflow, batch  # the first batch and the large one
            for c in range(COLUMNS):
                want = torch.cat([_sent(p, counts)[c] for p in range(world)])
                want = want[(want // 10**4) % 10 == rank]
                assert torch.equal(columns[c], want), (batch, rank, c)
    for rank, per_batch in enumerate(results):  # two in flight: each batch's own columns
        for got, batch in zip(per_batch[-1], (0, 3), strict=True):
            counts = _counts(world, batch)
            for c in range(COLUMNS):
                want = torch.cat([_sent(p, counts)[c] for p in range(world)])
                assert torch.equal(got[c], want[(want // 10**4) % 10 == rank]), (rank, batch, c)
    # after batch 0 (ids < 30 a block) and 3 (< 400): HEADROOM x the largest, in quanta
    after_first = results[0][1][0]
    largest = _counts(world, 0).sum(axis=2)
    same_group = GROUPS[:, None] == GROUPS[None, :]
    want = tuple(
        int(np.ceil(1.25 * largest[m].max() / QUANTUM_IDS)) * QUANTUM_IDS for m in (same_group, ~same_group)
    )
    assert after_first == want


def test_capacity_grows_by_headroom_in_quanta_and_never_shrinks():
    cap = IdCapacity()
    cap.grow(0, 0)
    assert (cap.same, cap.other) == (0, 0)
    cap.grow(1, 52)  # 1.25 -> 64; 65 -> 128
    assert (cap.same, cap.other) == (64, 128)
    cap.grow(200, 10)  # 250 -> 256; other stays
    assert (cap.same, cap.other) == (256, 128)
    assert cap.per_peer(np.array([True, False, True])).tolist() == [256, 128, 256]


def test_split_blocks_by_hand():
    # peer 0: blocks 3, 4, 2 with capacity 5 -> 3, 2, 0 within, 0, 2, 2 past; peer 1: capacity 10, all in
    counts = np.array([[3, 4, 2], [1, 0, 6]])
    main, past = _split_blocks(counts, np.array([5, 10]))
    assert main.tolist() == [[3, 2, 0], [1, 0, 6]]
    assert past.tolist() == [[0, 2, 2], [0, 0, 0]]
