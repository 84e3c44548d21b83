"""Routing of a plan (tiers, owners, slots), order completion, the padded view and group helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_workers import (
    SEED,
    TABLES,
    random_batch,
    run,
    write_test_plan,
)
from torch.nn.functional import embedding
from training_reference import check_training

from core.vocabulary import Tier
from flexshard.plan_file import read_plan
from flexshard.runtime import (
    build_compact_routing,
    build_routing,
    complete_order,
    deal,
    seeded_initializer,
    to_padded,
)
from solvers.dealing import interleave_pattern
from solvers.types import TablePlan


def test_complete_order_puts_untouched_ids_last_in_id_order():
    assert complete_order([5, 2, 7], 8).tolist() == [5, 2, 7, 0, 1, 3, 4, 6]
    assert complete_order(None, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="table 'x': id 9 outside"):
        complete_order([1, 9], 8, "x")
    with pytest.raises(ValueError, match="table 'x': id 1 listed twice"):
        complete_order([1, 3, 1], 8, "x")


@pytest.mark.parametrize(("shares", "period", "n"), [([0.5, 0.3, 0.2], 7, 40), ([0.25, 0.75], 4096, 50)])
def test_deal_follows_the_pattern_formula(shares, period, n):
    owner, slot, sizes = deal(n, np.array(shares), period)
    pattern = interleave_pattern(np.array(shares), period)
    for j in range(n):
        pos = pattern[j % period]
        want = (j // period) * int((pattern == pos).sum()) + int((pattern[: j % period] == pos).sum())
        assert owner[j] == pos and slot[j] == want
    for k in range(len(shares)):  # an owner's slots are 0..rows-1 in hotness order
        assert slot[owner == k].tolist() == list(range(sizes[k]))


def test_build_routing_tiers_and_slots():
    groups = [[0, 1], [2, 3]]
    tp = TablePlan("t", 3, 10, 20, np.array([0.7, 0.3, 0.7, 0.3]), np.array([0.1, 0.2, 0.3, 0.4]))
    order = np.random.default_rng(0).permutation(33)
    r = build_routing(tp, groups, order, period=5)
    assert (r.tier[order[:3]] == Tier.HOT).all() and r.slot[order[:3]].tolist() == [0, 1, 2]
    assert (r.tier[order[3:13]] == Tier.WARM).all() and (r.tier[order[13:]] == Tier.COLD).all()
    w_owner, w_slot, _ = deal(10, np.array([0.7, 0.3]), 5)
    c_owner, c_slot, _ = deal(20, tp.cold_share, 5)
    assert np.array_equal(r.owner[order[3:13]], w_owner) and np.array_equal(r.slot[order[3:13]], w_slot)
    assert np.array_equal(r.owner[order[13:]], c_owner)
    for rank in range(4):  # the cold rows dealt in hotness order, each owner's numbered by ascending id
        mine = np.sort(order[13:][c_owner == rank])
        assert r.slot[mine].tolist() == list(range(mine.size)) and (c_slot[c_owner == rank] < mine.size).all()
    for rank in range(4):  # ids_of lists each shard in slot order
        ids = r.ids_of(Tier.COLD, rank)
        assert r.slot[ids].tolist() == list(range(ids.size)) and (r.owner[ids] == rank).all()
    assert r.ids_of(Tier.HOT).tolist() == order[:3].tolist() and r.ids_of(Tier.WARM, 1).dtype == np.int64
    # what stays per row after the build: tier int8 + owner int32 + slot int32
    assert (r.tier.dtype, r.owner.dtype, r.slot.dtype) == (np.int8, np.int32, np.int32)
    assert r.tier.nbytes + r.owner.nbytes + r.slot.nbytes == 9 * 33


@pytest.mark.parametrize(
    ("hot", "warm", "listed"), [(5, 12, 97), (0, 0, 40), (7, 0, 10), (0, 20, 97), (5, 12, 10)]
)
def test_compact_layout_against_brute_force(hot, warm, listed):
    """Hot and warm rows route exactly as in the exact layout (hotness order); cold id ``i`` goes to
    ``pattern[i % P]`` and each owner numbers its cold ids 0, 1, ... in id order, skipping replicated
    ids. ``listed``: how many ids the hotness order lists (the rest are completed)."""
    groups = [[0, 1], [2, 3]]
    n = 97
    tp = TablePlan(
        "t", hot, warm, n - hot - warm, np.array([0.7, 0.3, 0.7, 0.3]), np.array([0.1, 0.2, 0.3, 0.4])
    )
    order = np.random.default_rng(1).permutation(n)[:listed]
    exact = build_routing(tp, groups, order, period=7)
    compact = build_compact_routing(tp, groups, order, period=7)
    tier, owner, slot = (t.numpy() for t in compact.lookup(torch.arange(n)))
    rep = exact.tier != Tier.COLD
    assert np.array_equal(tier, exact.tier)
    assert np.array_equal(owner[rep], exact.owner[rep]) and np.array_equal(slot[rep], exact.slot[rep])
    pattern = interleave_pattern(tp.cold_share, 7)
    for rank in range(4):
        mine = [i for i in range(n) if tier[i] == Tier.COLD and pattern[i % 7] == rank]  # brute force
        assert owner[mine].tolist() == [rank] * len(mine) and slot[mine].tolist() == list(range(len(mine)))
        assert compact.ids_of(Tier.COLD, rank).tolist() == mine
        assert compact.cold_rows_per_rank[rank] == len(mine)
    for tr, who in [(Tier.HOT, -1), (Tier.WARM, 0), (Tier.WARM, 1)]:
        assert compact.ids_of(tr, who).tolist() == exact.ids_of(tr, who).tolist()
    assert np.array_equal(compact.warm_rows_per_position, exact.warm_rows_per_position)
    # memory: 20 bytes per replicated row (id, rank, hole) and the deals' period-sized patterns
    per_row = compact.rep_ids.nbytes + compact.rep_rank.nbytes + compact.holes.nbytes
    assert per_row == 20 * (hot + warm)


def test_seeded_initializer_gives_each_row_the_same_values_wherever_it_is_built():
    init = seeded_initializer(3)
    full = init("item", np.arange(1000), 16).numpy()
    assert full.shape == (1000, 16) and full.dtype == np.float32
    assert full.min() >= -0.1 and full.max() < 0.1 and abs(full.mean()) < 0.005
    assert abs(full.std() - 0.1 / np.sqrt(3)) < 0.002  # U(-0.1, 0.1)
    ids = np.array([999, 5, 17, 5])
    assert np.array_equal(init("item", ids, 16).numpy(), full[ids])  # any subset, any order
    assert init("item", np.zeros(0, np.int64), 16).shape == (0, 16)
    assert not np.allclose(init("other", np.arange(4), 16).numpy(), full[:4])  # per table
    assert not np.allclose(seeded_initializer(4)("item", np.arange(4), 16).numpy(), full[:4])  # per seed


def test_to_padded_and_its_gradient():
    jagged = torch.arange(12.0).view(6, 2).requires_grad_()
    lengths = torch.tensor([2, 0, 4])
    out = to_padded(jagged, lengths)
    assert out.shape == (3, 4, 2)
    assert torch.equal(out[0, :2], jagged[:2].detach()) and not out[1].any()
    assert torch.equal(out[2], jagged[2:].detach())
    cut = to_padded(jagged, lengths, max_len=3)
    cut.sum().backward()
    assert jagged.grad[:, 0].tolist() == [1, 1, 1, 1, 1, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_nccl_on_the_local_gpus(tmp_path):
    """NCCL, one rank per visible GPU (one group): device chosen from the backend, outputs exact."""
    world = torch.cuda.device_count()
    plan = write_test_plan(tmp_path / "plan.json", 1, world)
    (tmp_path / "out").mkdir()
    results = run(world, plan, "small", backend="nccl", timeout_s=300.0)
    init = seeded_initializer(SEED)
    w = {name: init(name, np.arange(rows), dim) for name, rows, dim in TABLES}
    for r, res in enumerate(results):
        feats = random_batch(SEED, 99, r)
        for name, _rows, _dim in TABLES:
            assert torch.equal(res["forward"][True][name], embedding(feats[name][0], w[name]))
    check_training(read_plan(plan), results, "sgd", steps=2)


@pytest.mark.parametrize("build", [build_routing, build_compact_routing])
def test_start_positions_rotate_both_deals(build):
    """A tier dealt from position ``start`` gives item j to ``pattern[(j + start) % P]``: hotness-ordered
    warm (and exact cold) rows, id-ordered compact cold rows; each owner still numbers its rows 0, 1, ..."""
    groups, n = [[0, 1], [2, 3]], 61
    tp = TablePlan(
        "t", 4, 9, n - 13, np.array([0.6, 0.4, 0.6, 0.4]), np.full(4, 0.25), warm_start=1, cold_start=3
    )
    order = np.random.default_rng(2).permutation(n)
    routing = build(tp, groups, order, period=7)
    tier, owner, slot = (t.numpy() for t in routing.lookup(torch.arange(n)))
    warm_pattern = np.roll(interleave_pattern(np.array([0.6, 0.4]), 7), -1)
    cold_pattern = np.roll(interleave_pattern(np.full(4, 0.25), 7), -3)
    warm_ids = order[4:13]
    assert owner[warm_ids].tolist() == [warm_pattern[j % 7] for j in range(9)]
    cold = np.flatnonzero(tier == Tier.COLD)
    if build is build_routing:  # cold rows in hotness order
        cold_ids = order[13:]
        assert owner[cold_ids].tolist() == [cold_pattern[j % 7] for j in range(cold_ids.size)]
    else:  # cold ids dealt by id
        assert owner[cold].tolist() == [cold_pattern[i % 7] for i in cold]
    for rank in range(4):
        mine = np.flatnonzero((tier == Tier.COLD) & (owner == rank))
        assert sorted(slot[mine].tolist()) == list(range(mine.size))
        assert routing.cold_rows_per_rank[rank] == mine.size


@pytest.mark.parametrize("build", [build_routing, build_compact_routing])
def test_ranges_deal_is_torchrec_row_wise(build):
    """Every row cold, ids in contiguous ranges of ceil(23 / 4) = 6: owner id // 6, slot id % 6."""
    tp = TablePlan("t", 0, 0, 23, np.full(4, 0.5), np.full(4, 0.25), deal="ranges", cold_start=5)
    routing = build(tp, [[0, 1], [2, 3]], np.random.default_rng(4).permutation(23), period=7)
    tier, owner, slot = (t.numpy() for t in routing.lookup(torch.arange(23)))
    assert (tier == Tier.COLD).all()
    assert owner.tolist() == [i // 6 for i in range(23)] and slot.tolist() == [i % 6 for i in range(23)]
    assert routing.cold_rows_per_rank.tolist() == [6, 6, 6, 5]
    assert routing.ids_of(Tier.COLD, 3).tolist() == [18, 19, 20, 21, 22]


def test_unique_by_owner_is_dedup_sorted_by_owner_then_id():
    tp = TablePlan("t", 0, 0, 50, np.full(4, 0.5), np.array([0.4, 0.3, 0.2, 0.1]))
    r = build_routing(tp, [[0, 1], [2, 3]], np.random.default_rng(1).permutation(50), period=7)
    values = torch.as_tensor(np.random.default_rng(2).integers(0, 50, 200))
    ids, inverse, owner, slot = r.unique_by_owner(values)
    plain = torch.unique(values)  # the reference: dedup by id, then a stable sort by owner
    p_owner, p_slot = r.lookup_cold(plain)
    order = torch.argsort(p_owner, stable=True)
    assert torch.equal(ids, plain[order]) and torch.equal(owner, p_owner[order])
    assert torch.equal(slot, p_slot[order]) and torch.equal(ids[inverse], values)
    for k in range(4):  # an owner's slots ascend with its ids (its cold rows numbered by id)
        assert bool((slot[owner == k].diff() > 0).all())


def test_unique_by_owner_with_an_owner_key_sorts_owners_by_their_key():
    tp = TablePlan("t", 0, 0, 60, np.full(6, 0.5), np.array([0.2, 0.15, 0.2, 0.15, 0.15, 0.15]))
    r = build_routing(tp, [[0, 1], [2, 3], [4, 5]], np.random.default_rng(4).permutation(60), period=7)
    values = torch.as_tensor(np.random.default_rng(5).integers(0, 60, 300))
    key = torch.tensor([0, 3, 1, 4, 2, 5])  # rail order of rank 0 in 3 groups of 2: owners 0 2 4 1 3 5
    ids, inverse, owner, slot = r.unique_by_owner(values, key)
    plain = torch.unique(values)  # the reference: dedup by id, then a stable sort by the owner's key
    p_owner, p_slot = r.lookup_cold(plain)
    order = torch.argsort(key[p_owner], stable=True)
    assert torch.equal(ids, plain[order]) and torch.equal(owner, p_owner[order])
    assert torch.equal(slot, p_slot[order]) and torch.equal(ids[inverse], values)
    assert owner.unique_consecutive().tolist() == [0, 2, 4, 1, 3, 5]
