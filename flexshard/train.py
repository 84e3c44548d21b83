"""``flexshard train``: train the sequence recommendation model (:mod:`flexshard.model`) with its
embedding tables sharded by a FlexShard plan.

Run under a launcher (``torchrun --nproc-per-node N -m flexshard.train ...``: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT come from the environment; gloo on CPU, NCCL when CUDA is
available) or as a single process (world size 1). The options are the fields of
:class:`flexshard.training.config.TrainConfig`; the pieces live in :mod:`flexshard.training`:

* ``data``: the embedded synthetic workload, or ``--data`` histories (``user item ...`` files);
* ``planning``: ``--plan`` checked against the run (data, world, tables, settings; ``--override-plan``
  for settings changed on purpose), or a plan made on the fly;
* ``loop``: the steps, ``--checkpoint-dir`` / ``--resume``;
* ``reference``: ``--verify``, an unsharded reference compared every step;
* ``metrics``: ``--metrics-out``, a JSON Lines record of the run.

Exit status: 0 success, 1 verification failure (one ``verify: FAILED ...`` line), 2 bad input (one
``flexshard train: error: ...`` line), 3 a collective failed (one line naming the rank and the phase:
another rank stopped, died or did not arrive within ``--timeout``). Anything else is a bug and shows
its traceback. An error every
rank raised alike (agreed across the ranks, or from the same flags) is printed by rank 0 only, so a
torchrun job logs it once; every worker still exits with the status. torchrun itself then exits 1 and
prints its summary of the failed workers (it does not pass the workers' status on).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch.distributed as dist

from core.errors import CollectiveError, InputError, agreed, is_agreed
from flexshard.cli_common import first_line
from flexshard.training.config import parse_args
from flexshard.training.distributed import init_distributed
from flexshard.training.loop import run
from flexshard.training.verify import VerifyError


def main(argv: Sequence[str] | None = None) -> int:
    created = False
    try:
        try:
            config = parse_args(argv)
        except InputError as e:  # the same flags on every rank: the same error
            raise agreed(e) from None
        created, _device = init_distributed(config.timeout)
        return run(config)
    except VerifyError as e:
        _report(e, str(e))
        return 1
    except CollectiveError as e:
        _report(e, f"flexshard train: error: {first_line(e)}")
        return 3
    except InputError as e:
        _report(e, f"flexshard train: error: {first_line(e)}")
        return 2
    finally:
        sys.stdout.flush()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _report(err: BaseException, line: str) -> None:
    """Print ``line`` on stderr, on rank 0 only when every rank raised the same error (under torchrun the
    job's log then holds it once, not once per rank)."""
    if not is_agreed(err) or _rank() == 0:
        print(line, file=sys.stderr, flush=True)


def _rank() -> int:
    """This process's rank: the process group's, else the launcher's RANK, else 0."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


if __name__ == "__main__":
    sys.exit(main())
