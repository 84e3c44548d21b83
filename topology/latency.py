"""Measured or published collective latencies carried by a topology graph.

``G.graph["collective_latency_us"]`` (optional) holds small-message latencies of the collectives a step
issues, in microseconds, by collective kind, process-group scope and number of participants::

    {"all_to_all": {"world": {"8": 41.0, "16": 55.0}, "group": {"8": 12.0}, "rail": {"2": 20.0}},
     "all_reduce": {...}}

Kinds: ``all_to_all``, ``all_reduce``; scopes: ``world`` (every rank), ``group`` (an NVLink group),
``rail`` (one rank per group); participant counts are decimal strings (JSON keys) of integers >= 2.
``G.graph["collective_latency_source"]`` (optional, str) says where the figures come from (a probe run,
a preset's citations). ``flexshard probe`` writes both; the presets carry NCCL figures
(:mod:`topology.presets`); :func:`topology.views.cluster_view` copies them into the view, and the time
model (:mod:`solvers.time_model`) interpolates between them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from core.errors import TopologyError

LATENCY_KEY = "collective_latency_us"
SOURCE_KEY = "collective_latency_source"
KINDS = ("all_to_all", "all_reduce")
SCOPES = ("world", "group", "rail")

# {kind: {scope: {participants: microseconds}}}
LatencyPoints = dict[str, dict[str, dict[int, float]]]


def parse_latency(data: Any, where: str = "topology") -> LatencyPoints:
    """Check a ``collective_latency_us`` object and return it with integer participant keys; a problem
    raises :class:`TopologyError` naming the field and value."""
    field = f"{where}: field {LATENCY_KEY!r}"
    if not isinstance(data, dict):
        raise TopologyError(f"{field} = {data!r}; expected an object {{kind: {{scope: {{ranks: us}}}}}}")
    out: LatencyPoints = {}
    for kind, scopes in data.items():
        if kind not in KINDS:
            raise TopologyError(f"{field}: kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(scopes, dict):
            raise TopologyError(f"{field}[{kind!r}] = {scopes!r}; expected {{scope: {{ranks: us}}}}")
        for scope, points in scopes.items():
            if scope not in SCOPES:
                raise TopologyError(f"{field}[{kind!r}]: scope {scope!r}; expected one of {'/'.join(SCOPES)}")
            if not isinstance(points, dict) or not points:
                raise TopologyError(f"{field}[{kind!r}][{scope!r}] = {points!r}; expected {{ranks: us}}")
            parsed: dict[int, float] = {}
            for ranks, us in points.items():
                try:
                    p = int(str(ranks))
                except ValueError:
                    p = 0
                if p < 2 or str(ranks).strip() != str(p):
                    raise TopologyError(
                        f"{field}[{kind!r}][{scope!r}]: participants {ranks!r}; expected an integer >= 2"
                    )
                ok = isinstance(us, numbers.Real) and not isinstance(us, bool)
                if not ok or not math.isfinite(float(us)) or float(us) <= 0:
                    raise TopologyError(
                        f"{field}[{kind!r}][{scope!r}][{ranks!r}] = {us!r}; expected a positive number of us"
                    )
                parsed[p] = float(us)
            out.setdefault(kind, {})[scope] = dict(sorted(parsed.items()))
    return out


def latency_attribute(points: LatencyPoints) -> dict[str, dict[str, dict[str, float]]]:
    """``points`` as the JSON-ready graph attribute (participant counts as string keys)."""
    return {
        kind: {scope: {str(p): float(us) for p, us in sorted(pts.items())} for scope, pts in scopes.items()}
        for kind, scopes in points.items()
    }


def graph_latency(G: Any) -> tuple[LatencyPoints | None, str]:
    """The checked latency points of a graph (None when it has none) and their source ('' if unsaid)."""
    data = G.graph.get(LATENCY_KEY)
    source = G.graph.get(SOURCE_KEY, "")
    if source is not None and not isinstance(source, str):
        raise TopologyError(f"topology: field {SOURCE_KEY!r} = {source!r}; expected a string")
    return (None if data is None else parse_latency(data)), source or ""
