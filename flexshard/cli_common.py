"""Pieces shared by the command-line entry points: argparse value types, one-line errors."""

from __future__ import annotations

import argparse
from typing import NoReturn

from core.errors import ConfigError
from solvers.tier_program import OptimizerConfig


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
    """The ``--objective`` flag of every command that plans, and (``pipeline``) ``--pipeline``."""
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="step",
        help="what the planner minimises: the modeled step time (collective latency, bytes over bandwidth "
        "and local work; docs/cost_model.md section 10) or bytes over bandwidth alone (default step)",
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
    """The planner's knobs from ``--objective`` and ``--pipeline``."""
    return OptimizerConfig(
        step_time=args.objective == "step", overlap=getattr(args, "pipeline", "off") == "on"
    )
