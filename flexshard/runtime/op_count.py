"""Counting the aten ops a process dispatches (:class:`OpCount`): the runtime's host work on a GPU is its
op count times the host time per op (``solvers.time_types.H100_RUNTIME_RATES``), so the step
benchmarks count them (``experiments/gpu_host_ops.py``, ``experiments/local_path_gpu.py``). Beside
:mod:`~flexshard.runtime.collective_count`, which counts the collectives."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while active (``with OpCount() as c:``; ``c.ops``): every op of
    the thread that entered it, views and the autograd backward's included, each passed through."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))
