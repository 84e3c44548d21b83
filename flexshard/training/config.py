"""The training run's configuration: one typed dataclass whose fields are the command-line flags.

``TrainConfig`` reads like the launch command: every field is a ``--flag`` of ``flexshard train`` (its
name with dashes), with its default and help text in the field's metadata. :func:`parse_args` builds the
parser from the fields and checks the values, so the loop never sees an argparse Namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import ConfigError
from core.vocabulary import SamplePlacement, SyncMode, WireDtype
from flexshard.cli_common import Parser
from flexshard.logs import DEFAULT_LOG_LEVEL, LOG_LEVEL_HELP, LOG_LEVELS
from flexshard.model import OBJECTIVES
from flexshard.runtime import LAYOUTS, OPTIMIZER_CHOICES
from flexshard.runtime.optimizers import canonical
from flexshard.training.distributed import DEFAULT_TIMEOUT_S
from flexshard.workloads import DEFAULT_BATCH_SIZE_PER_GPU, DEFAULT_NEGATIVES, DEFAULT_WINDOW
from solvers.planner import STRATEGIES

PIPELINE_MODES = ("on", "off")  # --pipeline (flexshard.training.pipeline)

DEFAULT_DIM = 16  # embedding dim when neither --dim nor a --plan says (small: CPU runs)
MAX_SEED = 2**32 - 1  # seeds are 32-bit: numpy's legacy range, and torch.manual_seed's without wrapping


def _flag(help: str, **argparse_kwargs: Any) -> dict:  # noqa: A002
    return {"help": help, "argparse": argparse_kwargs}


@dataclass(frozen=True)
class TrainConfig:
    """``flexshard train`` / ``torchrun -m flexshard.train`` options (see ``--help``)."""

    data: str | None = field(
        default=None,
        metadata=_flag(
            "a file of user histories: 'user item ...' lines, CSV/TSV with a header, RecBole .inter or "
            "Parquet (default: embedded synthetic data)"
        ),
    )
    vocab: str | None = field(
        default=None,
        metadata=_flag(
            "the stats file whose vocabulary maps --data's string ids to rows (default: built from --data "
            "in first-seen order, as flexshard stats builds it)"
        ),
    )
    user_col: str | None = field(
        default=None, metadata=_flag("--data's user column (default: by its header)")
    )
    item_col: str | None = field(
        default=None, metadata=_flag("--data's item column (default: by its header)")
    )
    time_col: str | None = field(
        default=None, metadata=_flag("--data's time column (default: by its header)")
    )
    count_col: str | None = field(
        default=None, metadata=_flag("--data's count column (default: by its header)")
    )
    plan: str | None = field(default=None, metadata=_flag("a plan file (default: plan on the fly)"))
    strategy: str | None = field(
        default=None,
        metadata=_flag(
            "strategy when planning on the fly (default flexshard; not with --plan)", choices=STRATEGIES
        ),
    )
    groups: int | None = field(
        default=None,
        metadata=_flag("emulated NVLink groups of consecutive ranks (default: the plan's, or 1)"),
    )
    budget: float = field(default=2.0, metadata=_flag("per-GPU budget when planning, a multiple of row-wise"))
    steps: int = field(default=20, metadata=_flag("total training steps"))
    batch_size: int | None = field(
        default=None,
        metadata=_flag(f"samples per rank and step (default: the plan's, else {DEFAULT_BATCH_SIZE_PER_GPU})"),
    )
    lr: float = field(default=0.05, metadata=_flag("learning rate, embeddings and dense"))
    optimizer: str = field(
        default="rowwise_adagrad",
        metadata=_flag(
            "embedding row optimizer, fbgemm's arithmetic: sgd (EXACT_SGD), rowwise_adagrad "
            "(EXACT_ROWWISE_ADAGRAD; 'adagrad' is its older name), elementwise_adagrad (EXACT_ADAGRAD), adam "
            "(ADAM, betas 0.9 and 0.999, eps 1e-8); the dense model takes torch's SGD, Adagrad or Adam",
            choices=OPTIMIZER_CHOICES,
        ),
    )
    dedup: bool | None = field(
        default=None,
        metadata=_flag(
            "dedup ids per rank (default: the plan's, else on)", action=argparse.BooleanOptionalAction
        ),
    )
    sync: str | None = field(
        default=None,
        metadata=_flag(
            "replica gradient sync (default: the plan's, else sparse)", choices=[m.value for m in SyncMode]
        ),
    )
    wire_dtype: str | None = field(
        default=None,
        metadata=_flag(
            "embeddings and gradients on the all-to-alls and the replica sync (default: the plan's, else "
            "fp32); rows and optimizer state stay float32",
            choices=[w.value for w in WireDtype],
        ),
    )
    sample_placement: str = field(
        default="off",
        metadata=_flag(
            "which rank trains on which sample of each global batch: off, regroup (samples sharing cold "
            "rows meet in a group) or owner (samples go to the group owning their cold rows)",
            choices=[m.value for m in SamplePlacement],
        ),
    )
    pipeline: str = field(
        default="on",
        metadata=_flag(
            "pipelined step (default on): the next batch's id exchange runs during this step's dense "
            "forward, backward and replica sync, on a second process group; the same results bit for bit",
            choices=PIPELINE_MODES,
        ),
    )
    gc_every: int = field(
        default=50,
        metadata=_flag(
            "Python's garbage collector: off while the steps run, its young generations collected every N "
            "steps on every rank at once (as torchtitan does; default 50); 0: Python's automatic "
            "collection, which pauses at random inside steps"
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=_flag(
            "torch's deterministic algorithms (torch.use_deterministic_algorithms; on CUDA also "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8): on a GPU, two runs then give the same losses and rows bit "
            "for bit (CUDA's atomic adds otherwise sum a row's gradients in any order); slower where an "
            "op's deterministic form is",
            action="store_true",
        ),
    )
    override_plan: bool = field(
        default=False,
        metadata=_flag(
            "let --dedup/--sync/--wire-dtype/--batch-size differ from the plan's settings (logged; the "
            "plan's predicted bytes then do not apply)",
            action="store_true",
        ),
    )
    seed: int = field(
        default=0,
        metadata=_flag(f"seed of the initial rows, the dense model and the batches (0..{MAX_SEED})"),
    )
    dim: int | None = field(
        default=None,
        metadata=_flag(f"embedding dim of every table (default: the --plan's, else {DEFAULT_DIM})"),
    )
    max_len: int = field(default=DEFAULT_WINDOW, metadata=_flag("history positions kept"))
    negatives: int = field(default=DEFAULT_NEGATIVES, metadata=_flag("random negatives per sample"))
    objective: str = field(default="next-item", metadata=_flag("training objective", choices=OBJECTIVES))
    verify: bool = field(
        default=False,
        metadata=_flag(
            "compare every step with an unsharded reference (exit 1 on mismatch)", action="store_true"
        ),
    )
    checkpoint_dir: str | None = field(
        default=None, metadata=_flag("folder of sharded checkpoints (default: none, no checkpoints)")
    )
    checkpoint_every: int = field(default=0, metadata=_flag("save every N steps (0: at the end only)"))
    resume: bool = field(
        default=False,
        metadata=_flag("resume from the latest checkpoint in --checkpoint-dir", action="store_true"),
    )
    overwrite: bool = field(
        default=False,
        metadata=_flag(
            "a fresh run may replace the checkpoints of another run in --checkpoint-dir (removed first)",
            action="store_true",
        ),
    )
    keep: int = field(default=0, metadata=_flag("keep the newest N checkpoints (0: keep all)"))
    layout: str = field(
        default="exact",
        metadata=_flag("routing layout: per-row arrays, or compact for very large tables", choices=LAYOUTS),
    )
    timeout: float = field(
        default=DEFAULT_TIMEOUT_S,
        metadata=_flag("seconds a collective waits for the other ranks before the run stops with an error"),
    )
    quiet: bool = field(
        default=False,
        metadata=_flag(
            "no per-step lines: --log-level warning (the end-of-run summary still prints)",
            action="store_true",
        ),
    )
    log_level: str = field(default=DEFAULT_LOG_LEVEL, metadata=_flag(LOG_LEVEL_HELP, choices=LOG_LEVELS))
    metrics_out: str | None = field(
        default=None,
        metadata=_flag("rank 0 writes per-step loss and bytes here (JSON Lines; default: none)"),
    )

    def __post_init__(self) -> None:
        for name in ("steps", "max_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')}: must be positive, got {getattr(self, name)}")
        for name in ("batch_size", "groups", "dim"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')}: must be positive, got {getattr(self, name)}")
        if self.negatives < 1:  # the target alone: sampled softmax over one candidate has loss 0
            raise ConfigError(
                f"--negatives: must be at least 1 (the loss compares the target with its negatives), "
                f"got {self.negatives}"
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"--seed: must be an integer in [0, {MAX_SEED}], got {self.seed}")
        for name in ("checkpoint_every", "keep", "gc_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "budget", "timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"--{name}: must be a finite number > 0, got {getattr(self, name)}")
        if (self.resume or self.checkpoint_every or self.overwrite or self.keep) and not self.checkpoint_dir:
            raise ConfigError("--resume, --checkpoint-every, --overwrite and --keep need --checkpoint-dir")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite are exclusive (continue the run, or replace it)")
        if self.plan and self.strategy is not None:
            raise ConfigError("--strategy and --plan are exclusive (--strategy plans on the fly)")
        if self.vocab and not self.data:
            raise ConfigError("--vocab needs --data (it maps the string ids of a data file)")
        if (self.user_col or self.item_col or self.time_col or self.count_col) and not self.data:
            raise ConfigError("--user-col/--item-col/--time-col/--count-col need --data")
        try:
            object.__setattr__(self, "optimizer", canonical(self.optimizer))  # 'adagrad' -> 'rowwise_adagrad'
        except ConfigError as e:
            raise ConfigError(f"--{e}") from None
        if self.override_plan and not self.plan:
            raise ConfigError("--override-plan needs --plan (without a plan there is nothing to override)")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def inputs(self) -> list[tuple[str, str | None]]:
        """The files the run reads, as ``(flag, path)``: no output may be one of them
        (:func:`core.osutil.check_writable`)."""
        return [("--data", self.data), ("--plan", self.plan)]


def build_parser() -> argparse.ArgumentParser:
    """The ``flexshard train`` parser, one option per :class:`TrainConfig` field."""
    p = Parser(
        raises=True,
        prog="flexshard train",
        description="Train a sequence model with its embedding tables sharded by a FlexShard plan.",
    )
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(TrainConfig):
        kwargs = dict(f.metadata["argparse"])
        if "action" not in kwargs:
            kwargs["type"] = types[str(f.type).split(" ")[0]]
        default = f"default {f.default}" if f.default is not None and kwargs.get("action") is None else ""
        help_text = f.metadata["help"] + (
            f" ({default})" if default and "default" not in f.metadata["help"] else ""
        )
        p.add_argument(f"--{f.name.replace('_', '-')}", default=f.default, help=help_text, **kwargs)
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """A checked :class:`TrainConfig` from command-line arguments (``--help`` exits as argparse does;
    usage errors and bad values raise :class:`~core.errors.ConfigError`)."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))
