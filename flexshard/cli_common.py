"""Pieces shared by the command-line entry points: argparse value types, one-line errors, and how a
launcher's worker leaves (:func:`run_program`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from core.errors import ConfigError
from solvers.tier_program import OptimizerConfig
from solvers.time_types import GPU_HOST_WORK


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``<prog>: error: <message> (see <prog>
    --help)``, exit status 2 (argparse prints the whole usage first); its subcommands' parsers too.
    With ``raises`` the error is raised as a :class:`~core.errors.ConfigError` instead (the training
    entry point reports it once for all ranks)."""

    def __init__(self, *args, raises: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.raises = raises

    def error(self, message: str) -> NoReturn:
        if self.raises:
            raise ConfigError(f"{message} (see {self.prog} --help)")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (rejects nan and inf with the value in the message)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


OBJECTIVES = ("step", "bytes")  # what the planner minimises (solvers.tier_program.OptimizerConfig.step_time)


def add_objective(p: argparse.ArgumentParser, pipeline: bool = True) -> None:
    """The ``--objective`` and ``--gpu-host`` flags of every command that plans, and (``pipeline``)
    ``--pipeline``."""
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="step",
        help="what the planner minimises: the modeled step time (collective latency, bytes over bandwidth "
        "and local work; docs/cost_model.md section 10) or bytes over bandwidth alone (default step)",
    )
    p.add_argument(
        "--gpu-host",
        choices=GPU_HOST_WORK,
        default="fused",
        help="on a GPU preset topology, the host work the step time prices: fused (none around the "
        "collectives, as a runtime with fused per-table work would have; the value work at the HBM roofline) "
        "or measured (this runtime's, measured on an H100: about 26 us per torch op; docs/cost_model.md "
        "section 10.2) (default fused)",
    )
    if pipeline:
        p.add_argument(
            "--pipeline",
            choices=("on", "off"),
            default="on",
            help="price the step as `train --pipeline` runs it: on, the replica sync overlaps the next "
            "batch's id exchange (train's default); off, one after the other (default on)",
        )


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """The planner's knobs from ``--objective``, ``--gpu-host`` and ``--pipeline``."""
    return OptimizerConfig(
        step_time=args.objective == "step",
        overlap=getattr(args, "pipeline", "off") == "on",
        gpu_host=args.gpu_host,
    )


INTERRUPTED = 130  # a Ctrl-C's exit status (128 + SIGINT), as flexshard.training.interrupt's


def launched() -> bool:
    """Whether this process is a launcher's worker (torchrun sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_program(main: Callable[[list[str]], int], argv: Sequence[str] | None) -> int:
    """``main(argv)``'s exit status; but as the program's entry (``argv`` None: the console script or
    ``python -m``, arguments from ``sys.argv``) in a launcher's worker, the process ends here with that
    status through :func:`end_process`, after ``main`` has printed its output and written its files.

    Why: a worker that leaves through the interpreter's finalization can be killed by SIGABRT after its
    work ("terminate called without an active exception") when a gloo worker thread still holds tensors
    that Python objects own (pytorch/pytorch#65231; spawned ranks end the same way,
    :func:`flexshard.runtime.local.end_rank`). The status is kept: ``main``'s return value, a
    ``SystemExit``'s code (``None`` 0, a message 1, printed), 130 for a Ctrl-C, 1 with the traceback
    printed for any other exception. ``main`` called with a list (tests, other entry points) returns."""
    if argv is not None or not launched():
        return main(list(sys.argv[1:] if argv is None else argv))
    end_process(_status_of(main, sys.argv[1:]))


def _status_of(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """The exit status the interpreter would give ``sys.exit(main(argv))`` (130 for a Ctrl-C)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        return INTERRUPTED
    except BaseException:  # a bug: its traceback, as the interpreter would print it
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return int(code or 0)
    print(code, file=sys.stderr)  # sys.exit's message
    return 1


def end_process(status: int) -> NoReturn:
    """Flush the log handlers, stdout and stderr, and leave with ``os._exit(status)``: no interpreter
    finalization to race the process group's threads (:func:`run_program`)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing to say
            stream.flush()
    os._exit(status)
