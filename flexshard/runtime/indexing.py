"""Index helpers of the runtime's hot paths."""

from __future__ import annotations

import numpy as np
import torch


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64: the positions of ``mask``'s non-zero elements, ascending (``torch.nonzero(mask).flatten()``
    of a 1-D tensor). On the CPU by numpy's ``flatnonzero`` over the same memory (a tenth of
    ``torch.nonzero``'s time at 10^4-10^5 elements, one thread); elsewhere ``torch.nonzero``."""
    if mask.device.type != "cpu":
        return torch.nonzero(mask).flatten()
    return torch.from_numpy(np.flatnonzero(mask.contiguous().numpy()).astype(np.int64, copy=False))
