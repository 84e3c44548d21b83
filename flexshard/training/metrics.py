"""``--metrics-out``: a JSON Lines record of the run, written by rank 0.

Records: a ``header`` (run config, world, groups, data, the plan's strategy, settings, overrides, tier
sizes per table and the cost model's ``predicted`` metrics), one ``step`` per step (``loss``: the
global mean loss printed on the step line; ``elapsed_s``: the slowest rank's step time in seconds;
``bytes``: this step's bytes per rank per link class, ``max(send, recv)`` summed over components, as
``{"max": ..., "mean": ...}`` over ranks; ``bytes_by_component``: the same per link class and component),
and an ``end`` record (steps run, verify outcome, or the error that ended the run). Records are
appended and flushed as they come (:class:`MetricsLog`): a run that crashes keeps the steps it did. A
fresh run replaces the file; ``--resume`` appends to it, after a new header whose ``start_step`` says
where it took over (steps after the checkpoint it resumed from then appear twice: the later ones count).
Like every output, a symlink at the path is replaced by the file, never written through
(:mod:`core.osutil`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.osutil import replace_for_append
from core.traffic import SHAPE, Traffic
from core.vocabulary import COMPONENTS, LINK_CLASSES, Component, LinkClass
from flexshard.plan_file import PlanFile
from flexshard.training.config import TrainConfig


def header_record(
    config: TrainConfig, world: int, data: str, plan_file: PlanFile, device: torch.device, start: int
) -> dict[str, Any]:
    """The run's configuration and the plan (tiers per table, the cost model's predicted metrics)."""
    plan = plan_file.plan
    return {
        "kind": "header",
        "config": {k: v for k, v in config.as_dict().items() if k != "metrics_out"},
        "world": world,
        "groups": plan_file.groups,
        "backend": dist.get_backend(),
        "device": str(device),
        "data": data,
        "start_step": start,
        "link_classes": list(LINK_CLASSES),
        "components": list(COMPONENTS),
        "plan": {
            "strategy": plan.strategy,
            "dedup": plan.dedup,
            "sync": plan.sync.value,
            "batch_size_per_gpu": plan_file.batch_size_per_gpu,
            "overrides": plan_file.overrides,
            "left_out_tables": list(plan_file.left_out),
            "tables": [
                {
                    "name": t.name,
                    "hot_rows": t.hot_rows,
                    "warm_rows": t.warm_rows,
                    "cold_rows": t.cold_rows,
                    "fetch": t.fetch.value,
                }
                for t in plan.tables
            ],
            "predicted": plan_file.predicted,
        },
    }


def step_record(step: int, loss: float, elapsed_s: float, traffic: Traffic, device: torch.device) -> dict:
    """One step's record (collective: gathers every rank's traffic in bytes and its step time in
    seconds, as float64)."""
    world = dist.get_world_size()
    mine = torch.as_tensor(np.concatenate([[elapsed_s], traffic.bytes.reshape(-1)]), dtype=torch.float64)
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    rows = torch.stack(everyone).cpu().numpy()  # [world, 1 + 16]
    per_rank = Traffic(rows[:, 1:].reshape(world, *SHAPE))

    def stat(x: np.ndarray) -> dict[str, float]:
        return {"max": float(x.max()), "mean": float(x.mean())}

    return {
        "kind": "step",
        "step": step,
        "loss": loss,
        "elapsed_s": float(rows[:, 0].max()),
        "bytes": {link.label: stat(per_rank.link_bytes(link)) for link in LinkClass},
        "bytes_by_component": {
            link.label: {c.label: stat(per_rank.component_bytes(link, c)) for c in Component}
            for link in LinkClass
        },
    }


class MetricsLog:
    """Rank 0's ``--metrics-out`` file, one JSON record a line, each flushed when written (no file and no
    writes elsewhere, or without a path). ``append``: continue an existing file (``--resume``). The path
    follows the output rule of :mod:`core.osutil`: a symlink there is replaced by the file, never
    written through (:func:`~core.osutil.replace_for_append`)."""

    def __init__(self, path: str | Path | None, rank: int, append: bool = False) -> None:
        self.path, self._file = path, None
        if path is not None and rank == 0:
            self._file = replace_for_append(path, keep=append, what="--metrics-out")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
