"""CSV stats benchmark: `flexshard stats` on a ``user,item,timestamp`` CSV with a header.

Writes a synthetic log of ``--interactions`` rows block by block with ``pyarrow.csv`` (users uniform over
interactions / 100 ids, items Zipf-like over interactions / 50 ids, times increasing with jitter), once
with integer ids and once with string ids (``U<hex>`` users, ``P<hex>`` items: mapped through the
vocabulary). Runs ``flexshard stats`` on each in a child process (counting pass, then the touch rates
over per-user histories in time order: in memory up to 256 MiB of text, grouped on disk past it) and
prints wall time and the child's peak resident memory (``ru_maxrss``) against the 2 GiB target. Run:

    .venv/bin/python experiments/bench_csv_stats.py [--interactions 1e7]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import study
from bench_parquet_stats import TARGET_PEAK_BYTES, run_stats

from flexshard.report import human_bytes

BLOCK = 1_000_000


def write_csv(path: Path, interactions: int, strings: bool, seed: int = 0) -> None:
    """The synthetic log as CSV, one block of rows at a time (memory: one block)."""
    rng = np.random.default_rng(seed)
    users, items = max(interactions // 100, 1), max(interactions // 50, 1)
    cdf = np.cumsum(1.0 / np.arange(1, items + 1))
    cdf /= cdf[-1]
    scatter = rng.permutation(items)
    with pacsv.CSVWriter(path, pa.schema([("user", pa.string() if strings else pa.int64()),
                                          ("item", pa.string() if strings else pa.int64()),
                                          ("timestamp", pa.int64())])) as writer:  # fmt: skip
        for start in range(0, interactions, BLOCK):
            n = min(BLOCK, interactions - start)
            u = pa.array(rng.integers(0, users, n))
            i = pa.array(scatter[np.minimum(np.searchsorted(cdf, rng.random(n)), items - 1)])
            t = pa.array(1_600_000_000 + (start + np.arange(n)) * 10 + rng.integers(0, 10_000, n))
            if strings:
                u = pc.binary_join_element_wise("U", pc.cast(u, pa.string()), "")
                i = pc.binary_join_element_wise("P", pc.cast(i, pa.string()), "")
            writer.write_table(pa.table({"user": u, "item": i, "timestamp": t}))


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, write=False)
    p.add_argument("--interactions", type=float, default=1e7, help="rows of the log (default 1e7)")
    args = p.parse_args(argv)
    interactions = int(args.interactions)
    rows, peaks = [], []
    with tempfile.TemporaryDirectory(prefix="bench-csv-stats-") as tmp:
        for strings in (False, True):
            log = Path(tmp) / f"log-{'strings' if strings else 'ints'}.csv"
            print(f"writing {interactions:,} interactions to {log} ...", file=sys.stderr)
            write_csv(log, interactions, strings)
            print(f"flexshard stats {log.name} ...", file=sys.stderr)
            wall, peak, output = run_stats(log, Path(tmp) / "stats.npz")
            fingerprint = output.strip().splitlines()[-1].rpartition("fingerprint ")[2].rstrip(")")
            ids = "strings (vocabulary)" if strings else "integers"
            rows.append(
                [ids, human_bytes(log.stat().st_size), f"{wall:.1f}", f"{peak / 2**30:.2f}", fingerprint]
            )
            peaks.append(peak)
            log.unlink()
    print(
        f"`flexshard stats` on a user,item,timestamp CSV of {interactions:,} rows, "
        f"{os.cpu_count()} CPU cores\n"
    )
    print(study.md_table(["ids", "file", "wall s", "peak RSS GiB", "fingerprint"], rows, align="llrrl"))
    ok = max(peaks) <= TARGET_PEAK_BYTES
    print(f"\n{'PASS' if ok else 'FAIL'}: peak RSS {max(peaks) / 2**30:.2f} GiB, target <= 2 GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
