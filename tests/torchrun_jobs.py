"""torchrun jobs for the tests (``python -m torch.distributed.run ...`` in a subprocess)."""

from __future__ import annotations

import subprocess
from typing import Any

from flexshard.runtime.local import never_started


def run_torchrun(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, **kwargs)``, run once more where the first
    job never started (:func:`flexshard.runtime.local.never_started`: its rendezvous port was taken, or gloo's
    mesh between the ranks failed to form in ``init_process_group``, a loopback start-up flake); a job that
    started and failed is returned as it is."""
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if done.returncode != 0 and never_started(done.stderr):
        done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    return done
