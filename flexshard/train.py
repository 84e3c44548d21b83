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
another rank stopped, died or did not arrive within ``--timeout``), 130 Ctrl-C (one ``flexshard
train: interrupted at step N; last checkpoint: ...`` line from rank 0;
:mod:`flexshard.training.interrupt`). Anything else is a bug and shows its traceback. An error every
rank raised alike (agreed across the ranks, or from the same flags) is printed by rank 0 only, so a
torchrun job logs it once; every worker still exits with the status. torchrun itself then exits 1 and
prints its summary of the failed workers (it does not pass the workers' status on).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from core.errors import CollectiveError, InputError, agreed, is_agreed
from flexshard import logs
from flexshard.cli_common import first_line, run_program
from flexshard.training.config import TrainConfig, parse_args
from flexshard.training.distributed import Phase, init_distributed
from flexshard.training.interrupt import INTERRUPTED_STATUS, SigintWatch, interrupted_line
from flexshard.training.loop import run
from flexshard.training.verify import VerifyError

_AGENT_STOP_WAIT_S = 30.0  # how long a failed torchrun worker waits for its agent to stop it


def main(argv: Sequence[str] | None = None) -> int:
    """``flexshard train``'s exit status (a launcher's worker run as the program, ``python -m
    flexshard.train``, ends the process with it: :func:`flexshard.cli_common.run_program`)."""
    return run_program(_main, argv)


def _main(argv: list[str]) -> int:
    created, config, phase, watch = False, None, None, SigintWatch()
    with watch.watching():
        try:
            try:
                config = parse_args(argv)
            except InputError as e:  # the same flags on every rank: the same error
                raise agreed(e) from None
            logs.configure(logs.effective_level(config.log_level, config.quiet))
            created, _device = init_distributed(config.timeout)
            phase = Phase(dist.get_rank(), config.timeout)
            return run(config, phase)
        except KeyboardInterrupt:
            return _interrupted(config, phase)
        except Exception as e:  # after a Ctrl-C, a peer's failure is that Ctrl-C too
            if watch.seen:
                return _interrupted(config, phase)
            if isinstance(e, VerifyError):
                return _fail(e, str(e), 1)
            if isinstance(e, CollectiveError):
                return _fail(e, f"flexshard train: error: {first_line(e)}", 3)
            if isinstance(e, InputError):
                return _fail(e, f"flexshard train: error: {first_line(e)}", 2)
            raise
        finally:
            sys.stdout.flush()
            if created and dist.is_initialized():
                dist.destroy_process_group()


def _interrupted(config: TrainConfig | None, phase: Phase | None) -> int:
    """Ctrl-C: rank 0 prints the one line of :func:`interrupted_line`; every rank returns 130."""
    if _rank() == 0:
        line = interrupted_line(phase.step if phase else 0, config.checkpoint_dir if config else None)
        print(line, file=sys.stderr, flush=True)
    return INTERRUPTED_STATUS


def _fail(err: BaseException, line: str, status: int) -> int:
    """Report ``err`` as ``line`` on stderr and return the exit ``status``.

    An error every rank raised alike is printed by rank 0 only, and every rank leaves only after rank 0
    has printed it (a barrier). Under torchrun the first worker to exit makes the agent SIGTERM the
    others; so there, after such an error, each host's local rank 0 exits first and the other workers
    wait for that SIGTERM and exit with ``status`` too: torchrun's summary then shows every worker's own
    status, never the signal (a SIGTERM after the error no longer ends the worker by the signal).
    """
    stopped = threading.Event()
    with contextlib.suppress(ValueError):  # not the main thread: the default handler stays
        signal.signal(signal.SIGTERM, lambda _signum, _frame: stopped.set())
    if not is_agreed(err) or _rank() == 0:
        print(line, file=sys.stderr, flush=True)
    if is_agreed(err):
        _after_rank_0()
        if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("LOCAL_RANK", "0") != "0":
            stopped.wait(_AGENT_STOP_WAIT_S)
    return status


def _after_rank_0(timeout_s: float = 30.0) -> None:
    """Wait up to ``timeout_s`` seconds for every rank of the job (a barrier), making the job's group for
    it when the error came before the group (a flag); without a launcher, or if the group cannot be
    made, return at once."""
    made = False
    if not dist.is_initialized() and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return
    with contextlib.suppress(Exception):  # a failing farewell must not hide the error being reported
        if not dist.is_initialized():
            made, _device = init_distributed(timeout_s)
        if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
        elif dist.get_world_size() > 1:
            dist.barrier()
    if made and dist.is_initialized():
        dist.destroy_process_group()


def _rank() -> int:
    """This process's rank: the process group's, else the launcher's RANK, else 0."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


if __name__ == "__main__":
    sys.exit(main())
