"""The plan file: one JSON document (schema ``flexshard-plan/2``) a training job loads to shard its tables.

Per table it holds the tier boundaries in hotness rank (the first ``hot_rows`` rows of the table's
hotness order are hot, the next ``warm_rows`` warm, the rest cold) and a compact owner map: each
rank's share of the cold rows and each group position's share of the warm rows. Rows are dealt to
owners by :func:`solvers.dealing.owner_pattern` over ``owner_pattern_period`` rows, each tier's hottest
row at its ``warm_start`` / ``cold_start`` position of the pattern, or (``deal: "ranges"``, TorchRec's
row-wise layout) by contiguous id ranges, so the file never lists rows. Files without ``deal`` or the
start positions (written before they existed) read as ``interleave`` from position 0.

The file is a contract (:mod:`flexshard.contract`): it records what the plan was made for and a run
is checked against it. ``settings`` (dedup, sync, wire precision, batch per GPU; files without ``wire``
read as fp32), ``world`` (size and groups), per
table its size, dim, cold fetch mode, the fingerprint of the hotness order the tiers refer to and how
its samples were formed when its touch rates were measured (``touch_rates``; null: independent
draws), and the fingerprints of the workload statistics, the topology and the world. It also carries the
solver's metadata and the cost model's predicted per-iteration metrics.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import ConfigError, DataError
from core.osutil import atomic_open
from core.ranks import RankLayout
from core.vocabulary import Deal, FetchMode, SyncMode, WireDtype
from flexshard.fingerprints import order_fingerprint, topology_fingerprint
from solvers.dealing import OWNER_PATTERN_PERIOD
from solvers.types import CostReport, Plan, TablePlan, Workload
from topology.views import ClusterView

SCHEMA = "flexshard-plan/2"
SHARE_TOLERANCE = 1e-6  # shares must sum to 1 within this


@dataclass(frozen=True)
class PlannedTable:
    """What the plan assumed of one table: its size, its vectors and the hotness order its tiers index."""

    name: str
    num_rows: int
    dim: int
    element_bytes: int
    optimizer_bytes_per_row: int
    order_fingerprint: str
    # how samples were formed where touch rates were measured; None: independent draws
    touch_rates: str | None = None


@dataclass(frozen=True)
class PlanFile:
    """A plan file as loaded: the plan, the world it was made for, and its contract.

    ``overrides`` lists the settings a run changed on purpose (``{"dedup": [made with, run with]}``,
    from :meth:`with_overrides`); the predicted metrics describe the plan as made, not the override.
    ``left_out`` names the plan's tables a run does not look up (:meth:`restricted_to`); the predicted
    metrics price them too.
    """

    plan: Plan
    layout: RankLayout
    batch_size_per_gpu: int
    tables: tuple[PlannedTable, ...]
    fingerprints: dict[str, str]
    predicted: dict[str, Any]
    owner_pattern_period: int = OWNER_PATTERN_PERIOD
    overrides: dict[str, list] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.layout.num_ranks

    @property
    def groups(self) -> list[list[int]]:
        return self.layout.to_lists()

    def table(self, name: str) -> PlannedTable:
        return next(t for t in self.tables if t.name == name)

    def restricted_to(self, names: list[str]) -> PlanFile:
        """The plan for the tables ``names`` only, in that order (a plan made from a whole data set can
        cover tables a model does not use); the others are named in ``left_out``. Names the plan lacks
        are left for the run's check."""
        if not set(names) <= {t.name for t in self.tables} or [t.name for t in self.tables] == names:
            return self
        plans = {tp.name: tp for tp in self.plan.tables}
        metas = {t.name: t for t in self.tables}
        return replace(
            self,
            plan=replace(self.plan, tables=tuple(plans[n] for n in names)),
            tables=tuple(metas[n] for n in names),
            left_out=self.left_out + tuple(t.name for t in self.tables if t.name not in names),
        )

    def with_overrides(
        self,
        dedup: bool | None = None,
        sync: SyncMode | str | None = None,
        batch_size_per_gpu: int | None = None,
        wire: WireDtype | str | None = None,
    ) -> PlanFile:
        """The plan run with other settings, recorded in ``overrides`` (None keeps the plan's)."""
        wanted = {
            "dedup": dedup,
            "sync": None if sync is None else SyncMode.parse(sync),
            "wire": None if wire is None else WireDtype.parse(wire),
        }
        plan, overrides = self.plan, dict(self.overrides)
        for key, value in wanted.items():
            if value is not None and value != getattr(plan, key):
                overrides[key] = [_plain(getattr(plan, key)), _plain(value)]
                plan = replace(plan, **{key: value})
        batch = self.batch_size_per_gpu
        if batch_size_per_gpu is not None and batch_size_per_gpu != batch:
            overrides["batch_size_per_gpu"] = [batch, int(batch_size_per_gpu)]
            batch = int(batch_size_per_gpu)
        return replace(self, plan=plan, batch_size_per_gpu=batch, overrides=overrides)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, (SyncMode, FetchMode, WireDtype)) else value


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
    plan: Plan,
    workload: Workload,
    view: ClusterView,
    report: CostReport,
    workload_fingerprint: str,
    orders: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The plan file document of ``plan``, made for ``workload`` (whose hotness orders are ``orders``;
    a table without one is numbered hottest first) on ``view``."""
    orders = orders or {}
    first_group = list(view.groups[0])
    tables = [
        {
            "name": t.name,
            "num_rows": t.num_rows,
            "dim": t.dim,
            "element_bytes": t.element_bytes,
            "optimizer_bytes_per_row": t.optimizer_bytes_per_row,
            "order_fingerprint": order_fingerprint(orders.get(t.name), t.num_rows),
            "touch_rates": None if t.touch is None else t.touch.sampling,
            "hot_rows": tp.hot_rows,
            "warm_rows": tp.warm_rows,
            "cold_rows": tp.cold_rows,
            "fetch": tp.fetch.value,
            "deal": tp.deal.value,
            "warm_start": tp.warm_start,
            "cold_start": tp.cold_start,
            "warm_share_by_position": [float(x) for x in tp.warm_share[first_group]],
            "cold_share": [float(x) for x in tp.cold_share],
        }
        for t, tp in zip(workload.tables, plan.tables, strict=True)
    ]
    return {
        "schema": SCHEMA,
        "strategy": plan.strategy,
        "settings": {
            "dedup": plan.dedup,
            "sync": plan.sync.value,
            "wire": plan.wire.value,
            "batch_size_per_gpu": workload.batch_size_per_gpu,
        },
        "budget_bytes": plan.budget_bytes,
        "world": {"size": view.num_ranks, "groups": view.layout.to_lists()},
        "owner_pattern_period": OWNER_PATTERN_PERIOD,
        "fingerprints": {
            "workload": workload_fingerprint,
            "topology": topology_fingerprint(view),
            "world": view.layout.fingerprint(),
        },
        "solver": plan.solver,
        "predicted": predicted_metrics(report),
        "tables": tables,
    }


def write_plan(path: str | os.PathLike, document: dict[str, Any]) -> None:
    """Write atomically (:func:`core.osutil.atomic_open`), so no partial file is left. The file is strict
    JSON: a number that is not finite (inf, NaN) is a bug upstream, raised naming its field, never written."""
    bad = _non_finite_field(document)
    if bad is not None:
        raise ValueError(f"plan file: field {bad[0]!r} = {bad[1]!r} is not a finite number; nothing written")
    text = json.dumps(document, indent=1, allow_nan=False)
    with atomic_open(path, what="plan file") as f:
        f.write(text + "\n")


def _non_finite_field(value: Any, where: str = "") -> tuple[str, float] | None:
    """(dotted path, value) of the first float in a JSON-like ``value`` that is inf or NaN, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, value)
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, (list, tuple))
        else ()
    )
    for key, item in items:
        found = _non_finite_field(
            item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip(".")
        )
        if found is not None:
            return found
    return None


def read_plan(path: str | os.PathLike) -> PlanFile:
    """Load and validate a plan file; :class:`~core.errors.DataError` names the field at fault."""
    where = f"plan file {str(path)!r}"
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(f"{where}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise DataError(f"{where}: not a text file (a plan file is JSON from `flexshard plan`)") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON at line {e.lineno} column {e.colno}") from None
    schema = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
    if schema == "flexshard-plan/1":
        raise DataError(
            f"{where}: format flexshard-plan/1 was written by an older FlexShard; re-run `flexshard plan` "
            f"to write a {SCHEMA} file"
        )
    if schema != SCHEMA:
        raise DataError(f"{where}: schema must be {SCHEMA!r}, got {schema!r}")
    try:
        return _parse(doc, where)
    except KeyError as e:
        raise DataError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{where}: malformed content ({e})") from None


def _parse(doc: dict, where: str) -> PlanFile:
    world = doc["world"]
    size = _positive(world["size"], f"{where}: world.size")
    try:
        layout = RankLayout.of(world["groups"], size, what=f"{where}: world.groups")
    except ConfigError as e:
        raise DataError(str(e)) from None
    settings = doc["settings"]
    try:
        sync = SyncMode.parse(settings["sync"])
        wire = WireDtype.parse(settings.get("wire", WireDtype.FP32.value))  # files before it: float32
    except ConfigError as e:
        raise DataError(f"{where}: settings.{e}") from None
    batch = settings["batch_size_per_gpu"]
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise DataError(f"{where}: settings.batch_size_per_gpu must be a positive integer, got {batch!r}")
    period = _positive(
        doc.get("owner_pattern_period", OWNER_PATTERN_PERIOD), f"{where}: owner_pattern_period"
    )
    if not isinstance(settings["dedup"], bool):
        raise DataError(f"{where}: settings.dedup must be true or false, got {settings['dedup']!r}")
    names = [t.get("name") if isinstance(t, dict) else None for t in doc["tables"]]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise DataError(f"{where}: tables[{i}].name must be a non-empty string, got {name!r}")
        if name in names[:i]:
            raise DataError(
                f"{where}: tables[{i}].name: table {name!r} is listed twice "
                f"(also tables[{names.index(name)}])"
            )
    g = layout.uniform_group_size
    plans, metas = [], []
    for i, t in enumerate(doc["tables"]):
        tw = f"{where}: tables[{i}] ({t.get('name')!r})"
        meta = PlannedTable(
            name=t["name"],
            num_rows=_positive(t["num_rows"], f"{tw}.num_rows"),
            dim=_positive(t["dim"], f"{tw}.dim"),
            element_bytes=_positive(t["element_bytes"], f"{tw}.element_bytes"),
            optimizer_bytes_per_row=_count(t["optimizer_bytes_per_row"], f"{tw}.optimizer_bytes_per_row"),
            order_fingerprint=str(t["order_fingerprint"]),
            touch_rates=None if t.get("touch_rates") is None else str(t["touch_rates"]),
        )
        hot, warm, cold = (_count(t[f"{tier}_rows"], f"{tw}.{tier}_rows") for tier in ("hot", "warm", "cold"))
        if hot + warm + cold != meta.num_rows:
            raise DataError(f"{tw}: tiers {hot}+{warm}+{cold} do not add up to num_rows {meta.num_rows}")
        cold_share = _shares(t["cold_share"], size, f"{tw}.cold_share", must_sum=cold > 0)
        if warm > 0 and g is None:
            raise DataError(f"{tw}: warm rows need groups of equal size, got {layout.to_lists()}")
        width = g if g is not None else len(t["warm_share_by_position"])
        warm_pos = _shares(
            t["warm_share_by_position"], width, f"{tw}.warm_share_by_position", must_sum=warm > 0
        )
        warm_share = warm_pos[layout.position_of_rank] if g is not None else 1.0 / layout.group_size_of_rank()
        try:
            fetch = FetchMode.parse(t["fetch"])
        except ConfigError as e:
            raise DataError(f"{tw}.{e}") from None
        if fetch is FetchMode.GROUP and cold > 0 and g is None:
            raise DataError(f"{tw}: a group fetch needs groups of equal size, got {layout.to_lists()}")
        try:
            deal = Deal.parse(t.get("deal", Deal.INTERLEAVE.value))
        except ConfigError as e:
            raise DataError(f"{tw}.{e}") from None
        if deal is Deal.RANGES and cold != meta.num_rows:
            raise DataError(f"{tw}: the ranges deal needs every row cold, got {hot} hot and {warm} warm")
        starts = [t.get(f, 0) for f in ("warm_start", "cold_start")]
        for fld, start in zip(("warm_start", "cold_start"), starts, strict=True):
            if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < period:
                raise DataError(f"{tw}.{fld}: must be an integer in [0, {period}), got {start!r}")
        plans.append(TablePlan(meta.name, hot, warm, cold, warm_share, cold_share, fetch, deal, *starts))
        metas.append(meta)
    plan = Plan(
        strategy=str(doc["strategy"]),
        tables=tuple(plans),
        dedup=bool(settings["dedup"]),
        sync=sync,
        budget_bytes=doc.get("budget_bytes"),
        solver=dict(doc.get("solver", {})),
        wire=wire,
    )
    fingerprints = {str(k): str(v) for k, v in dict(doc["fingerprints"]).items()}
    return PlanFile(plan, layout, batch, tuple(metas), fingerprints, dict(doc["predicted"]), period)


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DataError(f"{what} must be a positive integer, got {value!r}")
    return value


def _count(value: Any, what: str) -> int:
    """``value`` when it is an integer >= 0 (not a bool, a float or a string), else DataError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(f"{what} must be an integer >= 0, got {value!r}")
    return value


def _shares(values: Any, size: int, what: str, must_sum: bool) -> np.ndarray:
    """``size`` finite shares >= 0 that sum to 1 (when the tier has rows)."""
    shares = np.asarray(values, dtype=np.float64)
    if shares.shape != (size,):
        raise DataError(f"{what} has {shares.size} entries, expected {size}")
    if not np.isfinite(shares).all() or (shares < 0).any():
        bad = next(x for x in shares.tolist() if not (math.isfinite(x) and x >= 0))
        raise DataError(f"{what}: every share must be a finite number >= 0, got {bad!r}")
    if must_sum and abs(float(shares.sum()) - 1.0) > SHARE_TOLERANCE:
        raise DataError(f"{what}: shares sum to {shares.sum():.9g}, not 1")
    return shares
