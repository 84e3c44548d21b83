"""``flexshard bench`` on a stats file, under torchrun, and interrupted by Ctrl-C (real processes)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_jobs import run_torchrun

from flexshard.bench.data import default_data
from flexshard.bench.plans import h100_view, make_plans
from flexshard.bench.worker import INTERRUPTED_LINE
from flexshard.cli import main
from tests.flexshard.cli_helpers import fails
from topology import write_json
from topology.presets import h100_cluster

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _stats_file(tmp_path: Path) -> Path:
    lines = [f"{u} " + " ".join(str((u * 7 + k * k) % 97) for k in range(3 + u % 11)) for u in range(200)]
    (tmp_path / "seq.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "seq.npz"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["stats", str(tmp_path / "seq.txt"), "--out", str(out), "--touch-rates", "off"]) == 0
    return out


@pytest.mark.slow  # spawns ranks
def test_a_stats_file_runs_every_strategy_on_its_tables(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    stats = _stats_file(tmp_path)
    out = io.StringIO()
    argv = ["bench", "--nproc", "2", "--groups", "2", "--steps", "1", "--rounds", "1", "--warmup", "0",
            "--batch", "8", "--workload", str(stats), "--json"]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    recs = json.loads(out.getvalue())
    assert [r["strategy"] for r in recs] == [
        "flexshard",
        "row_wise",
        "row_wise_group_dedup",
        "torchrec_row_wise",
    ]
    rows = sum(int(p.split("cold ")[1].split(" rows")[0].replace(",", "")) for p in [recs[1]["plan"]])
    assert rows == 97 + 200  # the file's tables: item ids 0..96 and 200 users, all cold in row-wise
    ran = [r for r in recs if "skipped" not in r]  # TorchRec's record says why where it is not installed
    assert [r["strategy"] for r in ran][:3] == ["flexshard", "row_wise", "row_wise_group_dedup"]
    assert all(r["inter_group_bytes"] > 0 for r in ran)  # 2 groups of 1: every peer is outside


@pytest.mark.slow  # spawns ranks
def test_under_torchrun_rank_0_prints_the_records():
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "flexshard.cli", "bench", "--groups", "1", "--steps", "1", "--rounds", "1", "--warmup", "0",
            "--batch", "8", "--no-torchrec", "--json"]  # fmt: skip
    done = run_torchrun(argv, timeout=300, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = json.loads(done.stdout)  # rank 0 only: one JSON document
    assert [r["strategy"] for r in recs[:3]] == ["flexshard", "row_wise", "row_wise_group_dedup"]
    assert recs[3] == {
        "strategy": "torchrec_row_wise",
        "label": "TorchRec row-wise",
        "skipped": "left out (--no-torchrec)",
    }
    assert all(r["inter_group_bytes"] == 0 and r["intra_group_bytes"] > 0 for r in recs[:3])  # one group


@pytest.mark.slow  # spawns ranks
def test_ctrl_c_stops_the_ranks_with_one_line_and_status_130():
    argv = [sys.executable, "-m", "flexshard.cli", "bench", "--nproc", "2", "--groups", "1",
            "--steps", "100000", "--batch", "8", "--no-torchrec"]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT
    )
    time.sleep(10)  # the ranks are up and stepping (100,000 steps cannot be over)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert out == ""
    assert err.strip().splitlines()[-1] == INTERRUPTED_LINE
    assert "Traceback" not in err


@pytest.mark.slow  # spawns ranks
def test_a_topology_file_plans_as_its_view(tmp_path, monkeypatch):
    """--plan-for FILE: the plans are the ones made for that topology (the same run after run)."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "two_nodes.json"
    write_json(h100_cluster(2, 2), str(path))
    out = io.StringIO()
    argv = ["bench", "--nproc", "4", "--groups", "2", "--steps", "1", "--rounds", "1", "--warmup", "0",
            "--batch", "16", "--no-torchrec", "--plan-for", str(path), "--objective", "bytes",
            "--json"]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    recs = json.loads(out.getvalue())[:3]
    expected = make_plans(
        default_data(16, 0, 4), h100_view(4, 2), h100_view(4, 2), 2.0, torchrec=False, objective="bytes"
    )
    assert [r["plan"] for r in recs] == [expected[r["strategy"]].summary for r in recs]
    assert "warm" in recs[0]["plan"] and "hot 0 " not in recs[0]["plan"]  # replicas: the bytes objective


def test_a_topology_file_of_another_shape_is_one_line(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "one_node.json"
    write_json(h100_cluster(1, 8), str(path))
    line = fails(capsys, "bench", "--nproc", "4", "--groups", "2", "--plan-for", str(path))
    assert line == (
        f"flexshard bench: error: --plan-for {path}: its 8 ranks in 1 group ([[0, 1, 2, 3, 4, 5, 6, 7]]) "
        "are not the run's 4 ranks in 2 groups of consecutive ranks"
    )


@pytest.mark.slow  # spawns ranks
def test_without_torchrec_one_line_says_it_was_skipped(tmp_path):
    fake = tmp_path / "fake" / "torchrec"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named torchrec (hidden by a test)")\n')
    env = _env()
    env["PYTHONPATH"] = str(fake.parent) + os.pathsep + env["PYTHONPATH"]  # the ranks inherit it
    argv = [sys.executable, "-m", "flexshard.cli", "bench", "--nproc", "2", "--groups", "1", "--steps", "1",
            "--rounds", "1", "--warmup", "0", "--batch", "8"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    skipped = [ln for ln in (done.stdout + done.stderr).splitlines() if "TorchRec" in ln]
    assert skipped == [
        "TorchRec row-wise skipped: not installed (ImportError: No module named torchrec (hidden by a test))"
    ]
    assert "row_wise_group_dedup " in done.stdout  # the other strategies ran
