import contextlib

import numpy as np
import pytest
import torch

from flexshard.runtime.device_rules import counted_as_gpu
from flexshard.runtime.indexing import block_rows, flat_nonzero, repeated, repeated_columns, repeated_on


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_flat_nonzero_is_torch_nonzero(dtype, n):
    rng = np.random.default_rng(n)
    mask = torch.as_tensor(rng.integers(0, 3, n) * (rng.random(n) < 0.4)).to(dtype)
    got = flat_nonzero(mask)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.nonzero(mask).flatten())


def test_flat_nonzero_reads_a_strided_view():
    mask = torch.tensor([1, 0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)[::2]  # 1, 0, 1, 1
    assert flat_nonzero(mask).tolist() == [0, 2, 3]


def _blocks_by_hand(sizes, first):
    return [r for n, f in zip(sizes, first, strict=True) for r in range(f, f + n)]


@pytest.mark.parametrize("as_gpu", [False, True])
@pytest.mark.parametrize(
    "sizes, first",
    [([], []), ([0], [5]), ([3], [0]), ([2, 0, 3], [10, 4, 0]), ([1, 4, 2, 0, 5], [7, 0, 30, 2, 11])],
)
def test_block_rows_is_every_block_in_order(as_gpu, sizes, first):
    sizes, first = np.array(sizes, dtype=np.int64), np.array(first, dtype=np.int64)
    with counted_as_gpu() if as_gpu else contextlib.nullcontext():
        got = block_rows(sizes, first, torch.device("cpu"))
    assert got.dtype == torch.int64
    assert got.tolist() == _blocks_by_hand(sizes.tolist(), first.tolist())


@pytest.mark.parametrize("as_gpu", [False, True])
def test_repeated_on_repeats_each_value_its_count(as_gpu):
    values, counts = np.array([[4, -1], [9, 0]]), np.array([[2, 0], [3, 1]])  # raveled in C order
    with counted_as_gpu() if as_gpu else contextlib.nullcontext():
        got = repeated_on(values, counts, torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == [4, 4, 9, 9, 9, 0]
    assert repeated(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).size == 0


@pytest.mark.parametrize("as_gpu", [False, True])
def test_repeated_columns_repeats_each_column_its_count(as_gpu):
    values, counts = np.array([[1, 2, 3], [10, 20, 30]]), np.array([2, 0, 3])
    with counted_as_gpu() if as_gpu else contextlib.nullcontext():
        got = repeated_columns(values, counts, torch.device("cpu"))
    assert got.dtype == torch.int64
    assert got.tolist() == [[1, 1, 3, 3, 3], [10, 10, 30, 30, 30]]
