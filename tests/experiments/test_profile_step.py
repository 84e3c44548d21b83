"""experiments/profile_step.py runs end to end on 2 spawned gloo ranks (a small batch): its ``--ops`` report
has the per-op table with a column per strategy, and the ops per step by phase, which add up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ops_report_of_two_strategies():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["--nproc", "2", "--groups", "2", "--batch", "8", "--steps", "2", "--warmup", "1"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "profile_step.py"), *args, "--ops"]
        + ["--only", "row_wise,row_wise_group_dedup"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = done.stdout
    assert "== thread CPU by op, rank 0, ms per step over 2 steps" in out
    header = next(line for line in out.splitlines() if line.startswith("op "))
    assert header.split()[1:] == ["row_wise", "row_wise_group_dedup"]
    # per strategy: the total ops a step, then its phases' counts, which sum to it
    for key in ("row_wise", "row_wise_group_dedup"):
        line = next(line for line in out.splitlines() if line.startswith(f"  {key}: "))
        total, parts = re.match(rf"  {key}: ([\d.]+) \((.*)\)", line).groups()
        counts = [float(p.rsplit(" ", 1)[1]) for p in parts.split(", ")]
        assert sum(counts) == pytest.approx(float(total)) and "model" in parts
    assert "scatter" in next(line for line in out.splitlines() if line.startswith("  row_wise_group_dedup: "))
