"""Row initialisation without a full table: a rank builds exactly the rows it holds, the same everywhere."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch

Initializer = Callable[[str, np.ndarray, int], torch.Tensor]  # (table, row ids int64[n], dim) -> [n, dim]
_INIT_CHUNK_VALUES = 1 << 22  # values per chunk of the seeded initializer: 32 MiB of uint64 scratch


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array, in place (wrapping arithmetic)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def seeded_initializer(seed: int, scale: float = 0.1) -> Initializer:
    """Row initializer: element ``(id, j)`` of table ``name`` is ``U(-scale, scale)`` from a counter-based
    hash of ``(seed, name, id * dim + j)``. Any process asking for any rows gets the same values, so
    each rank builds only the rows it holds (and a test's reference the whole table) with no full
    table anywhere. Vectorised in chunks of ``_INIT_CHUNK_VALUES`` values."""

    def init(name: str, ids: np.ndarray, dim: int) -> torch.Tensor:
        key = np.uint64(
            int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little")
        )
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.size, dim), dtype=np.float32)
        cols = np.arange(dim, dtype=np.uint64)
        step = max(1, _INIT_CHUNK_VALUES // dim)
        for start in range(0, ids.size, step):  # one pass per chunk of rows
            x = ids[start : start + step].astype(np.uint64)[:, None] * np.uint64(dim) + cols
            x *= np.uint64(0x9E3779B97F4A7C15)
            x ^= key
            u = (_mix64(x) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1)
            out[start : start + step] = (u * 2 - 1) * scale
        return torch.from_numpy(out)

    return init
