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
``flexshard train: error: ...`` line). Anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch.distributed as dist

from core.errors import InputError
from flexshard.cli_common import first_line
from flexshard.training.config import parse_args
from flexshard.training.distributed import init_distributed
from flexshard.training.loop import run
from flexshard.training.verify import VerifyError


def main(argv: Sequence[str] | None = None) -> int:
    created = False
    try:
        config = parse_args(argv)
        created, _device = init_distributed()
        return run(config)
    except VerifyError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    except InputError as e:
        print(f"flexshard train: error: {first_line(e)}", file=sys.stderr, flush=True)
        return 2
    finally:
        sys.stdout.flush()
        if created and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
