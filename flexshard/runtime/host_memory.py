"""The host allocator of a rank whose step runs on the CPU: keep freed memory for the next step.

glibc's ``malloc`` gives large freed blocks back to the kernel: a block above its mmap threshold (128 KiB,
raised to at most 32 MiB by the sizes freed) is mapped for each allocation and unmapped when freed, and
a freed heap top above twice that threshold is trimmed. A step allocates tensors of similar but not
equal sizes every step (an embedding output is ``lookups x dim`` floats: about 20 MB at batch 1,024 on
the bench's tables), so the new sizes keep passing the threshold and each such tensor is faulted in page
by page as it is first written: on the development machine about 4,800 page faults and 7 ms of a
rank's CPU for one 20 MB tensor, several times a step (``experiments/profile_step.py --ops`` shows the
op that pays; a plain ``mul`` of that size takes 1 ms without the faults).

:func:`keep_freed_memory` sets glibc's ``mallopt`` so that freed memory stays in the process: no block is
mapped apart (``M_MMAP_MAX`` 0, every block from the heap) and the heap is not trimmed
(``M_TRIM_THRESHOLD`` at its largest). The heap grows to the step's high-water mark in the first steps
and is reused from then on; memory is not given back until the process ends, as PyTorch's CUDA caching
allocator keeps device memory, or jemalloc and tcmalloc (which PyTorch's CPU performance guide suggests
preloading) keep host memory. Set ``FLEXSHARD_HOST_MALLOC=system`` to keep glibc's defaults. Elsewhere
than glibc (macOS, musl) nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os

from core.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "FLEXSHARD_HOST_MALLOC"  # "keep" (default) or "system"
M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can set (bytes)

_applied: bool | None = None  # the first call's answer (once per process)


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory in this process (module docstring); once per process. Returns
    whether it is in force: False with ``FLEXSHARD_HOST_MALLOC=system``, without glibc, or where
    ``mallopt`` refuses. Any other value of the variable is a ConfigError naming it."""
    global _applied
    if _applied is not None:
        return _applied
    choice = os.environ.get(ENV, "keep").strip().lower()
    if choice not in ("keep", "system"):
        raise ConfigError(f"{ENV}={os.environ[ENV]!r}: expected 'keep' or 'system'")
    _applied = choice == "keep" and _mallopt_keep()
    return _applied


def _mallopt_keep() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has no such symbol)
    except (OSError, AttributeError):
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
    if not ok:
        log.debug("host memory: glibc refused mallopt; its defaults stay")
    return ok
