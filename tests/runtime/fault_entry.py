"""torchrun entry for ``test_faults.py``: ``fault_entry.py FAULT STEP <flexshard.train flags>`` installs one
fault in rank 1 of the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), then runs ``flexshard.train``.

Faults, each ending with rank 1 killed by SIGKILL at a chosen point:

* ``killed_inside_all_to_all``: after step STEP, rank 1 enters the next all-to-all of the whole world
  and is killed 0.5 s later while it waits inside for rank 0, which enters 1.5 s late.
* ``peer_inside_all_to_all``: after step STEP, rank 0 enters the next all-to-all of the whole world and
  waits inside it for rank 1, which is killed 0.5 s later without entering.
* ``mid_checkpoint``: rank 1 is killed halfway through writing its shard of step STEP's checkpoint (its
  ``.part`` file holds half the bytes; rank 0 has written its shard and waits for rank 1's).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flexshard import checkpoint
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.train import main


def _kill_self(after_s: float = 0.0) -> None:
    if after_s:
        threading.Timer(after_s, _kill_self).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def _at_all_to_all(step: int, rank: int, killed_inside: bool) -> None:
    """From the first whole-world all-to-all after ``step``: the fault described in the module doc."""
    original_step, original_a2a = ShardedSequenceEmbedding.step, dist.all_to_all_single
    armed = {"steps": 0, "on": False}

    def counted_step(self):
        original_step(self)
        armed["steps"] += 1
        armed["on"] = armed["steps"] == step

    def all_to_all_single(*args, **kwargs):
        if armed["on"] and kwargs.get("group") is None:
            armed["on"] = False
            if rank == 1:
                _kill_self(0.5)
                if not killed_inside:
                    time.sleep(60)  # never enters
            elif rank == 0 and killed_inside:
                time.sleep(1.5)
        return original_a2a(*args, **kwargs)

    ShardedSequenceEmbedding.step = counted_step
    dist.all_to_all_single = all_to_all_single


def _mid_checkpoint(step: int, rank: int) -> None:
    original = checkpoint._atomic_torch_save

    def save(obj, path: Path):
        if rank == 1 and path.parent.name == f".tmp-{checkpoint.step_dir('.', step).name}":
            part = path.with_name(path.name + ".part")
            torch.save(obj, part)
            os.truncate(part, part.stat().st_size // 2)
            _kill_self()
        return original(obj, path)

    checkpoint._atomic_torch_save = save


if __name__ == "__main__":
    fault, step, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        rank = int(os.environ["RANK"])
        if fault == "mid_checkpoint":
            _mid_checkpoint(step, rank)
        else:
            _at_all_to_all(step, rank, killed_inside=fault == "killed_inside_all_to_all")
    sys.exit(main(argv))
