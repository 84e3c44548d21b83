"""``--verify`` over data sets, precisions, optimizers, dims and learning rates: no false failure, and how
close each run came to the tolerance.

Each cell is one ``torchrun --standalone --nproc-per-node 4 -m flexshard.train --groups 2 --verify``
job (gloo on CPU, 2 emulated groups of 2, batch 256 per rank, ``--steps`` steps, seed 0). ``--verify``
checks every step against an unsharded reference from the run's state (replicas bitwise equal; logits,
the dense gradient and each table's row and accumulator updates in the 2-norm within 16 unit roundoffs
of the wire dtype: the updates relative to their condition, plus float32 summation order and storage
rounding; see flexshard/training/verify.py) and prints its closest call: the largest difference in unit
roundoffs. A cell shows that figure, or FAILED with the run's line.

Grids (``--grid``):

* ``data``: every data set of user histories under :func:`flexshard.workloads.data_root` that is
  present, and the synthetic data, at fp32 and lr 0.05: Adagrad at dim 64 (the default) and 128 (the
  widest rows, where Adagrad amplifies summation order most), SGD at dim 16;
* ``precision``: synthetic data and Amazon Beauty at fp32/bf16/fp16 x SGD/Adagrad x dim 16/64/128;
* ``lr``: synthetic data and Amazon Beauty, Adagrad dim 64 fp32 and bf16, lr 0.01, 0.05, 0.2, 0.5.

Writes docs/results/verify_grid.md (one table per grid run). Progress goes to stderr. Run:

    .venv/bin/python experiments/verify_grid.py [--grid data,precision,lr] [--steps 200] [--quick]
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass

import study

from flexshard import workloads

NPROC, GROUPS, BATCH, SEED = 4, 2, 256, 0
BEAUTY = "amazon-yelp-sequences/Beauty.txt"
LARGEST = re.compile(r"verify: largest difference ([0-9.]+) of the 16 unit roundoffs allowed \((.+)\)")


@dataclass(frozen=True)
class Cell:
    data: str  # a data set name, or "synthetic"
    path: str | None  # under data_root(); None for the synthetic data
    wire: str = "fp32"
    optimizer: str = "adagrad"
    dim: int = 64
    lr: float = 0.05


def grid_cells(grid: str) -> list[Cell]:
    root = workloads.data_root()
    if grid == "data":
        sets = [("synthetic", None)] + [
            (n, p)
            for n, p in study.HISTORY_DATA_SETS
            if (root / p).exists() or study.note_missing(root / p, n)
        ]
        return [
            c for n, p in sets for c in (Cell(n, p), Cell(n, p, dim=128), Cell(n, p, optimizer="sgd", dim=16))
        ]
    pair = [("synthetic", None)] + ([("beauty", BEAUTY)] if (root / BEAUTY).exists() else [])
    if grid == "precision":
        return [
            Cell(n, p, w, o, d)
            for n, p in pair
            for w in ("fp32", "bf16", "fp16")
            for o in ("sgd", "adagrad")
            for d in (16, 64, 128)
        ]
    if grid == "lr":
        return [
            Cell(n, p, w, lr=lr) for n, p in pair for w in ("fp32", "bf16") for lr in (0.01, 0.05, 0.2, 0.5)
        ]
    raise SystemExit(f"verify_grid: --grid: unknown {grid!r}; choose from data, precision, lr")


def run_cell(cell: Cell, steps: int) -> tuple[str, str]:
    """(the cell's figure or FAILED, what came closest / the failure line)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
            "-m", "flexshard.train", "--groups", str(GROUPS), "--verify", "--quiet", "--steps", str(steps),
            "--batch-size", str(BATCH), "--seed", str(SEED), "--wire-dtype", cell.wire, "--optimizer",
            cell.optimizer, "--dim", str(cell.dim), "--lr", str(cell.lr)]  # fmt: skip
    if cell.path:
        argv += ["--data", str(workloads.data_root() / cell.path)]
    done = subprocess.run(argv, capture_output=True, text=True, env=study.cpu_job_env())
    found = LARGEST.search(done.stdout)
    if done.returncode == 0 and found:
        return f"{float(found.group(1)):.2f}", found.group(2)
    failed = [ln for ln in (done.stdout + done.stderr).splitlines() if "FAILED" in ln or "error:" in ln]
    return "FAILED", (failed[0] if failed else f"exit {done.returncode}")


def main() -> int:
    p = study.arguments(__doc__, quick="20 steps, the first 4 cells of each grid")
    p.add_argument("--grid", default="data,precision,lr", help="comma-separated: data, precision, lr")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    steps = 20 if args.quick else args.steps
    t0, sections, failures = time.monotonic(), [], 0
    for grid in args.grid.split(","):
        cells = grid_cells(grid)[: 4 if args.quick else None]
        rows = []
        for i, cell in enumerate(cells, 1):
            t = time.monotonic()
            figure, detail = run_cell(cell, steps)
            failures += figure == "FAILED"
            rows.append([cell.data, cell.wire, cell.optimizer, cell.dim, f"{cell.lr:g}", figure, detail])
            took = time.monotonic() - t
            print(
                f"  {grid} {i}/{len(cells)}: {' '.join(map(str, rows[-1][:6]))} ({took:.0f} s)",
                file=sys.stderr,
            )
        table = study.md_table(["data", "wire", "optimizer", "dim", "lr", "largest (of 16)", "closest call"],
                               rows, "lllrrrl")  # fmt: skip
        sections.append(f"## Grid `{grid}`\n\n{table}")
        print(sections[-1] + "\n")
    seconds = time.monotonic() - t0
    text = "\n\n".join(
        [
            "# `--verify`: no false failure, and how close each run came",
            study.generated(study.command(__file__, *sys.argv[1:]), seconds),
            f"{NPROC} ranks in {GROUPS} groups (torchrun, gloo on CPU), batch {BATCH} per rank, "
            f"{steps} steps, seed 0. Each figure is the largest normwise difference from the reference "
            "over every step, rank and check, in unit roundoffs of the wire dtype (its share of the "
            "allowance x 16; the allowance also holds float32 storage rounding). A run fails at 16. "
            f"{'No run failed.' if not failures else f'{failures} runs FAILED.'}",
            *sections,
        ]
    )
    if not args.no_write and not args.quick:
        study.write_markdown(study.RESULTS / "verify_grid.md", text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
