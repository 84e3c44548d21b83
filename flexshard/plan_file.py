"""The plan file: one JSON document a training job loads to shard its tables.

Per table it holds the tier boundaries in hotness rank (the first ``hot_rows`` rows of the
table's hotness order are hot, the next ``warm_rows`` warm, the rest cold) and a compact owner
map: each rank's share of the cold rows and each group position's share of the warm rows. Rows are
dealt to owners by :func:`solvers.placement.interleave_pattern` over ``owner_pattern_period``
rows, so the file never lists rows. It also records the fingerprints of the workload statistics
and topology it was made from, and the predicted per-iteration metrics.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from solvers.types import CostReport, Plan, PlannerError, TablePlan, Workload
from topology.io import atomic_open
from topology.views import ClusterView

SCHEMA = "flexshard-plan/1"
OWNER_PATTERN_PERIOD = 4096  # rows per repetition of the weighted owner interleave


@dataclass
class PlanFile:
    plan: Plan
    world_size: int
    groups: list[list[int]]
    fingerprints: dict[str, str]
    predicted: dict[str, Any]
    owner_pattern_period: int = OWNER_PATTERN_PERIOD


def view_fingerprint(view: ClusterView) -> str:
    """sha256 over the ranks' groups, link speeds and latencies."""
    h = hashlib.sha256()
    for arr in (
        view.group_of_rank,
        view.intra_bw_Bps,
        view.inter_bw_Bps,
        view.intra_latency_s,
        view.inter_latency_s,
    ):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def predicted_metrics(report: CostReport) -> dict[str, Any]:
    return {
        "inter_group_bytes": report.inter_group_bytes,
        "intra_group_bytes": report.intra_group_bytes,
        "sync_bytes": report.sync_bytes,
        "modeled_time_s": report.modeled_time_s,
        "memory_per_gpu_bytes": report.memory_per_gpu_bytes,
        "per_rank_time_s": report.time_s.tolist(),
        "per_rank_memory_bytes": report.memory_bytes.tolist(),
    }


def to_dict(
    plan: Plan, workload: Workload, view: ClusterView, report: CostReport, workload_fingerprint: str
) -> dict[str, Any]:
    tables = []
    for t, tp in zip(workload.tables, plan.tables, strict=True):
        first_group = list(view.groups[0])
        tables.append(
            {
                "name": t.name,
                "num_rows": t.num_rows,
                "dim": t.dim,
                "element_bytes": t.element_bytes,
                "optimizer_bytes_per_row": t.optimizer_bytes_per_row,
                "hot_rows": tp.hot_rows,
                "warm_rows": tp.warm_rows,
                "cold_rows": tp.cold_rows,
                "warm_share_by_position": [float(x) for x in tp.warm_share[first_group]],
                "cold_share": [float(x) for x in tp.cold_share],
            }
        )
    return {
        "schema": SCHEMA,
        "strategy": plan.strategy,
        "dedup": plan.dedup,
        "sync": plan.sync,
        "budget_bytes": plan.budget_bytes,
        "world_size": view.num_ranks,
        "groups": [list(g) for g in view.groups],
        "owner_pattern_period": OWNER_PATTERN_PERIOD,
        "fingerprints": {"workload": workload_fingerprint, "topology": view_fingerprint(view)},
        "solver": plan.solver,
        "predicted": predicted_metrics(report),
        "tables": tables,
    }


def write_plan(path: str | os.PathLike, document: dict[str, Any]) -> None:
    """Write atomically (:func:`topology.io.atomic_open`), so no partial file is left."""
    text = json.dumps(document, indent=1)
    with atomic_open(path) as f:
        f.write(text + "\n")


def read_plan(path: str | os.PathLike) -> PlanFile:
    """Load and validate a plan file; PlannerError names the field at fault."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise PlannerError(f"plan file {str(path)!r}: cannot read ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise PlannerError(
            f"plan file {str(path)!r}: malformed JSON at line {e.lineno} column {e.colno}"
        ) from e
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise PlannerError(f"plan file {str(path)!r}: schema must be {SCHEMA!r}, got {got!r}")
    try:
        groups = [[int(r) for r in g] for g in doc["groups"]]
        world = int(doc["world_size"])
        group_of = np.empty(world, dtype=np.int64)
        for k, members in enumerate(groups):
            group_of[members] = k
        position = np.empty(world, dtype=np.int64)
        for members in groups:
            position[members] = np.arange(len(members))
        tables = []
        for i, t in enumerate(doc["tables"]):
            warm = np.asarray(t["warm_share_by_position"], dtype=np.float64)
            cold = np.asarray(t["cold_share"], dtype=np.float64)
            if cold.shape != (world,):
                raise PlannerError(
                    f"plan file: tables[{i}].cold_share has {cold.size} entries, world_size is {world}"
                )
            hot_rows, warm_rows, cold_rows = int(t["hot_rows"]), int(t["warm_rows"]), int(t["cold_rows"])
            if min(hot_rows, warm_rows, cold_rows) < 0 or hot_rows + warm_rows + cold_rows != int(
                t["num_rows"]
            ):
                raise PlannerError(f"plan file: tables[{i}] ({t['name']!r}) tiers do not add up to num_rows")
            tables.append(TablePlan(str(t["name"]), hot_rows, warm_rows, cold_rows, warm[position], cold))
        plan = Plan(
            strategy=str(doc["strategy"]),
            tables=tuple(tables),
            dedup=bool(doc["dedup"]),
            sync=str(doc["sync"]),
            budget_bytes=doc.get("budget_bytes"),
            solver=dict(doc.get("solver", {})),
        )
        period = int(doc.get("owner_pattern_period", OWNER_PATTERN_PERIOD))
        if period <= 0:
            raise PlannerError(
                f"plan file {str(path)!r}: owner_pattern_period must be positive, got {period}"
            )
        return PlanFile(plan, world, groups, dict(doc["fingerprints"]), dict(doc["predicted"]), period)
    except KeyError as e:
        raise PlannerError(f"plan file {str(path)!r}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError, IndexError) as e:
        if isinstance(e, PlannerError):
            raise
        raise PlannerError(f"plan file {str(path)!r}: malformed content ({e})") from e
