"""The shard bank (flexshard.runtime.shards.banked_shards): the shards of one dim as row ranges of one
tensor per quantity, updated at once; every optimizer's bank step against the same shards stepped one by
one, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexshard.runtime import OPTIMIZERS, Hyper, Shard, row_optimizer
from flexshard.runtime.shards import banked_shards

HYPER = Hyper(lr=0.05, eps=1e-8, beta1=0.9, beta2=0.999)
# (key, rows, dim): two dims, a shard of no rows between two of dim 8
SHAPES = (("a", 5, 8), ("b", 0, 8), ("c", 7, 4), ("d", 3, 8))


def _parts(seed: int = 0) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (np.arange(10 * i, 10 * i + n), torch.randn(n, d, generator=gen))
        for i, (k, n, d) in enumerate(SHAPES)
    }


def _is_rows_of(view: torch.Tensor, bank: torch.Tensor, lo: int) -> bool:
    """``view`` shares ``bank``'s memory from its row ``lo`` on."""
    same = view.untyped_storage().data_ptr() == bank.untyped_storage().data_ptr()
    return same and view.storage_offset() == lo * (bank.shape[1] if bank.dim() > 1 else 1)


def test_shards_are_views_of_one_bank_per_dim_in_the_order_given():
    parts = _parts()
    shards, banks = banked_shards(parts, row_optimizer("rowwise_adagrad"))
    assert list(shards) == ["a", "b", "c", "d"]
    assert [tuple(b.weights.shape) for b in banks] == [(8, 8), (7, 4)]  # a, b, d in one; c alone
    eight, four = banks
    for key, lo in (("a", 0), ("b", 5), ("d", 5)):
        s = shards[key]
        for mine, bank in ((s.weights, eight.weights), (s.grads, eight.grads), (s.touched, eight.touched)):
            assert _is_rows_of(mine, bank, lo), key  # a view: no copy of its own
        assert _is_rows_of(s.states["momentum1"], eight.states["momentum1"], lo)
        assert torch.equal(s.weights, parts[key][1]) and np.array_equal(s.ids, parts[key][0])
    assert torch.equal(shards["c"].weights, parts["c"][1])
    assert _is_rows_of(shards["c"].weights, four.weights, 0)
    assert torch.equal(eight.weights, torch.cat([parts["a"][1], parts["d"][1]]))
    parts["a"][1].add_(1.0)  # the bank holds a copy
    assert not torch.equal(shards["a"].weights, parts["a"][1])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_bank_step_equals_each_shard_stepped_alone(name):
    opt = row_optimizer(name)
    banked, banks = banked_shards(_parts(), opt)
    alone = {k: Shard.of(ids, w.clone(), opt) for k, (ids, w) in _parts().items()}
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        for key, rows, dim in SHAPES:
            if rows == 0:
                continue
            slots = torch.randint(0, rows, (6,), generator=gen)  # repeats add up; some rows untouched
            grads = torch.randn(6, dim, generator=gen)
            banked[key].add_gradient(slots, grads)
            alone[key].add_gradient(slots, grads)
        for bank in banks:
            bank.apply(opt, HYPER, step)
        for shard in alone.values():
            shard.apply(opt, HYPER, step)
        for key in alone:
            b, a = banked[key], alone[key]
            assert torch.equal(b.weights, a.weights), (name, step, key)
            assert all(torch.equal(b.states[n], a.states[n]) for n in a.states), (name, step, key)
            assert not b.grads.any() and not b.touched.any()  # cleared, as each shard's own
    assert any(not torch.equal(banked[k].weights, w) for k, (_, w) in _parts().items())  # rows moved


def test_clearing_a_bank_clears_every_shard():
    shards, banks = banked_shards(_parts(), row_optimizer("sgd"))
    shards["d"].add_gradient(torch.tensor([0, 2]), torch.ones(2, 8))
    shards["c"].add_gradient(torch.tensor([6]), torch.ones(1, 4))
    assert shards["d"].touched.tolist() == [1, 0, 1] and banks[0].touched.sum() == 2
    for bank in banks:
        bank.clear_gradients()
    assert all(not s.grads.any() and not s.touched.any() for s in shards.values())
