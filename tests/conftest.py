"""Suite-wide settings.

The multi-process tests run 2-8 ranks on one machine over gloo on the CPU; on a machine with fewer GPUs
than ranks, NCCL (the default where CUDA is) would refuse them. The test of the NCCL path asks for NCCL
by name, so it still runs where there is a GPU.

The ranks of ``run_on_ranks`` are forked from one server per session (flexshard.runtime.local), which
imports what most jobs need once: the runtime and, where it is installed, TorchRec's distributed
modules (4 s of imports a rank otherwise).
"""

import os

from flexshard.runtime.local import preload

os.environ.setdefault("FLEXSHARD_BACKEND", "gloo")

preload("flexshard.train")
try:  # only a TorchRec that imports here: a module failing in the server would fail every job
    import torchrec.distributed.embedding  # noqa: F401
    import torchrec.distributed.model_parallel  # noqa: F401

    import flexshard.torchrec  # noqa: F401
except Exception:  # noqa: BLE001, S110  (not installed, or broken: its tests skip or fail on their own)
    pass
else:
    preload("torchrec.distributed.model_parallel", "torchrec.distributed.embedding", "flexshard.torchrec")
