import numpy as np
import pytest
import torch

from flexshard.runtime.indexing import flat_nonzero


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
