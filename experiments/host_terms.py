"""How the runtime's host work grows with the tables, and the host terms fitted to it.

Part 1 (``--measure``) runs ``flexshard bench --json`` (4 ranks in 2 groups at batch 128 and 512; 8
ranks at 256 for 1 and 9 tables; plans for the H100 shape, so the group fetch is among the plans; no
TorchRec, whose prediction has no host term) on workloads of 1, 2, 3, 6 and 9 tables that share 225 ids
per sample and 150,000 rows of dim 64 evenly (the same lookups and rows, more tables), then on the stats
files of Yelp, Gowalla and Amazon Beauty (``flexshard stats`` of ../shared/data, 4 ranks at 128 and 512)
and the bench's default tables at 128. Every record goes to docs/results/host_terms.json, tagged with
its workload.

Part 2 fits ``step_s + stage_s x collectives`` (``experiments/calibrate_host.py``
``fit_host_to_bench``) to those records and the step_time study's that were priced with the same rates
(its first two runs of 2026-12-07, 03:33 and 06:36 UTC: docs/results/host_terms_study.json, kept apart
from step_time.json, which every study run rewrites), priced with the
rates both were priced with (``--priced-with``, default docs/results/host_terms_rates.json: the stored
rates until 2026-12-07, host work ``step_s + table_stage_s x tables x collectives``), and prints, per
workload, the model's error before and after: the host terms of :data:`solvers.time_types.DEFAULT_RATES`
are this fit. Records priced with other rates are fitted apart. Run:

    nice .venv/bin/python experiments/host_terms.py [--measure] [--priced-with RATES.json]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import study  # noqa: E402
from calibrate_host import fit_host_to_bench, priced_with  # noqa: E402

from solvers.time_types import LocalRates  # noqa: E402

METHOD = """The host work of the runtime's step, the part of the time model fitted to measured steps rather
than measured piece by piece, is ``step_s + stage_s x collectives`` at each run's ranks per core: no
term per table. Part 1's records are `flexshard bench --json` runs of this machine (4 ranks in 2 groups
at batch 128 and 512, 8 ranks at 256 on 1 and 9 tables; plans for the H100 shape) on workloads of 1, 2,
3, 6 and 9 tables sharing 225 ids per sample and 150,000 rows, on the stats files of Yelp, Gowalla and
Amazon Beauty, and on the bench's default tables; the records of 2026-12-07 were taken by hand, 12:30 to
12:55 UTC, with the settings `--measure` uses (3 rounds of 8 timed steps; Beauty and the default tables
at 128 with 10, the 8-rank runs with 6; the real data sets with TorchRec beside, whose rows are not
fitted). The fit adds the 144 runtime rows of the study runs of the same day priced with the same
rates, its first two ([step_time.md](step_time.md); the third was priced with the fitted terms).
"error": each record's prediction over its measured median step, minus one, with the terms it was
priced with ("before": ``step_s + table_stage_s x tables x collectives``,
1.218 ms and 0.5392 ms) and with the fitted ones ("after"). At the same lookups and rows the measured
steps on 1 to 9 tables are within 8% of each other; the per-table term priced them from 20% low to 31%
high. The small real data sets at batch 128 (Beauty, Gowalla) stay up to 27% high: their host work is
less than the bench's tables' at the same collectives, which no term here follows (docs/limits.md)."""
RECORDS = study.RESULTS / "host_terms.json"
STUDY = study.RESULTS / "host_terms_study.json"  # step_time records of 2026-12-07 priced with PRICED_WITH
PRICED_WITH = study.RESULTS / "host_terms_rates.json"  # the rates both sets of records were priced with
TABLE_COUNTS = (1, 2, 3, 6, 9)
IDS_PER_SAMPLE = 225.0  # over all tables (the bench's default: 3 tables of 75)
ROWS = 150_000  # over all tables
DATA = study.ROOT.parent / "shared" / "data"
REAL = {  # stats-file name -> data file under ../shared/data
    "yelp": "amazon-yelp-sequences/Yelp.txt",
    "gowalla": "gowalla-lightgcn/train_reconstructed.txt",
    "beauty": "amazon-yelp-sequences/Beauty.txt",
}


def tables_workload(path: Path, tables: int) -> None:
    """A stats file of ``tables`` tables sharing :data:`IDS_PER_SAMPLE` and :data:`ROWS` evenly."""
    from flexshard.workloads import save_stats
    from flexshard.workloads.synthetic import head_rows_for, iteration_lookups, zipf_table
    from solvers.types import Workload

    m, rows = IDS_PER_SAMPLE / tables, ROWS // tables
    head = head_rows_for(rows, iteration_lookups(m, 128, 512))
    specs = tuple(zipf_table(f"t{i}", rows, 64, m, 0.87, 0.045, head_rows=head) for i in range(tables))
    orders = {t.name: np.random.default_rng(i).permutation(t.num_rows) for i, t in enumerate(specs)}
    save_stats(path, Workload(f"tables{tables}", specs, 512), orders)


def bench(workload: str, nproc: int, batch: int, tag: str) -> list[dict]:
    """One ``flexshard bench --json`` run's runtime records, tagged."""
    cmd = [sys.executable, "-m", "flexshard.cli", "bench", "--nproc", str(nproc), "--groups", "2"]
    cmd += ["--workload", workload, "--batch", str(batch), "--rounds", "3", "--steps", "8"]
    cmd += ["--plan-for", "h100", "--no-torchrec", "--json"]
    print(f"{tag}: {nproc} ranks, batch {batch}", file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=study.ROOT).stdout
    return [{**r, "workload": tag, "nproc": nproc, "batch": batch} for r in json.loads(out) if "plan" in r]


def measure() -> list[dict]:
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in TABLE_COUNTS:
            path = Path(tmp, f"t{n}.npz")
            tables_workload(path, n)
            for batch in (128, 512):
                records += bench(str(path), 4, batch, f"{n} tables")
            if n in (1, 9):
                records += bench(str(path), 8, 256, f"{n} tables")
        for name, data in REAL.items():
            if not (DATA / data).is_file():
                print(f"skipped {name}: {DATA / data} absent", file=sys.stderr)
                continue
            path = Path(tmp, f"{name}.npz")
            subprocess.run(
                [sys.executable, "-m", "flexshard.cli", "stats", str(DATA / data), "--out", str(path)],
                check=True,
                capture_output=True,
                cwd=study.ROOT,
            )
            for batch in (128, 512):
                records += bench(str(path), 4, batch, name)
    return records + bench("default", 4, 128, "default tables")


def report(records: list[dict], study_records: list[dict], stored: LocalRates) -> str:
    """The fit over ``records`` and ``study_records`` and, per workload, the error before and after."""
    fitted, table = fit_host_to_bench([*records, *study_records], stored)
    groups: dict[str, list[tuple[float, float]]] = {}
    tags = [r["workload"] for r in records if r.get("plan_tables")] + ["the study (bench tables)"] * (
        len(table) - sum(1 for r in records if r.get("plan_tables"))
    )
    for tag, (*_, measured, before, after) in zip(tags, table, strict=True):
        groups.setdefault(tag, []).append((before / measured - 1, after / measured - 1))
    rows = []
    for tag, errs in groups.items():
        b, a = np.array(errs).T
        within = [int(np.sum(abs(x) <= 0.2)) for x in (b, a)]
        rows.append(
            [
                tag,
                len(errs),
                f"{b.min():+.0%} to {b.max():+.0%}",
                within[0],
                f"{a.min():+.0%} to {a.max():+.0%}",
                within[1],
            ]
        )
    head = ["workload", "rows", "error before", "within 20%", "error after", "within 20%"]
    terms = (
        f"fitted: step_s {fitted.step_s * 1e3:.4g} ms, stage_s {fitted.stage_s * 1e3:.4g} ms a collective "
        f"(one rank per core; before: step_s {stored.step_s * 1e3:.4g} ms, stage_s "
        f"{stored.stage_s * 1e3:.4g} ms, table_stage_s {stored.table_stage_s * 1e3:.4g} ms a table"
        " a collective)"
    )
    return terms + "\n\n" + study.md_table(head, rows)


def main() -> None:
    args = study.arguments(__doc__)
    args.add_argument(
        "--measure", action="store_true", help="run part 1 (about 15 minutes), else read it back"
    )
    args.add_argument(
        "--priced-with", default=str(PRICED_WITH), help=f"the records' rates (default {PRICED_WITH.name})"
    )
    args = args.parse_args()
    start = time.time()
    stored = LocalRates.load(args.priced_with)
    if args.measure:
        records = measure()
        if not args.no_write:
            study.write_markdown(RECORDS, "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]")
    else:
        records = json.loads(RECORDS.read_text())
    study_records = [r for r in json.loads(STUDY.read_text()) if r.get("plan_tables")]
    text = report(records, [r for r in study_records if priced_with(r, stored)], stored)
    print(text)
    if not args.no_write:
        cmd = study.command(__file__, *(["--measure"] if args.measure else []))
        head = f"# Host terms\n\n{study.generated(cmd, time.time() - start)}\n\n{METHOD}\n\n"
        study.write_markdown(study.RESULTS / "host_terms.md", head + text + "\n")


if __name__ == "__main__":
    main()
