"""``core.arrays``: ``exclusive_cumsum`` (each element's preceding sum) and ``block_bounds`` (the CSR row
pointer), against a loop on small arrays."""

from __future__ import annotations

import numpy as np
import pytest

from core.arrays import block_bounds, block_positions, exclusive_cumsum


def _by_loop(x: np.ndarray) -> np.ndarray:
    out, total = [], 0
    for v in x.reshape(-1).tolist():
        out.append(total)
        total += v
    return np.array(out, dtype=np.int64).reshape(x.shape)


def test_one_dimension_by_hand():
    assert exclusive_cumsum([3, 1, 2]).tolist() == [0, 3, 4]
    assert exclusive_cumsum([5]).tolist() == [0]
    got = exclusive_cumsum(np.zeros(0, np.int32))
    assert got.shape == (0,) and got.dtype == np.int64  # empty stays empty (no leading 0)


@pytest.mark.parametrize("shape", [(1, 1), (3, 4), (4, 3), (2, 3, 2)])
def test_flattened_in_c_order_and_along_each_axis_against_a_loop(shape):
    x = np.random.default_rng(sum(shape)).integers(0, 9, size=shape).astype(np.int32)
    got = exclusive_cumsum(x)
    assert got.dtype == np.int64 and got.shape == shape
    assert (got == _by_loop(x)).all()  # C order: blocks (i, j) one after another, j fastest
    if x.ndim == 2:
        assert (exclusive_cumsum(x.T).T == _by_loop(x.T).T).all()  # laid column-major
    for axis in range(x.ndim):
        want = np.apply_along_axis(_by_loop, axis, x)
        assert (exclusive_cumsum(x, axis=axis) == want).all()


def test_block_bounds_by_hand_and_against_a_loop():
    assert block_bounds([3, 1, 2]).tolist() == [0, 3, 4, 6]
    assert block_bounds([0, 0]).tolist() == [0, 0, 0]
    empty = block_bounds(np.zeros(0, np.int32))
    assert empty.tolist() == [0] and empty.dtype == np.int64  # no block: the one bound
    x = np.random.default_rng(7).integers(0, 9, size=(3, 4)).astype(np.int32)
    got = block_bounds(x)
    assert got.dtype == np.int64 and got.shape == (13,)
    assert (got[:-1] == _by_loop(x).reshape(-1)).all() and got[-1] == x.sum()  # C order, then the end


@pytest.mark.parametrize("seed", range(4))
def test_block_positions_against_a_loop(seed):
    rng = np.random.default_rng(seed)
    sizes, first = rng.integers(0, 5, 7), rng.integers(0, 50, 7)
    want = [p for n, f in zip(sizes.tolist(), first.tolist(), strict=True) for p in range(f, f + n)]
    got = block_positions(sizes, first)
    assert got.dtype == np.int64 and got.tolist() == want
    assert block_positions([2, 0, 3], [10, 4, 0]).tolist() == [10, 11, 0, 1, 2]
    assert block_positions([], []).size == 0
