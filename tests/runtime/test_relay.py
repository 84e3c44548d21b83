"""The one-dim fp32 relay's index arithmetic (:mod:`flexshard.runtime.relay`) and the per-block copies
and adds of :mod:`flexshard.runtime.transfer`, against direct references on random small cases (one
process, no collective)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexshard.runtime.relay import distinct_rows_at, rail_sums, wire_order
from flexshard.runtime.transfer import add_blocks, copy_blocks, joined_blocks


def _buffer(
    counts: np.ndarray, dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """A receive buffer of ``counts[p, c]`` rows per (peer, column) block and its blocks [c][p]."""
    buffer = torch.randn(int(counts.sum()), dim, generator=gen)
    blocks = buffer.split(counts.reshape(-1).tolist())
    peers, cols = counts.shape
    return buffer, [[blocks[p * cols + c] for p in range(peers)] for c in range(cols)]


@pytest.mark.parametrize("seed", range(6))
def test_distinct_rows_at_finds_every_distinct_row_in_the_buffer(seed):
    rng = np.random.default_rng(seed)
    peers, tables = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    counts = rng.integers(0, 4, size=(peers, 3 * tables))
    counts[rng.random(counts.shape) < 0.3] = 0  # empty blocks
    buffer, blocks = _buffer(counts, 3, torch.Generator().manual_seed(seed))
    column = np.arange(tables) * 3 + 2
    at = distinct_rows_at(counts, column, torch.device("cpu"))
    want = torch.cat([torch.zeros(0, 3)] + [torch.cat(blocks[c]) for c in column])  # table-major, by peer
    assert at.dtype == torch.int64 and torch.equal(buffer.index_select(0, at), want)


@pytest.mark.parametrize("seed", range(6))
def test_wire_order_lists_each_peers_ids_of_every_table_in_wire_order(seed):
    rng = np.random.default_rng(seed)
    world, tables = int(rng.integers(2, 6)), int(rng.integers(1, 4))
    to = np.sort(rng.choice(world, int(rng.integers(1, world + 1)), replace=False))
    ids = np.zeros((world, tables), np.int64)
    ids[to] = rng.integers(0, 5, size=(to.size, tables))
    distinct = int(rng.integers(1, 9))
    # per table, its ids in peer order (each an index into the joined distinct rows)
    per_table = [
        [torch.as_tensor(rng.integers(0, distinct, int(ids[p, t]))) for p in range(world)]
        for t in range(tables)
    ]
    joined = torch.cat([torch.zeros(0, dtype=torch.int64)] + [torch.cat(per_table[t]) for t in range(tables)])
    row_of = torch.as_tensor(rng.permutation(distinct + 3)[:distinct])
    got = row_of[joined[wire_order(ids, to, torch.device("cpu"))]]
    want = [row_of[per_table[t][p]] for p in to for t in range(tables)]
    assert torch.equal(got, torch.cat([torch.zeros(0, dtype=torch.int64), *want]))


@pytest.mark.parametrize("seed", range(4))
def test_block_copies_and_adds_equal_the_joined_ones_bit_for_bit(seed):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 5, size=4)
    views = list(torch.randn(int(sizes.sum()), 5, generator=gen).split(sizes.tolist()))
    n = int(sizes.sum())
    rows = torch.randn(n + 2, 5, generator=gen)
    index = torch.as_tensor(rng.permutation(n + 2)[:n])
    want = rows.clone().index_copy_(0, index, joined_blocks(views))
    copy_blocks(rows, index, views)
    assert torch.equal(rows, want)
    repeated = torch.as_tensor(rng.integers(0, 3, n))  # rows summed from several blocks
    total = torch.zeros(3, 5)
    want = torch.zeros(3, 5).index_add_(0, repeated, joined_blocks(views))
    add_blocks(total, repeated, views)
    assert torch.equal(total, want)
    one = torch.zeros(3, 5)
    add_blocks(one, repeated, joined_blocks(views))
    assert torch.equal(one, want)


def _both_paths(rank: int, world: int, strategy: str, groups: int = 2) -> dict:
    """The bench's default tables (one dim) on ``strategy``'s plan (``row_wise_group_dedup``: every table
    group fetched; ``row_wise``: every table flat), trained 3 steps on the one-dim fp32 path with the
    rows in wire order (``joint``: a relaying requester's own rows read where ``rows`` left them;
    ``joint_own_block``: gathered into a block of their own, the GPU's choice), without it
    (``gathered``: per-table copies) and on the per-table path (``per_table``)."""
    import json
    import tempfile
    from pathlib import Path

    from flexshard.bench.config import BenchConfig
    from flexshard.bench.plans import h100_view, make_plans
    from flexshard.bench.worker import load_data
    from flexshard.plan_file import read_plan
    from flexshard.runtime import ShardedSequenceEmbedding, exchange_protocol, wire_rows
    from flexshard.runtime.initializer import seeded_initializer

    cfg = BenchConfig(nproc=world, groups=groups, batch=8, plan_for="h100", torchrec=False)
    data = load_data(cfg, world)
    view = h100_view(world, groups)
    plan = make_plans(data, view, view, cfg.budget, False, "step", None)[strategy]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "plan.json")
        path.write_text(json.dumps(plan.document))
        for name, (one_dim, flat_wire, own_in_relay) in PATHS.items():
            model = ShardedSequenceEmbedding(
                read_plan(str(path)), data.tables, data.orders, init=cfg.seed, optimizer="adagrad", lr=cfg.lr
            )
            assert model.protocol.one_dim_fp32  # one dim, fp32: the relay path unless switched off
            assert model.protocol.flat_wire == (not model.group_fetch)  # every table flat: rows in place
            model.protocol.one_dim_fp32 = one_dim
            model.protocol.flat_wire = model.protocol.flat_wire and flat_wire
            model.protocol.own_rows_in_relay = own_in_relay
            outputs, traffic, in_relay = [], [], []
            sums_wire = wire_rows.rail_sums_wire

            def counted(*args, _seen=in_relay, _sums=sums_wire):
                _seen.append(bool(args[-1]))  # own_summed: its own terms summed where the rows lay
                return _sums(*args)

            exchange_protocol.rail_sums_wire = counted  # which sums each step took
            try:
                for step in range(3):
                    got = model(data.make_batch(step, rank))
                    outputs.append({k: v.detach().clone() for k, v in got.items()})
                    sum(0.5 * v.pow(2).sum() for v in got.values()).backward()
                    model.step()
                    traffic.append(model.traffic.bytes.copy())
            finally:
                exchange_protocol.rail_sums_wire = sums_wire
            out[name] = (outputs, traffic, model.shard_rows(), bool(model.group_fetch), sum(in_relay))
    # the first step's rows straight from the initializer (no routing): what every path must look up
    init = seeded_initializer(cfg.seed)
    first = data.make_batch(0, rank)
    out["reference"] = {n: init(n, first[n][0].numpy(), dim) for n, _rows, dim in data.tables}
    return out


# (one dim fp32, flat rows in place, a relaying requester's own rows read where rows left them)
PATHS = {
    "joint": (True, True, True),
    "joint_own_block": (True, True, False),
    "gathered": (True, False, False),
    "per_table": (False, False, False),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "world", "groups"),
    [("row_wise_group_dedup", 4, 2), ("row_wise", 4, 2), ("row_wise_group_dedup", 6, 3)]
    + [("row_wise_group_dedup", 8, 2)],
    # 3 groups: the other groups' owners out of rank order; groups of 4: relays third and fourth in
    # their group, whose own terms are added after two peers' (wire_rows.rail_sums_wire, own_summed)
    ids=["group-4x2", "flat-4x2", "group-6x3", "group-8x2"],
)
def test_the_one_dim_paths_equal_the_per_table_path_bit_for_bit(strategy, world, groups):
    from runtime_workers import run_function

    for rank, res in enumerate(run_function(_both_paths, world, strategy, groups, timeout_s=300.0)):
        old_out, old_traffic, old_rows, fetched, _ = res["per_table"]
        assert fetched == (strategy == "row_wise_group_dedup"), rank
        # the own rows read in the relay's buffer on every group-fetch step, on that path alone
        assert [res[n][4] for n in PATHS] == [3 * fetched, 0, 0, 0], rank
        reference = res["reference"]  # every path routes alike: its first outputs against the initializer
        assert old_out[0].keys() == reference.keys()
        assert all(torch.equal(old_out[0][n], reference[n]) for n in reference), rank
        for name in ("joint", "joint_own_block", "gathered"):
            new_out, new_traffic, new_rows, _, _ = res[name]
            for a, b in zip(new_out, old_out, strict=True):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (rank, name)
            for a, b in zip(new_traffic, old_traffic, strict=True):
                np.testing.assert_array_equal(a, b)
            assert new_rows.keys() == old_rows.keys()
            for key, (ids, weights, states) in new_rows.items():
                o_ids, o_weights, o_states = old_rows[key]
                assert np.array_equal(ids, o_ids) and torch.equal(weights, o_weights), (rank, name, key)
                assert all(torch.equal(v, o_states[n]) for n, v in states.items()), (rank, name, key)


@pytest.mark.parametrize("seed", range(6))
def test_rail_sums_are_the_per_table_sums_in_send_order(seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    rail, tables, peers = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    fetch = rng.integers(0, 4, size=(rail, tables))
    distinct = fetch.sum(axis=0)  # per table
    ids = np.where(distinct > 0, rng.integers(0, 7, tables), 0)
    inverse = [
        torch.as_tensor(rng.integers(0, max(int(d), 1), int(n))) for d, n in zip(distinct, ids, strict=True)
    ]
    first = np.concatenate([[0], np.cumsum(distinct)[:-1]])
    joined = torch.cat(
        [torch.zeros(0, dtype=torch.int64)] + [i + int(f) for i, f in zip(inverse, first, strict=True)]
    )
    got = []
    for n in ids:  # per-peer blocks of each table's received gradients
        cut = np.sort(rng.integers(0, int(n) + 1, peers - 1))
        got.append(list(torch.randn(int(n), 3, generator=gen).split(np.diff([0, *cut, int(n)]).tolist())))
    me = int(rng.integers(0, rail))
    sums = rail_sums(fetch, joined, ids, got, 3, me, torch.device("cpu"))
    per_table = [
        torch.zeros(int(d), 3).index_add_(0, i, torch.cat(g))
        for d, i, g in zip(distinct, inverse, got, strict=True)
    ]
    start = np.cumsum(fetch, axis=0) - fetch  # rail owner j's first row within table t
    own_last = [j for j in range(rail) if j != me] + [me]  # the other owners' sums, then its own
    want = [
        per_table[t][int(start[j, t]) : int(start[j, t] + fetch[j, t])]
        for j in own_last
        for t in range(tables)
    ]
    assert torch.equal(sums.joined, torch.cat([torch.zeros(0, 3), *want]))
    assert np.array_equal(sums.fetch, fetch) and sums.me == me
    assert sums.sent == int(fetch.sum() - fetch[me].sum())


@pytest.mark.parametrize("seed", range(4))
def test_gather_own_rows_writes_this_ranks_block_and_leaves_the_rest_to_send(seed):
    from flexshard.runtime.relay import gather_own_rows

    rng = np.random.default_rng(seed)
    peers, tables = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    me = int(rng.integers(0, peers))
    sent = rng.integers(0, 4, size=(peers, tables))
    buffer = torch.randn(9, 3, generator=torch.Generator().manual_seed(seed))
    index = torch.as_tensor(rng.integers(0, 9, int(sent.sum())))
    first = rng.integers(0, 3, size=tables)  # the own block's first row in each table's rows
    rows = [torch.full((int(first[t] + sent[me, t]) + 2, 3), -1.0) for t in range(tables)]
    rest = gather_own_rows(buffer, index, sent, me, rows, first)
    blocks = index.split(sent.reshape(-1).tolist())  # wire order (peer, table)
    for t in range(tables):
        lo, n = int(first[t]), int(sent[me, t])
        assert torch.equal(rows[t][lo : lo + n], buffer[blocks[me * tables + t]])
        assert (rows[t][:lo] == -1).all() and (rows[t][lo + n :] == -1).all()  # nothing else written
    others = [blocks[p * tables + t] for p in range(peers) if p != me for t in range(tables)]
    assert torch.equal(rest, torch.cat([index[:0], *others]))


@pytest.mark.parametrize("seed", range(6))
def test_wire_rows_read_and_sum_like_the_per_table_lookups(seed):
    """Rows laid out as scatter delivers them (the other peers' blocks by (peer, table), then this
    rank's own by table) give every table's output in input order, and the gradient per buffer row is
    each table's per-unique-id sum in the same place, bit for bit."""
    from flexshard.runtime.lookups import TableLookup
    from flexshard.runtime.wire_rows import wire_rows

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    peers, tables = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    me = int(rng.integers(0, peers))
    per_block = rng.integers(0, 4, size=(peers, tables))
    per_block[rng.random(per_block.shape) < 0.3] = 0
    unique = [torch.randn(int(per_block[:, t].sum()), 3, generator=gen) for t in range(tables)]
    inverse = [torch.as_tensor(rng.integers(0, max(len(u), 1), 7 if len(u) else 0)) for u in unique]
    rows = wire_rows(inverse, per_block, me, 3, torch.device("cpu"))
    blocks = [u.split(per_block[:, t].tolist()) for t, u in enumerate(unique)]  # [t][p]
    order = [p for p in range(peers) if p != me] + [me]
    laid = [blocks[t][p] for p in order for t in range(tables)]
    rows.buffer.copy_(torch.cat([torch.zeros(0, 3), *laid]))
    assert rows.received == int(per_block.sum() - per_block[me].sum())
    assert np.array_equal(rows.per_peer, per_block.sum(axis=1))
    for t in range(tables):
        assert torch.equal(rows.output(t), unique[t][inverse[t]])
    grads = [torch.randn(int(i.numel()), 3, generator=gen) for i in inverse]
    per_table = []
    for t in range(tables):
        lookup = TableLookup(inverse[t], torch.zeros(len(unique[t]), dtype=torch.int64), *([None] * 6))
        per_table.append(lookup.unique_gradient(grads[t]).split(per_block[:, t].tolist()))
    want = torch.cat([torch.zeros(0, 3)] + [per_table[t][p] for p in order for t in range(tables)])
    assert torch.equal(rows.gradient(grads), want)


@pytest.mark.parametrize("seed", range(6))
def test_rail_sums_in_wire_order_equal_the_per_table_sums_bit_for_bit(seed):
    from flexshard.runtime.wire_rows import rail_sums_wire

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    rail, tables, peers = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    me = int(rng.integers(0, peers))
    fetch = rng.integers(0, 4, size=(rail, tables))
    distinct = fetch.sum(axis=0)
    ids = np.where(distinct[None, :] > 0, rng.integers(0, 5, size=(peers, tables)), 0)  # [p, t]
    first = np.concatenate([[0], np.cumsum(distinct)[:-1]])
    inverse = [
        [torch.as_tensor(rng.integers(0, max(int(distinct[t]), 1), int(ids[p, t]))) for p in range(peers)]
        for t in range(tables)
    ]
    joined = torch.cat(
        [torch.zeros(0, dtype=torch.int64)] + [torch.cat(inverse[t]) + int(first[t]) for t in range(tables)]
    )
    got = [[torch.randn(int(ids[p, t]), 3, generator=gen) for p in range(peers)] for t in range(tables)]
    rail_me = int(rng.integers(0, rail))
    want = rail_sums(fetch, joined, ids.sum(axis=0), got, 3, rail_me, torch.device("cpu"))
    wire = joined[wire_order(ids, np.arange(peers), torch.device("cpu"))]
    received = torch.cat(
        [torch.zeros(0, 3)] + [got[t][p] for p in range(peers) if p != me for t in range(tables)]
    )
    own = torch.cat([torch.zeros(0, 3)] + [got[t][me] for t in range(tables)])
    sums = rail_sums_wire(fetch, wire, ids.sum(axis=1), me, rail_me, received, own, torch.device("cpu"))
    assert torch.equal(sums.joined, want.joined) and np.array_equal(sums.fetch, fetch)
    assert sums.me == rail_me
