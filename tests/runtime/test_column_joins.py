"""Received blocks joined per column (:mod:`flexshard.runtime.column_joins`): the same rows as joining
each column's per-peer blocks in the order asked, built by hand; the rule by hand; and the exchanges
that use it (``exchange_gathered_async``'s ``joined_in``, the relay's ``per_table_views``) with the join
forced, on one rank and on 3 real gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import run_function

from flexshard.runtime import column_joins, relay, transfer
from flexshard.runtime.column_joins import JOIN_OPS, join_columns, joins_columns
from flexshard.runtime.indexing import STAGED_INDEX_OPS


def _blocks(recv: np.ndarray, me: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A receive buffer of the other peers' blocks in (peer, column) order, this rank's own by column,
    and every block (p, c) by hand."""
    gen = torch.Generator().manual_seed(seed)
    block = {(p, c): torch.randn(int(n), dim, generator=gen) for (p, c), n in np.ndenumerate(recv)}
    peers, cols = recv.shape
    received = torch.cat([block[p, c] for p in range(peers) if p != me for c in range(cols)])
    own = torch.cat([block[me, c] for c in range(cols)])
    return received, own, block


@pytest.mark.parametrize("me", [0, 2])
@pytest.mark.parametrize("order", [None, "own first", "reversed"])
def test_join_columns_is_each_columns_blocks_joined_in_the_order(me, order):
    recv = np.random.default_rng(7).integers(0, 4, size=(4, 3))
    recv[1, 2] = 0
    recv[:, 1] = 0  # an empty column
    received, own, block = _blocks(recv, me, 5, seed=me)
    peers = {
        None: [0, 1, 2, 3],
        "own first": [me, *(p for p in range(4) if p != me)],
        "reversed": [3, 2, 1, 0],
    }
    got = join_columns(received, own, recv, me, None if order is None else peers[order])
    assert len(got) == 3
    for c in range(3):
        want = torch.cat([block[p, c] for p in peers[order]])
        assert torch.equal(got[c], want), c


def test_join_columns_with_nothing_of_its_own_or_from_the_others():
    recv = np.array([[2, 0], [0, 0], [1, 3]])
    received, own, block = _blocks(recv, 1, 2, seed=3)  # rank 1 keeps none of its own
    got = join_columns(received, own, recv, 1)
    assert torch.equal(got[0], torch.cat([block[0, 0], block[2, 0]]))
    assert torch.equal(got[1], block[2, 1])
    alone = np.array([[0, 0], [4, 1], [0, 0]])  # every row its own
    received, own, block = _blocks(alone, 1, 2, seed=4)
    assert received.shape[0] == 0
    got = join_columns(received, own, alone, 1)
    assert torch.equal(got[0], block[1, 0]) and torch.equal(got[1], block[1, 1])


def test_joins_columns_only_on_a_gpu_and_where_it_saves_ops():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (JOIN_OPS, STAGED_INDEX_OPS) == (2, 5)
    many = np.ones((8, 3), dtype=np.int64)  # 24 adds become 3: 21 saved against 2 + 5 + 5
    assert joins_columns(gpu, many, 0) and not joins_columns(cpu, many, 0)
    four = np.ones((4, 3), dtype=np.int64)  # 12 adds become 3: 9 saved, not more than 12
    assert not joins_columns(gpu, four, 0)
    five = np.ones((5, 3), dtype=np.int64)  # 15 -> 3: 12 saved, not more than 12
    assert not joins_columns(gpu, five, 0)
    five[0] = 0  # its own empty: 12 -> 3 saves 9 against 2 + 5
    assert joins_columns(gpu, five, 0)
    six = np.ones((6, 3), dtype=np.int64)  # 18 -> 3: 15 saved, more than 12
    assert joins_columns(gpu, six, 0)


def _forced(rank: int, world: int) -> list:
    """``exchange_gathered_async`` with ``joined_in`` (the join forced on and off) and the relay's
    per-table views, on the same one-dim exchanges."""
    rule = (transfer.joins_columns, relay.joins_columns)
    out = []
    try:
        for seed in range(3):
            counts = np.random.default_rng(seed).integers(0, 4, size=(world, world, 3))  # [from, to, col]
            counts[:, :, 1] = 0 if seed == 1 else counts[:, :, 1]
            sent, recv = counts[rank], counts[:, rank]
            gen = torch.Generator().manual_seed(10 * seed + rank)
            sources = [torch.randn(7, 4, generator=gen) for _ in range(3)]
            indices = [torch.randint(0, 7, (int(sent[:, c].sum()),), generator=gen) for c in range(3)]
            if seed == 2:
                indices[0] = None
                sources[0] = torch.randn(int(sent[:, 0].sum()), 4, generator=gen)
            order = list(range(world))[::-1]
            got = {}
            for forced in (True, False):
                transfer.joins_columns = relay.joins_columns = lambda *a, forced=forced: forced
                got[forced] = exchange(sources, indices, sent, recv, order)
            out.append((got, recv))
    finally:
        transfer.joins_columns, relay.joins_columns = rule
    return out


def exchange(sources, indices, sent, recv, order) -> tuple:
    views = transfer.exchange_gathered_async("", sources, indices, sent, recv, joined_in=order).wait()
    me = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
    others = [p for p in range(recv.shape[0]) if p != me]
    base = transfer.exchange_gathered_async("", sources, indices, sent, recv).wait()
    received = torch.cat([torch.zeros(0, 4)] + [base[c][p] for p in others for c in range(3)])
    own = torch.cat([base[c][me] for c in range(3)])
    tables = relay.per_table_views(received, own, recv, me, order)
    return views, tables, base


def _check(results: list, world: int) -> None:
    order = list(range(world))[::-1]
    for got, recv in results:
        views, tables, base = got[True]
        for c in range(3):
            want = torch.cat([base[c][p] for p in order])
            assert isinstance(views[c], torch.Tensor) and torch.equal(views[c], want), c
            assert isinstance(tables[c], torch.Tensor) and torch.equal(tables[c], want), c
        views, tables, _ = got[False]  # not joined: the per-peer views as before
        for c in range(3):
            assert [v.shape[0] for v in views[c]] == recv[:, c].tolist()
            assert [torch.equal(v, b) for v, b in zip(views[c], base[c], strict=True)] == [True] * world
            assert [torch.equal(v, b) for v, b in zip(tables[c], base[c], strict=True)] == [True] * world


def test_forced_join_on_one_rank():
    _check(_forced(0, 1), 1)


@pytest.mark.slow
def test_forced_join_on_three_ranks_is_the_views_joined_in_order():
    for results in run_function(_forced, 3):
        _check(results, 3)


def test_module_rule_is_the_one_the_exchanges_use():
    assert transfer.joins_columns is column_joins.joins_columns
    assert relay.joins_columns is column_joins.joins_columns


def test_peer_runs():
    from flexshard.runtime.placing import peer_runs

    assert peer_runs([2, 0, 1, 3]) == [(2, 3), (0, 2), (3, 4)]
    assert peer_runs([0, 1, 2]) == [(0, 3)]
    assert peer_runs([3, 2, 1]) == [(3, 4), (2, 3), (1, 2)]
    assert peer_runs([]) == []


@pytest.mark.parametrize("own_at", [0, 2])
def test_rail_sums_joined_add_what_the_views_add_bit_for_bit(own_at):
    """``add_rail_views`` of each table's blocks joined in own-group-first order (one add) leaves the
    same gradients, bit for bit, as adding the per-peer views in that order."""
    from core.vocabulary import Tier
    from flexshard.runtime.optimizers import REGISTRY
    from flexshard.runtime.placing import add_rail_views, own_group_first
    from flexshard.runtime.shards import Shard

    peers, tables, dim = 4, 2, 3
    recv = np.random.default_rng(own_at).integers(0, 5, size=(peers, tables))
    recv[1, 1] = 0
    gen = torch.Generator().manual_seed(own_at)
    slots = [torch.randint(0, 6, (int(recv[:, t].sum()),), generator=gen) for t in range(tables)]
    views = [
        [torch.randn(int(recv[p, t]), dim, generator=gen) * 1e3**p for p in range(peers)]
        for t in range(tables)
    ]
    order = own_group_first(peers, own_at)
    optimizer = REGISTRY["sgd"]

    def shards() -> dict:
        return {(t, Tier.COLD): Shard.of(np.arange(6), torch.zeros(6, dim), optimizer) for t in range(tables)}

    by_views, by_join = shards(), shards()
    add_rail_views(by_views, slots, recv, order, views)
    joined = [torch.cat([views[t][p] for p in order]) for t in range(tables)]
    add_rail_views(by_join, slots, recv, order, joined)
    for key, shard in by_views.items():
        assert torch.equal(shard.grads, by_join[key].grads), key
        assert torch.equal(shard.touched, by_join[key].touched), key
    assert by_views[(0, Tier.COLD)].grads.abs().sum() > 0


def test_with_the_buffer_the_exchange_never_joins(monkeypatch):
    monkeypatch.setattr(transfer, "joins_columns", lambda *a: True)
    counts = np.array([[2, 1]])
    sources = [torch.randn(3, 4), torch.randn(3, 4)]
    indices = [torch.tensor([2, 0]), torch.tensor([1])]
    views, buffer, first = transfer.exchange_gathered_async(
        "", sources, indices, counts, counts, with_buffer=True, joined_in=[0]
    ).wait()
    assert torch.equal(views[0][0], sources[0][[2, 0]]) and torch.equal(views[1][0], sources[1][[1]])
    joined = transfer.exchange_gathered_async("", sources, indices, counts, counts, joined_in=[0]).wait()
    assert torch.equal(joined[0], sources[0][[2, 0]]) and torch.equal(joined[1], sources[1][[1]])
