"""``flexshard bench``: time a training step of FlexShard and the baselines on the same batches.

FlexShard, its row-wise ablation, ``row_wise_group_dedup`` and TorchRec's row-wise run on N local ranks
in G emulated groups (or torchrun's ranks).

Prints per strategy the step time (mean and median of the slowest rank), collectives per step, bytes per
link class and the time model's prediction (:mod:`flexshard.bench`). Bad flags: one line, exit status 2;
Ctrl-C: one line, exit status 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

from flexshard.bench import config, results
from flexshard.bench.plans import file_view
from flexshard.bench.worker import INTERRUPTED_LINE, Interrupted, load_data, run_rank, spawn_local
from flexshard.training.interrupt import INTERRUPTED_STATUS, SigintWatch

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``bench`` subcommand's parser."""
    p = sub.add_parser(
        "bench",
        help="time a training step of FlexShard and the baselines on local ranks (or under torchrun)",
        description="Time a training step of FlexShard, its row-wise ablation, row_wise_group_dedup and "
        "TorchRec's row-wise sharding on the same batches.",
    )
    config.add_arguments(p)
    return p


def _memory_check(cfg: config.BenchConfig) -> None:
    """Refuse (one line naming --nproc) a local run whose ranks would not fit this machine's memory."""
    data = load_data(cfg, cfg.nproc)
    tables = data.workload.tables
    table_bytes = float(sum(t.num_rows * t.row_bytes for t in tables))
    rows = sum(t.num_rows for t in tables)
    lookups = cfg.batch * sum(t.ids_per_sample for t in tables)
    batch_bytes = lookups * (8 * 6 + 4 * 2 * float(np.mean([t.dim for t in tables])))
    config.check_memory(cfg, table_bytes, rows, batch_bytes)


def cmd_bench(args: argparse.Namespace) -> int:
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE"))
    cfg = config.config_from_args(args, int(os.environ["WORLD_SIZE"]) if launched else None)
    if cfg.plan_for not in config.PLAN_FOR:  # a topology file: checked before any rank starts
        file_view(cfg.plan_for, cfg.nproc, cfg.groups)
    if launched:
        return _launched(cfg, args.json)
    watch = SigintWatch()
    with watch.watching():
        try:
            _memory_check(cfg)
            recs = spawn_local(cfg)
        except (Interrupted, KeyboardInterrupt):
            print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
            return INTERRUPTED_STATUS
    _print(cfg, recs, args.json, "gloo")
    return 0


def _launched(cfg: config.BenchConfig, as_json: bool) -> int:
    """Under torchrun: this rank runs the benchmark; rank 0 prints."""
    import torch.distributed as dist

    from flexshard.training.distributed import init_distributed

    watch = SigintWatch()
    with watch.watching():
        try:
            created, _device = init_distributed(cfg.timeout_s)
            recs = run_rank(cfg)
            backend = str(dist.get_backend())
        except KeyboardInterrupt:
            if int(os.environ.get("RANK", "0")) == 0:
                print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
            return INTERRUPTED_STATUS
    if recs is not None:
        _print(cfg, recs, as_json, backend)
    if created and dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _print(cfg: config.BenchConfig, recs: list, as_json: bool, backend: str) -> None:
    print(results.to_json(recs) if as_json else results.table(cfg, recs, backend), flush=True)
