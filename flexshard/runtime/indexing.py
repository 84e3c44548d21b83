"""Index helpers of the runtime's hot paths."""

from __future__ import annotations

import numpy as np
import torch

from core.arrays import block_positions, exclusive_cumsum
from flexshard.runtime.device_rules import gpu_paths

# ops of one index of blocks (block_rows: its host copy and three ops) and the copy that reads it
STAGED_INDEX_OPS = 5


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64: the positions of ``mask``'s non-zero elements, ascending (``torch.nonzero(mask).flatten()``
    of a 1-D tensor). On the CPU by numpy's ``flatnonzero`` over the same memory (a tenth of
    ``torch.nonzero``'s time at 10^4-10^5 elements, one thread); with the GPU's choices
    (:func:`~flexshard.runtime.device_rules.gpu_paths`) ``torch.nonzero``."""
    if gpu_paths(mask.device):
        return torch.nonzero(mask).flatten()
    return torch.from_numpy(np.flatnonzero(mask.contiguous().numpy()).astype(np.int64, copy=False))


def block_rows(sizes: np.ndarray, first: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64[sum(sizes)]: rows ``first[i]`` to ``first[i] + sizes[i] - 1`` of every block ``i``, blocks
    in order; one repeat of each block's shift plus one range (no op per block). With the GPU's choices
    (:func:`~flexshard.runtime.device_rules.gpu_paths`) on the device after one host copy of the
    shifts and sizes; on the CPU in numpy over host arrays, wrapped without a copy (a quarter of the
    torch ops' time at 10^3-10^4 rows, where each op's dispatch dominates)."""
    if not gpu_paths(device):
        return torch.from_numpy(block_positions(sizes, first))
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    delta = np.asarray(first, dtype=np.int64) - exclusive_cumsum(sizes)
    delta_t, sizes_t = torch.as_tensor(np.stack([delta, sizes]), device=device)  # one host copy
    shift = torch.repeat_interleave(delta_t, sizes_t, output_size=total)
    return shift + torch.arange(total, device=device)


def repeated(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64: ``values[i]`` repeated ``counts[i]`` times, in order (host arrays)."""
    return np.repeat(np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64))


def repeated_on(values: np.ndarray, counts: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 on ``device``: ``values[i]`` repeated ``counts[i]`` times, in order. With the GPU's choices
    a host copy of each and a repeat on the device; on the CPU in numpy, wrapped without a copy."""
    values, counts = np.ravel(values), np.ravel(counts)
    if not gpu_paths(device):
        return torch.from_numpy(repeated(values, counts))
    v, c = torch.as_tensor(values, device=device), torch.as_tensor(counts, device=device)
    return torch.repeat_interleave(v, c, output_size=int(counts.sum()))


def repeated_columns(values: np.ndarray, counts: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64[k, sum(counts)] on ``device``: column ``i`` of ``values`` (int64[k, n]) repeated ``counts[i]``
    times, in order. With the GPU's choices one host copy of both and one repeat on the device; on the
    CPU in numpy, wrapped without a copy."""
    values, counts = np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    if not gpu_paths(device):
        return torch.from_numpy(np.repeat(values, counts, axis=1))
    host = torch.as_tensor(np.vstack([values, counts[None, :]]), device=device)  # one host copy
    k = values.shape[0]
    return torch.repeat_interleave(host[:k], host[k], dim=1, output_size=int(counts.sum()))
