"""The headline of ``flexshard simulate``: FlexShard against TorchRec's default and against row-wise with
dedup, at each budget, in bytes and modeled step time; and, where FlexShard's figures equal a baseline's,
why.

It reads the records of :func:`flexshard.cli.simulate_records` (``strategy``, ``budget_x``, ``dedup``,
``feasible``, ``inter_group_bytes``, ``intra_group_bytes``, ``step_s`` (else ``modeled_time_s``), TorchRec's
default's ``torchrec_step_s`` and ``torchrec_collectives``, and the plan's ``hot_rows``, ``warm_rows``,
``cold_rows``, ``group_fetch_tables``, ``cold_tables`` and FlexShard's ``chosen``), never figures of its
own: when the pricing of a baseline changes, the headline follows.

* TorchRec's default is row-wise sharding without dedup (``row_wise``, dedup off) at the same budget, its
  step priced in TorchRec's own collectives (``torchrec_step_s``; :func:`solvers.planner.torchrec_step`);
  row-wise with dedup is ``row_wise`` with dedup on, on FlexShard's runtime. A FlexShard point without
  dedup is compared with TorchRec's default only (row-wise with dedup has a setting that point lacks).
* Time is the modeled step time (latency, bytes over bandwidth and local work) where every compared
  record has one, else the modeled bandwidth time (records of older runs) and the line says "time".
* Bytes are inter-group bytes (the NICs) where any of the compared records has some; on a cluster of
  one group (no inter-group links) they are intra-group bytes, and the line says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flexshard.report import human_bytes

TORCHREC_DEFAULT = ("row_wise", False)  # (strategy, dedup)
ROW_WISE_DEDUP = ("row_wise", True)
LEGEND = (
    "* FlexShard's plan: the tier optimizer's, or a baseline's tiers where those are faster in the model "
    "(never slower than a feasible baseline)"
)
_REL_TOL = 1e-6  # figures closer than this (relative) are equal
NEAR = 0.01  # a baseline within 1% of FlexShard's modeled time gets a line of its own
_BYTES_ATOL = 0.5  # bytes: less than half a byte apart is equal (float residue of a one-group cluster)
_SECONDS_ATOL = 1e-12


def baseline_keys(records: Sequence[dict[str, Any]]) -> dict[tuple[bool, str], list[float]]:
    """The baseline records the headline compares with that ``records`` lacks (``--dedup on`` runs have
    no TorchRec default, ``--strategies`` may leave row-wise out), as ``{(dedup, strategy): budgets}``:
    the caller prices them for the headline only."""
    have = {(r["budget_x"], r["dedup"], r["strategy"]) for r in records}
    want: dict[tuple[bool, str], list[float]] = {}
    for r in records:
        if r["strategy"] != "flexshard":
            continue
        needed = [TORCHREC_DEFAULT] + ([ROW_WISE_DEDUP] if r["dedup"] else [])
        for strategy, dedup in needed:
            budgets = want.setdefault((dedup, strategy), [])
            if (r["budget_x"], dedup, strategy) not in have and r["budget_x"] not in budgets:
                budgets.append(r["budget_x"])
    return {key: budgets for key, budgets in want.items() if budgets}


def headline(records: Sequence[dict[str, Any]], extra: Sequence[dict[str, Any]] = ()) -> list[str]:
    """One line per FlexShard point (budget, dedup) of ``records``, in their order; then, per point, a
    line naming the baselines whose figures FlexShard's equal, with the reason, and one naming those
    within :data:`NEAR` of its modeled time, with what its plan shares with them (where the records have
    the plan's shape); ``extra``: baseline records priced for the headline only (:func:`baseline_keys`)."""
    index = {(r["budget_x"], r["dedup"], r["strategy"]): r for r in [*extra, *records]}
    lines, equal = [], []
    for ours in records:
        if ours["strategy"] != "flexshard":
            continue
        x, dedup = ours["budget_x"], ours["dedup"]
        where = f"FlexShard at {x:g}x, dedup {'on' if dedup else 'off'}"
        if not ours["feasible"]:
            lines.append(f"{where}: infeasible ({ours.get('error', 'no plan fits the budget')})")
            continue
        needed = [("TorchRec's default", TORCHREC_DEFAULT, "row-wise, dedup off: ")]
        if dedup:
            needed.append(("row-wise with dedup", ROW_WISE_DEDUP, ""))
        compared = [(name, index.get((x, d, s)), prefix) for name, (s, d), prefix in needed]
        lines.append(_line(where, ours, compared))
        others = [
            r for r in records if (r["budget_x"], r["dedup"]) == (x, dedup) and r["strategy"] != "flexshard"
        ]
        same = [r["strategy"] for r in others if _equal(ours, r)]
        if same:
            equal.append(f"{where} equals {_names(same)}: {_why_equal(ours)}")
        near = [r for r in others if r["strategy"] not in same and _near(ours, r)]
        if near:
            stepped = _stepped(ours, *near)
            gap = max(abs(_seconds(r, stepped) / _seconds(ours, stepped) - 1) for r in near)
            close = "matches" if gap <= _REL_TOL else f"is within {_percent(gap)} of"
            names = _names([r["strategy"] for r in near])
            equal.append(
                f"{where} {close} {names} in modeled {'step ' if stepped else ''}time"
                + (f": {_why_near(ours)}" if "cold_tables" in ours else "")
            )
    return lines + equal


def _names(names: list[str]) -> str:
    return ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]


def _stepped(*records: dict) -> bool:
    """Whether every record carries a modeled step time."""
    return all(r.get("step_s") is not None for r in records)


def _seconds(r: dict, stepped: bool, theirs: bool = False) -> float:
    """A record's time: its modeled step time where ``stepped`` (TorchRec's default's in TorchRec's own
    collectives where ``theirs`` and the record has it), else its modeled bandwidth time."""
    if stepped and theirs and r.get("torchrec_step_s") is not None:
        return float(r["torchrec_step_s"])
    return float(r["step_s"] if stepped else r["modeled_time_s"])


def _near(ours: dict, r: dict) -> bool:
    """A feasible baseline whose modeled (step) time is within :data:`NEAR` of FlexShard's (and not
    equal)."""
    if not r["feasible"]:
        return False
    stepped = _stepped(ours, r)
    if _seconds(ours, stepped) <= 0:
        return False
    return abs(_seconds(r, stepped) / _seconds(ours, stepped) - 1) <= NEAR


def _line(where: str, ours: dict, compared: list[tuple[str, dict | None, str]]) -> str:
    feasible = [r for _name, r, _p in compared if r is not None and r["feasible"]]
    link = (
        "inter" if any(_bytes(r, "inter_group_bytes") > _BYTES_ATOL for r in [ours, *feasible]) else "intra"
    )
    key = f"{link}_group_bytes"
    stepped = _stepped(ours, *feasible)
    time_of = "step time" if stepped else "time"
    head = f"{where}: {human_bytes(_bytes(ours, key))} {link}-group, {_ms(_seconds(ours, stepped))}"
    head += " a step" if stepped else ""
    if link == "intra":
        head += " (one group: no inter-group links)"
    parts = []
    for name, r, prefix in compared:
        if r is None:
            continue
        if not r["feasible"]:
            parts.append(f"{name} is infeasible at this budget")
            continue
        theirs = stepped and r.get("torchrec_step_s") is not None
        if theirs:  # TorchRec's default priced in TorchRec's own collectives
            prefix = f"{prefix.removesuffix(': ')}, in its {r['torchrec_collectives']} collectives: "
        seconds = _seconds(r, stepped, theirs)
        figures = f"{prefix}{human_bytes(_bytes(r, key))}, {_ms(seconds)}"
        bytes_ = _relative(
            _bytes(ours, key), _bytes(r, key), _BYTES_ATOL, ("fewer bytes", "more bytes", "equal bytes")
        )
        time_ = _relative(
            _seconds(ours, stepped),
            seconds,
            _SECONDS_ATOL,
            (f"less {time_of}", f"more {time_of}", f"equal {time_of}"),
        )
        if (bytes_, time_) == ("equal bytes", f"equal {time_of}"):
            parts.append(f"the same bytes and {time_of} as {name} ({figures})")
        else:
            parts.append(f"{bytes_} and {time_} than {name} ({figures})")
    return head + ("; " + " and ".join(parts) if parts else "")


def _bytes(record: dict, key: str) -> float:
    """A record's figure, 0 where it has none (a cluster without inter-group links may leave it out)."""
    return float(record.get(key) or 0.0)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _relative(ours: float, theirs: float, atol: float, words: tuple[str, str, str]) -> str:
    """``83.7% fewer bytes``, ``5.0% more time``, or the third word (equal within ``atol`` or 1e-6
    relative; also when both are 0); more than a baseline of 0 is said without a percentage;
    ``words``: (less, more, same)."""
    less, more, same = words
    if _close(ours, theirs, atol):
        return same
    if theirs <= atol:  # no percentage of nothing
        return more
    change = ours / theirs - 1
    return f"{_percent(change)} {less}" if change < 0 else f"{_percent(change)} {more}"


def _percent(change: float) -> str:
    """``41.9%``; below 0.05%, two significant digits (``0.0048%``)."""
    return f"{abs(change):.1%}" if abs(change) >= 5e-4 else f"{abs(change) * 100:.2g}%"


def _close(a: float, b: float, atol: float) -> bool:
    return abs(a - b) <= _REL_TOL * max(abs(a), abs(b)) + atol


def _equal(ours: dict, r: dict) -> bool:
    """Both feasible, and the same inter-group bytes, intra-group bytes and modeled (step) time."""
    if not r["feasible"]:
        return False
    tolerances = {"inter_group_bytes": _BYTES_ATOL, "intra_group_bytes": _BYTES_ATOL}
    same_bytes = all(_close(_bytes(ours, k), _bytes(r, k), atol) for k, atol in tolerances.items())
    stepped = _stepped(ours, r)
    return same_bytes and _close(_seconds(ours, stepped), _seconds(r, stepped), _SECONDS_ATOL)


def _fetch(ours: dict) -> str:
    """How the plan fetches its cold rows, from the record's tables with cold rows and those fetched per
    group."""
    cold_tables, group = ours.get("cold_tables", 0), ours.get("group_fetch_tables", 0)
    if cold_tables and group == cold_tables:
        return "fetches every cold row once per group"
    if cold_tables and group == 0:
        return "fetches every cold row from its owner, as row-wise does"
    if cold_tables:
        return f"fetches the cold rows of {group} of {cold_tables} tables once per group"
    return "has no cold rows"


def _kept(ours: dict) -> str:
    """What the planner kept instead of its optimizer's plan (``chosen``), or ''."""
    if not ours.get("chosen"):
        return ""
    name, _, kind = ours["chosen"].rpartition(" ")
    what = f"{name}'s own plan" if kind == "plan" else f"{name}'s tiers, dealt FlexShard's way"
    return f"FlexShard's planner kept {what} (no plan of its optimizer was faster in the model)"


def _why_equal(ours: dict) -> str:
    """Why FlexShard's plan prices as a baseline's, from the plan's tiers, its cold fetch and what the
    planner chose."""
    how = _fetch(ours)
    if how == "fetches every cold row once per group":
        how += ": the group fetch alone is the bound at this budget"
    hot, warm = ours.get("hot_rows", 0), ours.get("warm_rows", 0)
    rows = hot + warm + ours.get("cold_rows", 0)
    room = (
        " (a 1x budget leaves no memory to replicate beyond rounding)" if ours["budget_x"] <= 1 + 1e-9 else ""
    )
    if _kept(ours):
        return f"{_kept(ours)}; it {how}"
    if hot == warm == 0:
        return f"the plan replicates nothing{room} and {how}"
    return (
        f"the plan replicates only {hot:,} hot and {warm:,} warm of {rows:,} rows{room}, too few to move the "
        f"figures, and {how}"
    )


def _why_near(ours: dict) -> str:
    """What FlexShard's plan shares with baselines it barely beats: its tiers and its cold fetch."""
    if _kept(ours):
        return f"{_kept(ours)}; it {_fetch(ours)}"
    hot, warm = ours.get("hot_rows", 0), ours.get("warm_rows", 0)
    rows = hot + warm + ours.get("cold_rows", 0)
    return f"the plan replicates {hot:,} hot and {warm:,} warm of {rows:,} rows and {_fetch(ours)}"
