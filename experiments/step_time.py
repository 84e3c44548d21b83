"""Step time, measured and modeled: the time model against measured gloo steps, then the model with the
NCCL presets' figures on the embedded default at 64 and 512 GPUs.

Part 1 (measured): ``flexshard bench`` on 4 and 8 local gloo ranks in 2 groups at batch 64 to 1024 per
rank, plans made for this machine (a topology file from one quick probe, so every batch size plans for
the same figures) and for the H100 shape, every strategy on the same batches in rounds of a Williams design:
the median step, collectives per step and the time model's prediction on the probed machine. Part 2
(modeled): FlexShard, row-wise with dedup and TorchRec's default (row-wise without dedup) on the
embedded default at 64 GPUs (8 H100 nodes) and 512 GPUs (64 nodes), the step split into collective
latency, bandwidth and local work, unpipelined and pipelined, against the FlexShard paper's headline of
about 6x lower communication latency than TorchRec's default. Writes docs/results/step_time.md (and, with
part 1, step_time.json: its bench records, with each plan's tiers and cold shares and each rank's step).
Part 1 can run several times (``--runs N``: medians over runs, the marks judged per run and on them; see
``step_runs``) or be read back from earlier runs' records (``--from``). Run:
    .venv/bin/python experiments/step_time.py [--quick] [--runs N | --from JSON ...]
        [--no-measure (part 2 only, not written)]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import step_runs
import study

from core.vocabulary import FetchMode
from flexshard import workloads
from flexshard.bench.plans import LABELS
from solvers.planner import budget_bytes, make_plan
from solvers.schedule import torchrec_schedule
from solvers.tier_program import OptimizerConfig
from solvers.time_model import step_time
from solvers.time_types import GPU_ROOFLINE_RATES, H100_RUNTIME_RATES
from topology import cluster_view, from_preset

RANKS = (4, 8)
BATCHES = (64, 256, 512, 1024)
QUICK_BATCHES = (64, 256)
SCALES = (("h100:8", 64), ("h100:64", 512))  # preset, GPUs
BUDGET_X = 2.0
# part 1's plans for the H100 shape: priced with no GPU host work (bench's default) and with this runtime's
H100_PLANS = (("h100", "h100", ()), ("h100", "h100, host measured", ("--gpu-host", "measured")))
# the GPU's host work: this runtime's, measured on an H100; and none, as if it were fused away (a target)
HOSTS = (("measured (this runtime)", H100_RUNTIME_RATES), ("fused (roofline only)", GPU_ROOFLINE_RATES))
ABLATION = LABELS["row_wise"]  # the bench's label of the row-wise ablation
PAPER_RATIO = 6.0  # the FlexShard paper's abstract: about 6x lower communication latency than TorchRec's
STRATEGIES = (  # (label, strategy, dedup, the collectives of another implementation's step)
    ("FlexShard", "flexshard", True, None),
    ("row-wise, dedup", "row_wise", True, None),
    ("TorchRec default", "row_wise", False, torchrec_schedule),
)


METHOD = """Part 1 runs `flexshard bench --json` for each row's ranks (2 groups), batch per rank and plans
(`probed`: a topology file from one `flexshard probe` of this machine, each message size timed 15 times, so
every batch plans for the same figures, as `flexshard plan --topology` makes them: the probe records the
host's cores, and the plan prices each rank's local work at the ranks' share of them; `h100`: the H100 preset
shape of the same ranks and groups, priced with no GPU host work around the collectives, bench's default;
`h100, host measured`: the same with `--gpu-host measured`, this runtime's host work as measured on an H100,
docs/cost_model.md section 10.2), every strategy on the same batches in rounds ordered by a Williams design
(`flexshard bench`: each strategy at a new position and after a new strategy each round; the runs before
2026-11-28 10:40 UTC started each round one strategy later, which put FlexShard after TorchRec in two rounds
of three). "median step" is the median over timed steps of the slowest rank's step (the embedding forward, a
sum loss, backward and the optimizer step; no dense model); "vs ablation" divides by the row-wise ablation's
(FlexShard's runtime on the row-wise plan with per-rank dedup), "vs TorchRec" by TorchRec 1.8's row-wise
`EmbeddingCollection` on the same batches. "modeled ms" is the time model on the probed machine: the
collective latencies and bandwidth of the quick probe of the run's ranks (each message size timed 15 times),
taken 3 times before the rounds (the plans are made on their medians) and again after every round, each figure
the median of these, and local rates measured on the same ranks at once, on a batch of the run's size, the
same way (`bench --rates measured`: dedup, routing, gather, scatter-add, update, the loss and the buffer
copies per lookup or value, every piece over every table in turn as a step runs them, each the median of 3
repeats, docs/cost_model.md section 10.2.1a; the host's per-step and per-collective work from the stored
calibration at the ranks' share of the cores, which holds the collectives' wait for ranks descheduled on
shared cores: docs/cost_model.md section 10.2.1b; since 2026-11-28 12:15 UTC fitted to what this prediction
left of the two runs of 08:43 UTC, since 18:00 UTC to the two runs of 11:46 and 15:09 UTC,
`calibrate_local.py --host-from`); "of which local" is the local work in it; TorchRec's local work, which
the model does not price, is what its own timed steps spent in each rank's calling thread's CPU, times the
ranks per core (since 2026-11-28 18:30 UTC, docs/cost_model.md section 10.2.1f; from 15:10 UTC its step
timed apart on the run's ranks, 10.2.1e; before, its step on a one-rank group holding one rank's row-wise
shard of each table), so its prediction checks the communication the model adds to it. Every rank
keeps freed host memory
(`flexshard.runtime.host_memory`: no page faults for a step's large tensors), warms up until no rank's heap
grows (`bench --settle`) and keeps Python's garbage collector out of the timed steps (a collection before each
block, `flexshard.training.garbage`). "model error" is modeled over measured, minus one. Smaller batches run
more timed steps per round (their steps are short and noisier): 4x as many at batch 64 and 256, 2x at 512;
and below batch 256, where the cap leaves a block shortest, twice the rounds (since 2026-11-28 18:30 UTC). CPU
timings on 2 shared cores are not GPU timings, and loopback has no slower link between groups, so plans that
save inter-group bytes cannot gain here. FlexShard's plans are the planner's under the step objective: where
they equal the ablation's plan, the two rows measure the same work. With several runs (`--runs N`, or earlier
runs' records read back with `--from`; each record in step_time.json carries its run, its start and its
commit), each run is one pass over every row, one run after the other, and a row's figures are the medians
over the runs, each run's ratios taken within that run, with the lowest and highest run in brackets: on these
2 shared cores the same code's step moves by up to 20% between runs minutes apart (35% at 8 ranks, batch 64),
more than within a run. The marks table judges the issue's marks in each run and on those medians.

Part 2 prices the embedded default with the model alone, on the h100 presets (8 GPUs per node, their
NCCL latency figures and the HBM-roofline rates of the value work of docs/cost_model.md section 10;
neither measured on a GPU here), once with each GPU host work model of `plan --gpu-host` ("fused": no
host work around the collectives, as a runtime that fused its per-table work would have; "measured":
this runtime's, its aten ops at the host time per op measured on one H100) and the plans made for it:
FlexShard at 2x, row-wise with per-rank dedup and TorchRec's default (row-wise without dedup, its rows
dealt as contiguous id ranges over random orders, in TorchRec's own five collectives, priced on this
runtime's host work too), unpipelined
("step ms": the plan `plan --pipeline off` makes, priced one stage after the other) and pipelined
("pipelined ms": the plan `plan --pipeline on` makes, the default, priced as `train --pipeline on`
runs it); "plan" says what FlexShard's plan uses. The model's step has no dense model, so the
pipelined step gains only where a replica sync overlaps the next batch's id exchange, and that is
where replicas pay. "communication" is latency plus bandwidth, the part the FlexShard paper's headline
(about 6x lower communication latency than TorchRec's default) speaks of."""


def _bench(nproc: int, batch: int, plan_for: str, steps: str, rounds: str, flags: tuple = ()) -> list[dict]:
    """``flexshard bench --json`` records of one configuration (``flags``: more bench flags)."""
    cmd = [sys.executable, "-m", "flexshard.cli", "bench", "--nproc", str(nproc), "--groups", "2"]
    cmd += ["--batch", str(batch), "--steps", steps, "--rounds", rounds, "--plan-for", plan_for, "--json"]
    cmd += list(flags)
    out = subprocess.run(cmd, capture_output=True, text=True, env=study.cpu_job_env(), check=False)
    if out.returncode != 0:
        raise SystemExit(f"step_time: {' '.join(cmd[2:])} failed: {out.stderr.strip().splitlines()[-1:]}")
    return [r for r in json.loads(out.stdout) if "skipped" not in r]


def measure_run(batches: tuple[int, ...], steps: int, rounds: int) -> list[dict]:
    """One run of part 1: the bench records of every configuration (ranks, batch, plan), each with its
    ``nproc``, ``batch`` and ``planned_for``."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in RANKS:
            topo = str(Path(tmp) / f"probe{nproc}.json")
            probe = [sys.executable, "-m", "flexshard.cli", "probe", "--nproc", str(nproc)]
            subprocess.run(
                [*probe, "--groups", "2", "--out", topo],
                capture_output=True, env=study.cpu_job_env(), check=True,
            )  # fmt: skip
            for batch in batches:
                for plan_for, label, flags in ((topo, "probed", ()), *H100_PLANS):
                    at = (str(steps_at(batch, steps)), str(rounds_at(batch, rounds)))
                    recs = _bench(nproc, batch, plan_for, *at, flags)
                    records += [{**r, "nproc": nproc, "batch": batch, "planned_for": label} for r in recs]
                    print(f"measured {nproc} ranks, batch {batch}, plans for {label}", file=sys.stderr)
    return records


def measured_table(records: list[dict]) -> str:
    """Part 1's table (one row per configuration and strategy; over several runs the medians, with the
    lowest and highest run in brackets), the model's error per strategy, and the issue's marks in each
    run and on the medians."""
    rows, runs = step_runs.rows(records), len(step_runs.runs(records))
    table = []
    for r in rows:
        table.append(
            [r.nproc, r.batch, r.planned_for, r.label, f"{r.median('step_ms'):.1f}"]
            + [step_runs.spread(r.vs_ablation, ".2f")]
            + [step_runs.spread(r.vs_torchrec, ".2f") if r.vs_torchrec else "-"]
            + [f"{r.collectives:g}", f"{r.median('predicted_ms'):.1f}", f"{r.median('local_ms'):.1f}"]
            + [step_runs.spread(r.errors, "+.0%")]
        )
    header = ["ranks", "batch", "planned for", "strategy", "median step ms", "vs ablation", "vs TorchRec"]
    header += ["collectives", "modeled ms", "of which local", "model error"]
    runs_text = ""
    if runs > 1:
        runs_text = (
            f"{runs} runs (one pass over every row each, in turn); each figure is the median over the runs, "
            "each run's ratio taken within the run, the lowest and highest run in brackets.\n\n"
        )
    marks = "The issue's marks in each run" + (" and on the medians:" if runs > 1 else ":")
    return "\n\n".join(
        [
            runs_text + study.md_table(header, table, "rrllrrrrrrr"),
            error_summary(rows),
            marks,
            step_runs.marks_table(records),
        ]
    )


def figure(rows: list[step_runs.Row], path: Path) -> None:
    """Part 1 as a plot: each row's modeled against measured step (medians over runs; the 20% band
    dashed), and FlexShard's step over the row-wise ablation's by batch for each plan and rank count
    (measured: dots; the time model's: faint crosses), with the issue's marks for the probed plan and the
    H100 plan."""
    fig, (ax, bx) = study.subplots(1, 2, figsize=(13, 5))
    labels = list(dict.fromkeys(r.label for r in rows))
    for label, marker in zip(labels, "osD^v<>", strict=False):
        mine = [r for r in rows if r.label == label]
        measured, modeled = ([r.median(k) for r in mine] for k in ("step_ms", "predicted_ms"))
        ax.scatter(measured, modeled, marker=marker, s=22, label=label, alpha=0.8)
    lo = min(min(r.median("step_ms"), r.median("predicted_ms")) for r in rows) * 0.8
    hi = max(max(r.median("step_ms"), r.median("predicted_ms")) for r in rows) * 1.25
    line = [lo, hi]
    ax.plot(line, line, color="black", lw=0.8)
    for k in (1 - step_runs.WITHIN, 1 + step_runs.WITHIN):
        ax.plot(line, [v * k for v in line], color="gray", lw=0.8, ls="--")
    title = "Time model against measured gloo steps (dashed: 20%)"
    ax.set(xscale="log", yscale="log", xlim=line, ylim=line, title=title)
    ax.set(xlabel="measured step, ms (median)", ylabel="modeled step, ms")
    ax.legend(fontsize=8)
    ours = [r for r in rows if r.label == step_runs.FLEXSHARD]
    ablation = {
        (r.nproc, r.batch, r.planned_for): r.median("predicted_ms") for r in rows if r.label == ABLATION
    }
    for planned_for, color in zip(
        dict.fromkeys(r.planned_for for r in ours), ("C0", "C1", "C2"), strict=False
    ):
        for nproc, style in zip(sorted({r.nproc for r in ours}), ("-", "--"), strict=False):
            pts = sorted(
                (r.batch, r.median("vs_ablation"))
                for r in ours
                if (r.planned_for, r.nproc) == (planned_for, nproc)
            )
            bx.plot(
                *zip(*pts, strict=True), style, marker="o", color=color, label=f"{planned_for}, {nproc} ranks"
            )
            modeled = sorted(
                (r.batch, r.median("predicted_ms") / ablation[(r.nproc, r.batch, r.planned_for)])
                for r in ours
                if (r.planned_for, r.nproc) == (planned_for, nproc)
                and (r.nproc, r.batch, r.planned_for) in ablation
            )
            if modeled:  # the time model's own ratio, faint
                bx.plot(*zip(*modeled, strict=True), style, marker="x", color=color, lw=0.6, alpha=0.5)
    for mark, color, name in ((step_runs.PROBED_MARK, "C0", "probed"), (step_runs.H100_MARK, "C1", "h100")):
        bx.axhline(mark, color=color, lw=0.8, ls=":")
        bx.annotate(f"{name} mark {mark}", (1.0, mark), xycoords=("axes fraction", "data"), ha="right",
                    va="bottom", fontsize=8, color=color)  # fmt: skip
    bx.axhline(1.0, color="black", lw=0.6)
    bx.set(xscale="log", xlabel="batch per rank", ylabel="FlexShard step / row-wise ablation's")
    bx.set_title("FlexShard over its ablation: measured (o), modeled (x)")
    bx.set_xticks(sorted({r.batch for r in ours}), [str(b) for b in sorted({r.batch for r in ours})])
    bx.legend(fontsize=8)
    fig.tight_layout()
    study.save_figure(fig, path)


def steps_at(batch: int, steps: int) -> int:
    """Timed steps per round at ``batch`` per rank: ``steps`` at batch 1024, more at smaller batches (their
    steps are short and, on shared cores, noisier), at most 4x as many."""
    return max(steps, min(4 * steps, round(steps * 1024 / batch)))


def rounds_at(batch: int, rounds: int) -> int:
    """Rounds at ``batch`` per rank: ``rounds``, twice as many below batch 256, where :func:`steps_at`'s cap
    leaves a block shortest (32 steps of about 30 ms at batch 64 on 4 ranks here): there one slow block of
    the machine moved a strategy's ratio of medians by 4-7% (the studies of 2026-11-28, 4 ranks, batch 64:
    one block 1.34x its round's ablation). Twice the rounds halve a block's share of the steps; a Williams
    design over 4 strategies stays balanced over any multiple of 4 rounds."""
    return 2 * rounds if batch < 256 else rounds


def error_summary(rows: list[step_runs.Row]) -> str:
    """One line per strategy: the model's error range over the rows (each row's median over runs), and
    how many are within 20%; then the count over every row."""
    lines, every = [], 0
    for label in dict.fromkeys(r.label for r in rows):
        errors = [r.median("errors") for r in rows if r.label == label]
        within = sum(abs(e) <= step_runs.WITHIN for e in errors)
        every += within
        lines.append(
            f"- {label}: model error {min(errors):+.0%} to {max(errors):+.0%}; within 20% in {within} of "
            f"{len(errors)} rows"
        )
    lines.append(f"- every strategy: within 20% in {every} of {len(rows)} rows")
    return "\n".join(lines)


def modeled() -> str:
    """Part 2's table: the default workload at scale, every strategy's modeled step split, under each of
    :data:`HOSTS` (its plans made for those rates)."""
    workload = workloads.default_workload()
    table = []
    for host, rates in HOSTS:
        for preset, gpus in SCALES:
            view = cluster_view(from_preset(preset))
            steps = {}
            for label, strategy, dedup, schedule in STRATEGIES:
                stages = schedule(view) if schedule else None
                budget = budget_bytes(workload, view, BUDGET_X if strategy == "flexshard" else 1.0)
                cfg = OptimizerConfig(rates=rates)
                plan = make_plan(strategy, workload, view, budget, dedup=dedup, config=cfg).plan
                plain = step_time(workload, view, plan, rates=rates, stages=stages)
                # pipelined: the plan made for the pipelined step (plan --pipeline on), priced pipelined;
                # another implementation's row-wise plan has no replica sync to overlap: its plain step
                piped = plain
                if not stages:
                    overlap = replace(cfg, overlap=True)
                    piped = make_plan(strategy, workload, view, budget, dedup=dedup, config=overlap).step
                steps[label] = (plain, piped, plan)
            ours = steps["FlexShard"][0]
            for label, (plain, piped, plan) in steps.items():
                comm = plain.latency_s + plain.bandwidth_s
                ours_comm = ours.latency_s + ours.bandwidth_s
                table.append(
                    [host, gpus, label, _structure(plan), plain.collectives]
                    + [f"{plain.latency_s * 1e3:.3f}", f"{plain.bandwidth_s * 1e3:.3f}"]
                    + [
                        f"{plain.local_s * 1e3:.3f}",
                        f"{plain.total_s * 1e3:.3f}",
                        f"{piped.total_s * 1e3:.3f}",
                    ]
                    + [f"{comm / ours_comm:.2f}x", f"{plain.total_s / ours.total_s:.2f}x"]
                    + [f"{piped.total_s / steps['FlexShard'][1].total_s:.2f}x"]
                )
    header = ["host work", "GPUs", "strategy", "plan", "collectives", "latency ms", "bandwidth ms"]
    header += ["local ms", "step ms", "pipelined ms", "communication vs FlexShard", "step vs FlexShard"]
    header += ["pipelined vs FlexShard"]
    return study.md_table(header, table, "lrllrrrrrrrrr")


def _structure(plan) -> str:
    """What a plan uses: replicated rows (hot, warm) and the group fetch, or 'flat' for neither."""
    hot = sum(tp.hot_rows for tp in plan.tables)
    warm = sum(tp.warm_rows for tp in plan.tables)
    parts = [f"{hot:,} hot" if hot else "", f"{warm:,} warm" if warm else ""]
    parts.append("group fetch" if plan.cold_fetch(FetchMode.GROUP) else "")
    return ", ".join(p for p in parts if p) or "flat"


def main() -> None:
    args = study.arguments(__doc__, quick="two batch sizes, fewer steps")
    args.add_argument(
        "--no-measure", action="store_true", help="part 2 only (the model at scale), printed, not written"
    )
    args.add_argument("--batches", help=f"batches per rank, comma-separated (default {BATCHES})")
    args.add_argument(
        "--steps",
        type=int,
        help="timed steps per round at batch 1024, up to 4x more at smaller ones (default 8; --quick 4)",
    )
    args.add_argument("--rounds", type=int, help="rounds, 2x below batch 256 (default 3; --quick 2)")
    args.add_argument(
        "--runs",
        type=int,
        default=1,
        help="passes over every configuration, one after the other (default 1); step_time.json gets every "
        "record of part 1 (tiers, shares, each rank's step) as each run ends",
    )
    args.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        metavar="JSON",
        help="part 1 from these files' records (step_time.json of earlier runs, each file's runs after the "
        "previous file's) instead of measuring",
    )
    args = args.parse_args()
    if args.runs < 1:
        raise SystemExit(f"step_time: --runs {args.runs}: expected at least 1")
    default = QUICK_BATCHES if args.quick else BATCHES
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else default
    steps = args.steps or (4 if args.quick else 8)
    rounds = args.rounds or (2 if args.quick else 3)
    start = time.time()
    parts = ["## 2. The model at scale (embedded default, NCCL presets)\n", modeled()]
    records: list[dict] = []
    if args.sources:
        records = read_runs(args.sources)
    elif not args.no_measure:
        commit = study.commit()
        for run in range(args.runs):
            started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            print(f"run {run + 1} of {args.runs}", file=sys.stderr)
            records += step_runs.tagged(measure_run(batches, steps, rounds), run, started, commit)
            if not args.no_write:  # every finished run kept: a stopped study is read back with --from
                study.write_markdown(study.RESULTS / "step_time.json", records_json(records))
    if records:
        parts = ["## 1. Measured against modeled (gloo over loopback)\n", measured_table(records), "", *parts]
    text = "\n".join(parts)
    print(text)
    if not (args.no_write or args.no_measure):  # the file holds both parts
        flags = ["--quick"] if args.quick else []
        flags += [f"--batches {args.batches}"] if args.batches else []
        flags += [f"--steps {args.steps}"] if args.steps else []
        flags += [f"--rounds {args.rounds}"] if args.rounds else []
        flags += [f"--runs {args.runs}"] if args.runs > 1 else []
        flags += ["--from", *args.sources] if args.sources else []
        cmd = study.command(__file__, *flags)
        detail = ""
        if args.sources:  # the time is the reading's; the runs are named by their start and commit
            names = [step_runs.run_name(r) for r in step_runs.runs(records)]
            detail = f"part 1 read back from the records of {len(names)} run(s) started {', '.join(names)}"
        head = f"# Step time\n\n{study.generated(cmd, time.time() - start, detail)}\n\n{METHOD}\n\n"
        if records:  # part 1 as a plot too
            figure(step_runs.rows(records), study.RESULTS / "step_time.png")
            head += "![Modeled against measured steps; FlexShard over its ablation](step_time.png)\n\n"
        study.write_markdown(study.RESULTS / "step_time.md", head + text)


def records_json(records: list[dict]) -> str:
    """Part 1's records as a JSON list, one record a line."""
    return "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]"


def read_runs(paths: list[str]) -> list[dict]:
    """The records of the files ``paths`` (each a JSON list of part 1's records), each file's runs
    numbered after the previous file's. A file that is not such a list is a SystemExit naming it."""
    records: list[dict] = []
    for path in paths:
        try:
            got = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"step_time: --from {path}: {e}") from None
        if not isinstance(got, list) or not all(isinstance(r, dict) and "step_ms_median" in r for r in got):
            raise SystemExit(f"step_time: --from {path}: expected a list of step_time.json records")
        first = len(step_runs.runs(records)) if records else 0
        records += [{**r, "run": first + int(r.get("run", 0))} for r in got]
    return records


if __name__ == "__main__":
    main()
