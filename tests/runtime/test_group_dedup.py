"""The group fetch's ``compute`` (one process, no collective): :func:`distinct_keys` equals
``torch.unique`` by the mark and by the sort, and :class:`GroupDedup` equals a per-table
``torch.unique`` of ``owner * rows + slot`` and of ``(rail peer, slot)`` on random small cases."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from flexshard.runtime import group_dedup
from flexshard.runtime.group_dedup import FLAT, GIDS, GSLOTS, WARM, GroupDedup, distinct_keys


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_distinct_keys_equals_torch_unique(monkeypatch, dense, n):
    monkeypatch.setattr(group_dedup, "DENSE_PER_KEY", 10**9 if dense else 0)
    rng = np.random.default_rng(n)
    key_range = 50
    keys = torch.as_tensor(rng.integers(0, key_range, n), dtype=torch.int64)
    assert torch.equal(distinct_keys(keys, key_range), torch.unique(keys, sorted=True))


def _case(seed: int, groups: int, size: int, me: int):
    """A random ``compute`` input for rank ``me`` of ``groups`` groups of ``size`` ranks (rank
    ``k * size + j`` at position j of group k): three tables, the second flat (no group fetch)."""
    rng = np.random.default_rng(seed)
    world = groups * size
    pos, grp = np.arange(world) % size, np.arange(world) // size
    rows = [40, 30, 25]
    fetch = np.array([True, False, True])
    shards = [rng.integers(1, r // world + 3, world) for r in rows]  # cold rows per rank (uneven)
    routing = [
        types.SimpleNamespace(num_rows=r, cold_rows_per_rank=s) for r, s in zip(rows, shards, strict=True)
    ]
    peer_of = grp * size + pos[me]  # requester p's rail peer at my position
    rail = np.flatnonzero(pos == pos[me])
    dedup = GroupDedup(me, pos, peer_of, routing, fetch, torch.device("cpu"))
    recv = np.zeros((world, 3, 4), np.int64)
    received, pairs = [], []
    for t in range(3):
        gids, gslots = [], []
        for p in range(world):
            if fetch[t] and grp[p] == grp[me]:
                n = int(rng.integers(0, 12))
                owner = rng.choice(rail, n)
                slot = rng.integers(0, shards[t][owner])
                gids.append(owner * rows[t] + slot)  # the reference's key
                recv[p, t, GIDS] = n
            if fetch[t] and grp[p] != grp[me]:
                n = int(rng.integers(0, 9))
                gslots.append(rng.integers(0, shards[t][me], n))
                recv[p, t, GSLOTS] = n
        recv[:, t, FLAT] = 0 if fetch[t] else rng.integers(0, 3, world)
        flat = torch.as_tensor(rng.integers(0, shards[t][me], int(recv[:, t, FLAT].sum())), dtype=torch.int64)
        pairs.append(torch.as_tensor(np.concatenate([np.zeros(0, np.int64), *gids]), dtype=torch.int64))
        owner, slot = pairs[-1] // rows[t], pairs[-1] % rows[t]
        keys = dedup.key(t, owner, slot) if fetch[t] else pairs[-1]
        received.append(
            [
                torch.zeros(0, dtype=torch.int64),
                flat,
                keys,
                torch.as_tensor(np.concatenate([np.zeros(0, np.int64), *gslots]), dtype=torch.int64),
            ]
        )
    return dedup, received, recv, rows, fetch, peer_of, pairs


def _reference(me, received, recv, rows, fetch, peer_of, world, pairs):
    """The per-table ``torch.unique`` of the rail peer's ``owner * rows + slot`` (``pairs``) and of the
    owner's (rail peer, slot), its own group's distinct rows (owner ``me``) served to itself."""
    out = []
    for t in range(len(rows)):
        if not fetch[t]:
            out.append(None)
            continue
        distinct, inverse = torch.unique(pairs[t], return_inverse=True)
        owner = distinct // rows[t]
        fetch_counts = torch.bincount(owner, minlength=world).numpy()
        lo = int(fetch_counts[:me].sum())
        local = (lo, lo + int(fetch_counts[me]))
        big = 10**6
        offset = torch.as_tensor(peer_of * big).repeat_interleave(torch.as_tensor(recv[:, t, GSLOTS]))
        mine = me * big + (distinct[local[0] : local[1]] % rows[t])
        served = torch.unique(torch.cat([offset + received[t][GSLOTS], mine]))
        owner_counts = torch.bincount(served // big, minlength=world).numpy()
        a = int(owner_counts[:me].sum())
        out.append((inverse, fetch_counts, local, served % big, owner_counts, (a, a + int(owner_counts[me]))))
    return out


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize(
    ("seed", "groups", "size", "me"), [(0, 2, 2, 0), (1, 2, 2, 3), (2, 3, 2, 4), (3, 2, 4, 5)]
)
def test_group_dedup_equals_a_per_table_unique(monkeypatch, dense, seed, groups, size, me):
    monkeypatch.setattr(group_dedup, "DENSE_PER_KEY", 10**9 if dense else 0)
    dedup, received, recv, rows, fetch, peer_of, pairs = _case(seed, groups, size, me)
    asked = dedup.compute(received, recv)
    want = _reference(me, received, recv, rows, fetch, peer_of, groups * size, pairs)
    for t, w in enumerate(want):
        assert asked.slots[t][0] is received[t][WARM] and asked.slots[t][1] is received[t][FLAT]
        if w is None:
            assert not asked.fetch_counts[:, t].any() and not asked.owner_counts[:, t].any()
            assert asked.owner_slots[t].numel() == 0 and asked.inverse[t].numel() == 0
            continue
        inverse, fetch_counts, local, owner_slots, owner_counts, own = w
        assert torch.equal(asked.inverse[t], inverse)
        np.testing.assert_array_equal(asked.fetch_counts[:, t], fetch_counts)
        assert tuple(asked.local[t]) == local
        assert torch.equal(asked.owner_slots[t], owner_slots)
        np.testing.assert_array_equal(asked.owner_counts[:, t], owner_counts)
        assert tuple(asked.own[t]) == own
        assert int(asked.num_distinct[t]) == int(fetch_counts.sum())


def test_without_a_group_fetched_table_only_the_slots_are_listed():
    routing = [types.SimpleNamespace(num_rows=10, cold_rows_per_rank=np.full(4, 3)) for _ in range(2)]
    dedup = GroupDedup(1, np.arange(4) % 2, np.array([1, 1, 3, 3]), routing, np.zeros(2, bool), "cpu")
    empty = torch.zeros(0, dtype=torch.int64)
    received = [[empty, torch.tensor([2, 0, 1]), empty, empty] for _ in range(2)]
    recv = np.zeros((4, 2, 4), np.int64)
    recv[:, :, FLAT] = [[1, 1], [0, 0], [2, 2], [0, 0]]
    asked = dedup.compute(received, recv)
    assert all(asked.slots[t][1] is received[t][FLAT] for t in range(2))
    assert not asked.fetch_counts.any() and not asked.owner_counts.any() and not asked.local.any()


def test_every_rank_makes_the_same_keys():
    """A requester's keys are its rail peer's: every rank numbers the ranks of every rail alike."""
    keys = []
    for me in range(6):
        dedup, *_ = _case(2, 3, 2, me)
        owner = torch.arange(6).repeat(2)
        keys.append(dedup.key(0, owner, torch.zeros(12, dtype=torch.int64) + 1))
    assert all(torch.equal(k, keys[0]) for k in keys)
    span = int(dedup.span[0])
    assert keys[0][:6].tolist() == [1, 1, 1 + span, 1 + span, 1 + 2 * span, 1 + 2 * span]
