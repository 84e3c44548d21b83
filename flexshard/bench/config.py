"""``flexshard bench`` options: the parser's flags, the run's :class:`BenchConfig`, the checks made before
any rank starts (one line naming the flag and its value, exit status 2)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from core.errors import ConfigError
from core.osutil import physical_memory_bytes
from flexshard.cli_common import add_objective, positive_float, positive_int
from solvers.time_types import LocalRates

PLAN_FOR = ("probed", "h100")
RATES_CHOICES = ("measured", "stored")  # or a rates file
DEFAULT_NPROC = 4
RANK_BASE_BYTES = 0.6 * 2**30  # one rank with torch, gloo and TorchRec loaded (peak RSS 586 MB measured at
# 4 ranks, batch 128, the default tables: those are a few MB per rank, so this is the process itself)
ROUTING_BYTES_PER_ROW = 9  # the runtime's exact routing arrays, per row, per rank and strategy
MEMORY_SHARE = 0.85  # of physical memory the ranks may plan to use together
STRATEGIES_HELD = 4  # models every rank holds at once (three plans on FlexShard's runtime + TorchRec)


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


@dataclass
class BenchConfig:
    """One benchmark run (the flags of ``flexshard bench``; times in seconds)."""

    nproc: int = DEFAULT_NPROC
    groups: int = 2
    steps: int = 10
    rounds: int = 3
    warmup: int = 3
    settle: int = 20  # at most this many warm-up passes more, until the host heaps stop growing
    gc: bool = True  # Python's automatic garbage collection off in the rounds, one before each block
    batch: int = 128
    workload: str = "default"
    plan_for: str = "probed"
    budget: float = 2.0
    objective: str = "step"  # what FlexShard's planner minimises: step time or bytes
    gpu_host: str = "fused"  # --plan-for h100: the GPU host work the plans price (fused or measured)
    rates: str = "measured"  # the local rates the predictions use: measured, stored or a rates file
    seed: int = 0
    threads: int = 1
    lr: float = 0.01
    timeout_s: float = 1200.0
    torchrec: bool = True
    log_level: str = "info"

    @property
    def group_size(self) -> int:
        return self.nproc // self.groups

    @property
    def timed_steps(self) -> int:
        return self.rounds * self.steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``flexshard bench``."""
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help=f"local ranks to spawn (default {DEFAULT_NPROC}; under torchrun: its ranks, WORLD_SIZE)",
    )
    p.add_argument(
        "--groups", type=positive_int, default=2, help="emulated groups of consecutive ranks (default 2)"
    )
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per round (default 10)")
    p.add_argument(
        "--rounds", type=positive_int, default=3, help="rounds; each runs every strategy in turn (default 3)"
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=3,
        help="untimed steps per strategy before the rounds, and (when not 0) one before each timed block "
        "(default 3)",
    )
    p.add_argument(
        "--settle",
        type=non_negative_int,
        default=20,
        help="after the warm-up, at most this many passes of one untimed step per strategy more, until no "
        "rank's peak resident memory grew in a pass (its heap has settled; 0: none; default 20)",
    )
    p.add_argument(
        "--auto-gc",
        action="store_true",
        help="leave Python's automatic garbage collection on in the rounds (it then pauses inside timed "
        "steps at random); by default it is off there, with a collection before each timed block",
    )
    p.add_argument("--batch", type=positive_int, default=128, help="samples per rank per step (default 128)")
    p.add_argument(
        "--workload",
        default="default",
        help="'default' (three 64-dim tables of 10^4-10^5 rows, 50-100 ids per sample) or a stats file "
        "(.npz from `flexshard stats`)",
    )
    p.add_argument(
        "--plan-for",
        default="probed",
        metavar="probed|h100|TOPOLOGY.json",
        help="plan for this machine as a quick probe of the ranks measures it (probed), for the H100 "
        "preset shape of the same ranks and groups (h100), or for a topology file of as many ranks in as "
        "many groups (e.g. `flexshard probe --out`: the same plan run after run) (default probed)",
    )
    p.add_argument(
        "--budget",
        type=positive_float,
        default=2.0,
        help="FlexShard's memory per rank, a multiple of row-wise sharding's (default 2)",
    )
    add_objective(p, pipeline=False)  # the bench's steps are not pipelined
    p.add_argument(
        "--rates",
        default="measured",
        metavar="measured|stored|RATES.json",
        help="the local-work rates the time model's predictions use: measured on the ranks at the run's "
        "sizes before the rounds (measured, about a second), the figures stored in the code for this "
        "project's CPU machine (stored), or a file `experiments/calibrate_local.py --out` wrote "
        "(default measured)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the batches and the tables' ids (default 0)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--timeout", type=positive_float, default=1200.0, help="seconds the whole run may take (default 1200)"
    )
    p.add_argument("--no-torchrec", action="store_true", help="leave TorchRec's row-wise out")
    p.add_argument("--json", action="store_true", help="print a JSON list of records instead of the table")


def config_from_args(args: argparse.Namespace, launched_world: int | None) -> BenchConfig:
    """The run's config; ``launched_world``: WORLD_SIZE under a launcher, else None. Checks the flags
    together (:func:`check`)."""
    if launched_world is not None and args.nproc is not None and args.nproc != launched_world:
        raise ConfigError(f"--nproc {args.nproc}: differs from the launcher's WORLD_SIZE {launched_world}")
    cfg = BenchConfig(
        nproc=launched_world or args.nproc or DEFAULT_NPROC,
        groups=args.groups,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        settle=args.settle,
        gc=not args.auto_gc,
        batch=args.batch,
        workload=args.workload,
        plan_for=args.plan_for,
        budget=args.budget,
        objective=args.objective,
        gpu_host=args.gpu_host,
        rates=args.rates,
        seed=args.seed,
        threads=args.threads,
        timeout_s=args.timeout,
        torchrec=not args.no_torchrec,
        log_level=getattr(args, "log_level", None) or "info",
    )
    check(cfg, local=launched_world is None)
    return cfg


def check(cfg: BenchConfig, local: bool = True) -> None:
    """ConfigError (one line, naming the flag and its value) for a config no run can have."""
    for flag, value in (("--nproc", cfg.nproc), ("--groups", cfg.groups), ("--batch", cfg.batch)):
        if value <= 0:
            raise ConfigError(f"{flag}: must be positive, got {value}")
    for flag, value in (("--steps", cfg.steps), ("--rounds", cfg.rounds)):
        if value <= 0:
            raise ConfigError(f"{flag}: must be positive, got {value}")
    if cfg.warmup < 0:
        raise ConfigError(f"--warmup: must be >= 0, got {cfg.warmup}")
    if cfg.settle < 0:
        raise ConfigError(f"--settle: must be >= 0, got {cfg.settle}")
    if cfg.nproc % cfg.groups:
        raise ConfigError(f"--groups {cfg.groups}: does not divide --nproc {cfg.nproc} into equal groups")
    if cfg.plan_for not in PLAN_FOR and not os.path.isfile(cfg.plan_for):
        raise ConfigError(
            f"--plan-for: expected {', '.join(PLAN_FOR)} or a topology JSON file, got {cfg.plan_for!r}"
        )
    if cfg.workload != "default" and not os.path.isfile(cfg.workload):
        raise ConfigError(f"--workload: no such stats file {cfg.workload!r} (or 'default')")
    if cfg.rates not in RATES_CHOICES:
        try:  # a rates file: read it now (one line), not on every rank later
            LocalRates.load(cfg.rates)
        except ConfigError as e:
            raise ConfigError(f"--rates: expected {', '.join(RATES_CHOICES)} or a rates file; {e}") from None


def rank_bytes(table_bytes: float, rows: int, nproc: int, budget: float, batch_bytes: float) -> float:
    """Memory one local rank needs, B: the process (:data:`RANK_BASE_BYTES`), every strategy's rows and
    optimizer state (FlexShard at ``budget`` x row-wise's ``table_bytes / nproc``, the others at 1x), the
    routing arrays (``ROUTING_BYTES_PER_ROW`` per row and strategy) and ``batch_bytes`` per strategy."""
    shards = table_bytes / nproc * (budget + STRATEGIES_HELD - 1)
    return RANK_BASE_BYTES + shards + STRATEGIES_HELD * (ROUTING_BYTES_PER_ROW * rows + batch_bytes)


def check_memory(cfg: BenchConfig, table_bytes: float, rows: int, batch_bytes: float) -> None:
    """ConfigError naming ``--nproc`` when the local ranks together need more than ``MEMORY_SHARE`` of this
    machine's physical memory."""
    have = physical_memory_bytes()
    if have is None:
        return
    need = cfg.nproc * rank_bytes(table_bytes, rows, cfg.nproc, cfg.budget, batch_bytes)
    if need > MEMORY_SHARE * have:
        fit = int(MEMORY_SHARE * have // rank_bytes(table_bytes, rows, cfg.nproc, cfg.budget, batch_bytes))
        raise ConfigError(
            f"--nproc {cfg.nproc}: {cfg.nproc} local ranks need about {need / 2**30:.1f} GiB, over "
            f"{MEMORY_SHARE:.0%} of this machine's {have / 2**30:.1f} GiB; use at most about {max(fit, 1)} "
            "ranks, a smaller --batch or --workload"
        )
