"""Parquet stats benchmark: `flexshard stats` on an interaction log of 10^8 rows in Parquet.

Writes a synthetic log of ``--interactions`` rows (int64 columns ``user``, ``item``, ``time``), one row
group at a time (the log is never whole in memory): users uniform over interactions / 100 ids in
random order (the file is not sorted by user), items Zipf-like (exponent 1) over interactions / 50 ids
with the hot ids scattered, times increasing with the row plus jitter (so a user's rows are not all in
time order). Then runs ``flexshard stats`` on it in a child process, with ``--time-col time
--max-len 50`` and without them; either run counts rows in one streaming pass and measures touch
rates (the default, next-item samples with window 20 and 4 negatives) over per-user histories from the
external group-by of ``parquet_histories``, and prints each run's wall time and the child's peak
resident memory (``ru_maxrss`` from ``wait4``) against the 2 GiB target. Run:

    .venv/bin/python experiments/bench_parquet_stats.py [--interactions 1e8] [--log PATH]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import study

from flexshard.report import human_bytes
from flexshard.workloads.parquet import ParquetLogWriter

TARGET_PEAK_BYTES = 2 * 2**30
ZIPF_ALPHA = 1.0


def write_log(path: Path, interactions: int, row_group: int, seed: int = 0) -> None:
    """Write the synthetic log to ``path`` row group by row group (memory: one row group and the
    item distribution, 16 bytes per item id)."""
    rng = np.random.default_rng(seed)
    users, items = max(interactions // 100, 1), max(interactions // 50, 1)
    cdf = np.cumsum(1.0 / np.arange(1, items + 1) ** ZIPF_ALPHA)
    cdf /= cdf[-1]
    scatter = rng.permutation(items)  # hotness rank -> item id
    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".partial")
    with ParquetLogWriter(tmp, time=True) as writer:
        for start in range(0, interactions, row_group):
            n = min(row_group, interactions - start)
            u = rng.integers(0, users, n)
            i = scatter[np.minimum(np.searchsorted(cdf, rng.random(n)), items - 1)]
            t = (start + np.arange(n)) * 10 + rng.integers(0, 10_000, n)  # jitter over ~1000 rows
            writer.write(u, i, t)
            done = start + n
            if done == interactions or (start // row_group) % 10 == 9:
                rate = done / (time.perf_counter() - t0)
                print(
                    f"  wrote {done:,} / {interactions:,} rows ({rate / 1e6:.1f} M rows/s)", file=sys.stderr
                )
    tmp.replace(path)


def run_stats(log: Path, out: Path, *flags: str) -> tuple[float, int, str]:
    """Run ``flexshard stats`` in a child process: ``(wall s, peak RSS bytes, its output)``."""
    cmd = [sys.executable, "-m", "flexshard.cli", "stats", str(log), *flags, "--out", str(out)]
    with tempfile.TemporaryFile("w+") as text:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=study.ROOT, stdout=text, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN adds up)
        wall = time.perf_counter() - t0
        child.returncode = os.waitstatus_to_exitcode(status)
        text.seek(0)
        output = text.read()
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {child.returncode}:\n{output}")
    return wall, usage.ru_maxrss * 1024, output  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, write=False)
    p.add_argument("--interactions", type=float, default=1e8, help="rows of the log (default 1e8)")
    p.add_argument("--log", type=Path, help="the log to use; written there first when it does not exist")
    p.add_argument("--row-group", type=int, default=1_000_000, help="rows per row group (default 1e6)")
    args = p.parse_args(argv)
    interactions = int(args.interactions)
    rows, peaks = [], []
    with tempfile.TemporaryDirectory(prefix="bench-parquet-stats-") as tmp:
        log = args.log or Path(tmp) / f"log-{interactions}.parquet"
        if log.exists():
            print(f"using {log}", file=sys.stderr)
        else:
            print(f"writing {interactions:,} interactions to {log} ...", file=sys.stderr)
            t0 = time.perf_counter()
            write_log(log, interactions, args.row_group)
            print(f"  {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        size = log.stat().st_size
        for flags in (["--time-col", "time", "--max-len", "50"], []):
            label = " ".join(flags) or "(no flags: every item)"
            print(f"flexshard stats {label} ...", file=sys.stderr)
            wall, peak, output = run_stats(log, Path(tmp) / "stats.npz", *flags)
            fingerprint = output.strip().splitlines()[-1].rpartition("fingerprint ")[2].rstrip(")")
            rows.append([label, f"{wall:.1f}", f"{peak / 2**30:.2f}", fingerprint])
            peaks.append(peak)
    print(
        f"`flexshard stats` on a Parquet log of {interactions:,} interactions ({human_bytes(size)}), "
        f"{os.cpu_count()} CPU cores\n"
    )
    print(study.md_table(["flags", "wall s", "peak RSS GiB", "fingerprint"], rows, align="lrrl"))
    ok = max(peaks) <= TARGET_PEAK_BYTES
    verdict = "PASS" if ok else "FAIL"
    print(
        f"\n{verdict}: peak RSS {max(peaks) / 2**30:.2f} GiB, target <= {TARGET_PEAK_BYTES / 2**30:.0f} GiB"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
