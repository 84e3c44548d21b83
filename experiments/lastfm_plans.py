"""Plans from measured touch rates vs independent draws, run side by side on lastfm (repeat consumption).

The cost model can price a batch two ways: as independent draws from the rows' access probabilities
(``flexshard stats --touch-rates off``), or from each row's measured per-sample touch rate under
training's own sampler (the default for a history file). On repeat-consumption data the two disagree
(users replay the same items, so a batch touches far fewer distinct rows than independent draws would),
and so do the plans made from them. This study makes both plans for the same cluster and budget, runs
each with the runtime beside row-wise (TorchRec's layout on lastfm's real ids), and reports what the
runtime measured against what each plan promised.

Steps, all with the CLI a user would type (``repeat-consumption-uci/lastfm/test.csv`` under
:func:`flexshard.workloads.data_root`):

1. ``flexshard stats DATA --dim 16 --touch-rates off`` and ``flexshard stats DATA --dim 16`` (measured,
   next-item samples with train's default window 20 and 4 negatives);
2. ``flexshard plan --topology h100:2x2 --budget 2 --batch-size 64 --objective bytes`` on each (4 GPUs in
   2 NVLink groups; this is a study of bytes, so the plans minimise the modeled inter-group bytes, not the
   step), and ``--strategy row_wise`` on the measured stats;
3. ``torchrun --standalone --nproc-per-node 4 -m flexshard.train --data DATA --plan P --groups 2
   --batch-size 64 --metrics-out M``, once per plan, same seed and batches (gloo on CPU).

Bytes are the runtime's counters per step (send side of every all-to-all; sync as the model's all-reduce
of the realised payload), "busiest" the busiest rank's inter-group bytes, averaged over steps.

Writes docs/results/lastfm_plans.md. Run from the repository root:

    .venv/bin/python experiments/lastfm_plans.py [--quick] [--steps N] [--no-write]

``--quick``: 20 steps instead of 100.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import study

from flexshard import workloads

DATA = Path("repeat-consumption-uci") / "lastfm" / "test.csv"
NPROC, GROUPS, BATCH, DIM, SEED = 4, 2, 64, 16, 0
TOPOLOGY, BUDGET = "h100:2x2", 2.0
STEPS, QUICK_STEPS = 100, 20
PLANS = (  # label, stats (touch rates), strategy
    ("row-wise (TorchRec layout)", "measured", "row_wise"),
    ("FlexShard, independent-draw stats", "off", "flexshard"),
    ("FlexShard, measured touch rates", "measured", "flexshard"),
)


@dataclass
class Run:
    label: str
    plan: dict  # the plan file
    steps: list[dict]  # metrics records of kind "step"
    seconds: float
    row_wise_predicted: float  # row-wise's predicted busiest inter-group bytes on the same statistics

    def measured(self, link: str, stat: str) -> float:
        """Mean over steps of the bytes per rank on ``link`` (``stat``: "max" = busiest rank, "mean")."""
        return float(np.mean([r["bytes"][link][stat] for r in self.steps]))

    @property
    def predicted_inter(self) -> float:
        return float(self.plan["predicted"]["inter_group_bytes"])

    def tiers(self) -> str:
        return ", ".join(
            f"{t['name']} {t['hot_rows']:,}/{t['warm_rows']:,}/{t['cold_rows']:,}"
            for t in self.plan["tables"]
        )


def flexshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "flexshard.cli", *args]


def check_call(argv: list[str], what: str) -> str:
    """Run ``argv``; its stdout (exit with the tail of stderr when it fails)."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=study.cpu_job_env())
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-10:])
        raise SystemExit(f"lastfm_plans: {what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def train(data: Path, plan: Path, steps: int, metrics: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        "-m",
        "flexshard.train",
        *("--data", str(data), "--plan", str(plan), "--groups", str(GROUPS)),
        *("--batch-size", str(BATCH), "--dim", str(DIM), "--steps", str(steps), "--seed", str(SEED)),
        *("--metrics-out", str(metrics)),
    ]


def run_all(data: Path, steps: int, tmp: Path) -> list[Run]:
    stats = {}
    for kind, extra in (("off", ["--touch-rates", "off"]), ("measured", [])):
        stats[kind] = tmp / f"stats-{kind}.npz"
        print(f"stats ({kind}) ...", file=sys.stderr, flush=True)
        check_call(
            flexshard("stats", str(data), "--dim", str(DIM), *extra, "--out", str(stats[kind])), "stats"
        )

    def make_plan(kind: str, strategy: str, path: Path) -> dict:
        argv = flexshard(
            "plan",
            *("--workload", str(stats[kind]), "--topology", TOPOLOGY, "--budget", f"{BUDGET:g}"),
            *("--batch-size", str(BATCH), "--strategy", strategy, "--objective", "bytes"),
            *("--out", str(path)),
        )
        check_call(argv, f"plan ({strategy}, {kind} statistics)")
        return json.loads(path.read_text())

    row_wise = {kind: make_plan(kind, "row_wise", tmp / f"row_wise-{kind}.json") for kind in stats}
    runs = []
    for i, (label, kind, strategy) in enumerate(PLANS):
        plan = tmp / f"plan-{i}.json"
        make_plan(kind, strategy, plan)
        metrics = tmp / f"metrics-{i}.jsonl"
        print(f"[{i + 1}/{len(PLANS)}] {label}: training {steps} steps ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        check_call(train(data, plan, steps, metrics), f"train ({label})")
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        seconds = time.perf_counter() - start
        print(f"[{i + 1}/{len(PLANS)}] done in {seconds:.0f} s", file=sys.stderr, flush=True)
        steps_done = [r for r in records if r["kind"] == "step"]
        predicted = float(row_wise[kind]["predicted"]["inter_group_bytes"])
        runs.append(Run(label, json.loads(plan.read_text()), steps_done, seconds, predicted))
    return runs


def report(runs: list[Run], steps: int, seconds: float, quick: bool) -> str:
    base = runs[0]

    def cut(r: Run, which: str) -> float:
        """The inter-group cut of ``r`` against row-wise at the busiest rank, predicted or realised."""
        if which == "predicted":
            return 1 - r.predicted_inter / r.row_wise_predicted
        return 1 - r.measured("inter_group", "max") / base.measured("inter_group", "max")

    rows = []
    for r in runs:
        busiest, mean = r.measured("inter_group", "max"), r.measured("inter_group", "mean")
        rows.append(
            (
                r.label,
                r.tiers(),
                f"{r.predicted_inter / 1e3:,.1f}",
                f"{busiest / 1e3:,.1f}",
                f"{busiest / r.predicted_inter:.2f}x",
                f"{mean / 1e3:,.1f}",
                "-" if r is base else f"{cut(r, 'predicted'):.1%}",
                "-" if r is base else f"{cut(r, 'realised'):.1%}",
            )
        )
    header = (
        "plan",
        "tiers hot/warm/cold",
        "predicted inter KB (busiest)",
        "measured inter KB (busiest)",
        "measured / predicted",
        "measured inter KB (mean over ranks)",
        "predicted cut vs row-wise (same statistics)",
        "realised cut vs row-wise",
    )
    cmd = study.command(__file__, *(["--quick"] if quick else []))
    lines = [
        "# Plans from measured touch rates vs independent draws (lastfm, runtime)",
        "",
        study.generated(cmd, seconds, f"{steps} steps per run"),
        "",
        f"Data: `{DATA}` (repeat consumption: users replay the same artists). {NPROC} gloo ranks on CPU as "
        f"{GROUPS} emulated NVLink groups, planned for `{TOPOLOGY}` at {BUDGET:g}x row-wise memory "
        "by the bytes objective (`plan --objective bytes`: a study of bytes), "
        f"{BATCH} samples per rank per step (next-item samples: window 20, 4 negatives, as `train` "
        "forms them), per-rank dedup on, dim 16, the same seed and batches in every run.",
        "",
        study.md_table(header, rows, "llrrrrrr"),
        "",
        f"Row-wise priced on the independent-draw statistics: {runs[1].row_wise_predicted / 1e3:,.1f} KB at "
        f"the busiest rank (the runtime: {base.measured('inter_group', 'max') / 1e3:,.1f} KB).",
        "",
        "Reading. The plan made from independent-draw statistics prices a batch as if its ids were drawn "
        "independently, which on repeat-consumption histories over-counts the distinct rows a batch "
        "touches (row-wise itself is priced at "
        f"{runs[1].row_wise_predicted / base.measured('inter_group', 'max'):.0f}x what it moves): it "
        f"promised a {cut(runs[1], 'predicted'):.1%} cut against row-wise and sized its tiers for it; "
        f"the runtime realised {cut(runs[1], 'realised'):+.1%}. The plan made from measured touch "
        "rates promised "
        f"{cut(runs[2], 'predicted'):.1%} and realised {cut(runs[2], 'realised'):.1%}: at this batch "
        "few rows are shared enough between samples to be worth replicating, and the measured plan "
        "knows it.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick=f"{QUICK_STEPS} steps instead of {STEPS}")
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {STEPS})")
    args = p.parse_args(argv)
    data = workloads.data_root() / DATA
    if not data.is_file():
        study.note_missing(data, "lastfm_plans")
        return 0
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = run_all(data, steps, Path(tmp))
    text = report(runs, steps, time.perf_counter() - start, args.quick)
    print(text)
    if not args.no_write:
        study.write_markdown(study.RESULTS / "lastfm_plans.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
