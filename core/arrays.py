"""Array helpers every layer uses (numpy only)."""

from __future__ import annotations

import numpy as np


def exclusive_cumsum(x: np.ndarray | list[int], axis: int | None = None) -> np.ndarray:
    """int64, shaped like ``x``: the sum of the elements before each one, along ``axis``, or over ``x``
    flattened in C order when None: where each block starts when blocks of ``x[i]`` items lie one after
    another (``[3, 1, 2] -> [0, 3, 4]``; for a ``[peer, table]`` array laid table-major, pass ``x.T`` and
    transpose the result)."""
    x = np.asarray(x, dtype=np.int64)
    if axis is None:
        return (np.cumsum(x) - x.reshape(-1)).reshape(x.shape)
    return np.cumsum(x, axis=axis) - x


def block_positions(sizes: np.ndarray | list[int], first: np.ndarray | list[int]) -> np.ndarray:
    """int64[sum(sizes)]: positions ``first[i]`` to ``first[i] + sizes[i] - 1`` of every block ``i``,
    blocks in order (``sizes [2, 0, 3], first [10, 4, 0] -> [10, 11, 0, 1, 2]``): one repeat of each
    block's shift plus one range, no loop per block."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    shift = np.asarray(first, dtype=np.int64).reshape(-1) - exclusive_cumsum(sizes)
    return np.repeat(shift, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)


def block_bounds(counts: np.ndarray | list[int]) -> np.ndarray:
    """int64[n + 1]: where each of ``n`` blocks of ``counts[i]`` items starts when they lie one after
    another, then where the last ends (``[3, 1, 2] -> [0, 3, 4, 6]``): block ``i`` is
    ``[out[i], out[i + 1])`` (a CSR row pointer; ``counts`` flattened in C order)."""
    c = np.asarray(counts, dtype=np.int64).reshape(-1)
    out = np.zeros(c.size + 1, dtype=np.int64)
    np.cumsum(c, out=out[1:])
    return out
