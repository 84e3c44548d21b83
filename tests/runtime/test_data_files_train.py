"""Issue 22's "done when" on two ranks: a ``user,item,timestamp`` CSV with a header (integer ids, and
string ids through the stats file's vocabulary) through ``flexshard stats``, ``flexshard plan`` on
``h100:1x2`` and training with the plan; a vocabulary from other data stops both ranks with one line."""

from __future__ import annotations

import numpy as np
import pytest
from train_workers import run_main

from flexshard.cli import main as cli

pytestmark = pytest.mark.slow  # spawned ranks


def _csv(path, codes: bool, reverse: bool = False):
    rng = np.random.default_rng(5)
    users, items = rng.integers(0, 60, 2000), rng.zipf(1.3, 2000) % 300
    times = rng.integers(1_600_000_000, 1_700_000_000, 2000)
    rows = [
        (f"U{u}" if codes else u, f"P{i:04x}" if codes else i, t)
        for u, i, t in zip(users.tolist(), items.tolist(), times.tolist(), strict=True)
    ]
    rows = rows[::-1] if reverse else rows
    path.write_text("user,item,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    return path


def test_csv_through_stats_plan_and_two_rank_training(tmp_path):
    calls, expect = [], []
    for tag, codes in (("ints", False), ("codes", True)):
        data = _csv(tmp_path / f"{tag}.csv", codes)
        npz, plan = tmp_path / f"{tag}.npz", tmp_path / f"{tag}.json"
        assert cli(["stats", str(data), "--dim", "16", "--out", str(npz)]) == 0
        assert cli(["plan", "--workload", str(npz), "--topology", "h100:1x2", "--batch-size", "16",
                    "--out", str(plan)]) == 0  # fmt: skip
        base = ["--data", str(data), "--plan", str(plan), "--steps", "3", "--quiet"]
        calls.append(([*base, "--verify", *(["--vocab", str(npz)] if codes else [])], None))
        expect.append(0)
    other = _csv(tmp_path / "other.csv", True, reverse=True)
    assert cli(["stats", str(other), "--dim", "16", "--out", str(tmp_path / "other.npz")]) == 0
    calls.append(
        (["--data", str(tmp_path / "codes.csv"), "--plan", str(tmp_path / "codes.json"), "--steps", "1",
          "--vocab", str(tmp_path / "other.npz")], None)
    )  # fmt: skip
    expect.append(2)
    ranks = run_main(2, calls, tmp_path / "run", timeout_s=120)
    for i, rc in enumerate(expect):
        assert [ranks[r][i]["rc"] for r in range(2)] == [rc, rc], [ranks[r][i]["err"] for r in range(2)]
    for i in (0, 1):
        assert "verify: OK (3 steps" in ranks[0][i]["out"]
    err = ranks[0][2]["err"]
    assert err.startswith("flexshard train: error: --plan was made from data whose string ids map to rows by")
    assert err.count("\n") == 1 and ranks[1][2]["err"] == ""
