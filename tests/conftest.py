"""Suite-wide settings.

The multi-process tests run 2-8 ranks on one machine over gloo on the CPU; on a machine with fewer GPUs
than ranks, NCCL (the default where CUDA is) would refuse them. The test of the NCCL path asks for NCCL
by name, so it still runs where there is a GPU.
"""

import os

os.environ.setdefault("FLEXSHARD_BACKEND", "gloo")
