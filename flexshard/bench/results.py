"""Aggregation of every rank's measurements into one record per strategy, and the table / JSON output.

Per strategy: a step's time is its slowest rank's (ms; mean, median and standard deviation over the timed
steps); collectives per step are rank 0's, per kind; bytes per link class are the busiest rank's mean per
step (send side, B; MB = 1e6 B in the table), beside FlexShard's own traffic counter for the systems on its
runtime; the cost model's bytes and the time model's prediction of the plan on the running machine.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from core.vocabulary import LinkClass
from flexshard.bench.config import BenchConfig
from flexshard.bench.plans import LABELS, StrategyPlan, plan_for_text

INTRA, INTER = int(LinkClass.INTRA_GROUP), int(LinkClass.INTER_GROUP)


def _busiest(per_rank: list[np.ndarray]) -> np.ndarray:
    """Mean bytes per step of each rank ([ranks, steps, link]) -> the largest per link class."""
    return np.max([np.mean(a, axis=0) for a in per_rank], axis=0)


def records(
    cfg: BenchConfig,
    gathered: list[dict[str, Any]],
    plans: dict[str, StrategyPlan],
    notes: dict[str, str],
) -> list[dict[str, Any]]:
    """One record per strategy that ran (run order), then one per strategy skipped (``skipped``: why)."""
    out = []
    slowest = {  # per strategy, the slowest rank's step (ms), in run order: round after round
        key: np.max(np.array([g["systems"][key]["times"] for g in gathered]), axis=0) * 1e3
        for key in gathered[0]["systems"]
    }
    for key, got0 in gathered[0]["systems"].items():
        per_rank = [g["systems"][key] for g in gathered]
        by_rank = np.array([p["times"] for p in per_rank]) * 1e3  # [rank, step] ms
        cpu_by_rank = _median_by_rank_s(gathered, key, "cpu") * 1e3  # [rank] ms
        thread_by_rank = _median_by_rank_s(gathered, key, "thread") * 1e3  # [rank] ms
        faults_by_rank = np.mean(np.array([p["faults"] for p in per_rank]), axis=1)  # [rank]
        steps = slowest[key]
        n = steps.size
        sent = _busiest([p["sent"] for p in per_rank])
        sp = plans[key]
        record: dict[str, Any] = {
            "strategy": key,
            "label": LABELS[key],
            "step_ms_mean": float(steps.mean()),
            "step_ms_median": float(np.median(steps)),
            "step_ms_std": float(steps.std()),
            "timed_steps": int(n),
            "collectives_per_step": sum(got0["counts"].values()) / n,
            "collectives_by_kind": {k: v / n for k, v in sorted(got0["counts"].items())},
            "collectives_each_step": list(got0["per_step"]),
            "inter_group_bytes": float(sent[INTER]),
            "intra_group_bytes": float(sent[INTRA]),
            "predicted_step_ms": sp.predicted_ms,
            "predicted_parts_ms": dict(sp.predicted_parts_ms),
            "modeled_inter_group_bytes": sp.modeled_inter_bytes,
            "modeled_intra_group_bytes": sp.modeled_intra_bytes,
            "plan": sp.summary,
            "plan_tables": plan_tables(sp),
            "step_ms_median_by_rank": [float(x) for x in np.median(by_rank, axis=1)],
            # a rank's process CPU per step (user and system, every thread), median over its steps
            "cpu_ms_per_step": float(np.median(cpu_by_rank)),
            "cpu_ms_per_step_by_rank": [float(x) for x in cpu_by_rank],
            # the calling thread's CPU per step (its work, not its waits nor gloo's threads), likewise
            "thread_cpu_ms_per_step": float(np.median(thread_by_rank)),
            "thread_cpu_ms_per_step_by_rank": [float(x) for x in thread_by_rank],
            # minor page faults per step (the heap still growing: pages first touched), each rank's mean
            # over its steps, the median over ranks, and per rank
            "page_faults_per_step": float(np.median(faults_by_rank)),
            "page_faults_per_step_by_rank": [float(x) for x in faults_by_rank],
            "plan_for": cfg.plan_for,
            "ran_in_blocks": list(got0["blocks"]),
        }
        base = slowest.get(ABLATION)
        if base is not None and base.size == n and n % cfg.rounds == 0:
            record["vs_ablation"] = float(np.median(steps) / np.median(base))
            record["vs_ablation_by_round"] = round_ratios(steps, base, cfg.rounds)
        if got0["own"] is not None:
            own = _busiest([p["own"] for p in per_rank])
            record["runtime_inter_group_bytes"] = float(own[INTER])
            record["runtime_intra_group_bytes"] = float(own[INTRA])
        out.append(record)
    for key, why in notes.items():
        out.append({"strategy": key, "label": LABELS[key], "skipped": why})
    return out


def _median_by_rank_s(gathered: list[dict[str, Any]], key: str, clock: str) -> np.ndarray:
    """Each rank's median over its timed steps of ``key``'s ``clock`` per step (``cpu``: the process's,
    every thread; ``thread``: the calling thread's), s."""
    return np.median(np.array([g["systems"][key][clock] for g in gathered]), axis=1)


def thread_cpu_s(gathered: list[dict[str, Any]], key: str, threads_per_core: float) -> float:
    """A strategy's local work per step measured on its timed steps, s: the median over ranks of each
    rank's median calling-thread CPU per step (``time.thread_time``: its own work and its copies into and
    out of the collectives' buffers; not its waits in them, nor gloo's threads, whose copies the
    exchange's measured bandwidth prices), times ``threads_per_core`` (the job's torch threads per core,
    at least 1: the cores work through every rank's share in turn). What the bench prices TorchRec's
    local work with, which the time model does not model. On a GPU it is the host's part only (the
    launches; the clock stops before the step's synchronize), not the kernels'."""
    return float(np.median(_median_by_rank_s(gathered, key, "thread"))) * max(1.0, threads_per_core)


ABLATION = "row_wise"  # what "vs ablation" divides by: FlexShard's runtime on the row-wise plan


def round_ratios(steps: np.ndarray, base: np.ndarray, rounds: int) -> list[float]:
    """Per round, the median of ``steps`` over the median of ``base`` in the same round (both ms per
    timed step in run order, ``rounds`` equal blocks): the strategies alternate within a round, so a
    round's ratio compares steps run side by side, and their spread says how far a ratio can be read."""
    mine, theirs = np.split(np.asarray(steps), rounds), np.split(np.asarray(base), rounds)
    return [float(np.median(a) / np.median(b)) for a, b in zip(mine, theirs, strict=True)]


PLAN_TABLE_KEYS = ("name", "hot_rows", "warm_rows", "cold_rows", "fetch", "cold_share")


def plan_tables(sp: StrategyPlan) -> list[dict[str, Any]]:
    """Per table of a strategy's plan file: its tiers, cold fetch and each rank's share of its cold rows
    (what the prediction prices the slowest rank by); empty for a strategy without a plan file."""
    if sp.document is None:
        return []
    return [{k: t[k] for k in PLAN_TABLE_KEYS if k in t} for t in sp.document["tables"]]


def to_json(recs: list[dict[str, Any]]) -> str:
    return json.dumps(recs, indent=1)


def _vs_ablation(r: dict[str, Any]) -> str:
    """``1.12 (1.08-1.17)``: the ratio of medians, and its range over the rounds ("" without one)."""
    if "vs_ablation" not in r:
        return ""
    by_round = r["vs_ablation_by_round"]
    spread = f" ({min(by_round):.2f}-{max(by_round):.2f})" if len(by_round) > 1 else ""
    return f"{r['vs_ablation']:.2f}{spread}"


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


def _kinds(by_kind: dict[str, float]) -> str:
    short = {"all_to_all_single": "a2a", "all_reduce": "ar", "all_gather": "ag", "broadcast": "bc"}
    return " + ".join(f"{v:g} {short.get(k, k)}" for k, v in by_kind.items()) or "0"


def _figures(ran: list[dict[str, Any]]) -> str:
    """`` (intra 1.3 GB/s, inter 1.5 GB/s)``: the planned-for view's median bandwidths."""
    if not ran or "plan_view" not in ran[0]:
        return ""
    v = ran[0]["plan_view"]
    return f" (intra {v['intra_GBps']:.3g} GB/s, inter {v['inter_GBps']:.3g} GB/s per rank)"


def _settled(ran: list[dict[str, Any]]) -> str:
    """The warm-up passes run until the heaps settled (:mod:`flexshard.bench.settle`), as text."""
    passes = ran[0].get("settle_passes", 0) if ran else 0
    settled = f" and {passes} pass{'es' if passes != 1 else ''} until the heaps settled" if passes else ""
    gc = ran[0].get("python_gc") if ran else None
    in_blocks = gc == "before each block"
    return settled + ("; Python's garbage collection before each block, not in steps" if in_blocks else "")


def table(cfg: BenchConfig, recs: list[dict[str, Any]], backend: str = "gloo") -> str:
    """The report: the set-up, one row per strategy, the notes."""
    ran = [r for r in recs if "skipped" not in r]
    plan_for = plan_for_text(cfg.plan_for)
    lines = [
        f"bench: {cfg.nproc} ranks in {cfg.groups} group{'s' if cfg.groups > 1 else ''} of {cfg.group_size} "
        f"({backend}, "
        f"{cfg.threads} torch thread(s) per rank, {os.cpu_count()} cores"
        + (", freed host memory kept" if ran and ran[0].get("host_memory_kept") else "")
        + ")",
        f"workload {cfg.workload}, batch {cfg.batch} per rank; {cfg.rounds} round(s) of {cfg.steps} "
        f"timed steps per strategy after {cfg.warmup} warm-up steps{_settled(ran)},",
        f"strategies alternating in each round; plans made for {plan_for}{_figures(ran)}",
        "",
    ]
    header = [
        "strategy",
        "step ms mean",
        "median",
        "vs ablation (rounds)",
        "CPU ms/rank",
        "collectives/step",
        "intra MB",
        "inter MB",
        "predicted vs ablation",
        "predicted ms",
    ]
    rows = [header]
    ablation = next((r["predicted_step_ms"] for r in ran if r["strategy"] == ABLATION), None)
    for r in ran:
        pred = f"{r['predicted_step_ms']:.1f}"
        modeled = f"{r['predicted_step_ms'] / ablation:.2f}" if ablation else ""
        rows.append(
            [
                r["label"],
                f"{r['step_ms_mean']:.1f}",
                f"{r['step_ms_median']:.1f}",
                _vs_ablation(r),
                f"{r['cpu_ms_per_step']:.1f}" if "cpu_ms_per_step" in r else "",
                f"{r['collectives_per_step']:g} ({_kinds(r['collectives_by_kind'])})",
                _mb(r["intra_group_bytes"]),
                _mb(r["inter_group_bytes"]),
                modeled,
                pred,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for j, row in enumerate(rows):
        cells = [
            c.ljust(w) if i in (0, 5) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("step: slowest rank per step; a2a all-to-all, ar all-reduce")
    lines.append(
        "vs ablation: median step over the row-wise ablation's; in brackets the lowest and highest of the "
        "same ratio within each round (the strategies alternate in a round); predicted vs ablation: the "
        "same ratio of the time model's steps"
    )
    lines.append(
        "CPU ms/rank: a rank's process CPU per step (user and system, gloo's threads included), the median "
        "over its steps, then over the ranks; with more ranks than cores the step is about the ranks' CPU "
        "over the cores"
    )
    lines.append("bytes: the busiest rank's mean per step, sent, counted on the collectives (MB = 1e6 B)")
    if ran and "concurrent_all_to_all_Bps" in ran[0]:
        lines.append(
            "predicted: the time model on this machine (its probed latencies, local rates measured on the "
            "ranks at once); every link priced at most at "
            f"{ran[0]['concurrent_all_to_all_Bps'] / 1e9:.2f} GB/s per rank, what a rank sent in an "
            "all-to-all of every rank at once (the ranks share this host's cores)"
        )
    for r in ran:
        lines.append(f"- {r['label']}: {r['plan']}")
    for r in recs:
        if "skipped" in r and not r["skipped"].startswith("left out"):
            lines.append(f"{r['label']} skipped: {r['skipped']}")
    return "\n".join(lines)
