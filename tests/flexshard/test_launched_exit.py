"""How a launcher's worker leaves (``flexshard.cli_common.run_program``): ``flexshard train`` and
``flexshard bench`` under torchrun end through ``os._exit`` with their exit status once their output is
flushed and their files written, skipping the interpreter's finalization, which can race gloo's threads
(pytorch/pytorch#65231). The torchrun tests run the console script's own wrapper, ``sys.exit(main())``,
with an ``atexit`` marker that prints only if a worker finalizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_jobs import run_torchrun

from flexshard import cli_common

ROOT = Path(__file__).resolve().parents[2]
MARKER = "FINALIZED"
ENTRY = f"""import atexit, sys
atexit.register(lambda: print({MARKER!r}, flush=True))
from flexshard.cli import main
sys.exit(main())
"""


class _ExitedError(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


def _exit(status: int):
    raise _ExitedError(status)


@pytest.fixture
def worker(monkeypatch):
    """This process as a launcher's worker whose ``os._exit`` raises ``_ExitedError`` instead."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(cli_common.os, "_exit", _exit)
    monkeypatch.setattr(sys, "argv", ["flexshard", "a", "b"])


def _raises(exc: BaseException):
    def main(_argv):
        raise exc

    return main


@pytest.mark.parametrize(
    ("main", "status", "err"),
    [
        (lambda argv: 3 if argv == ["a", "b"] else 99, 3, ""),  # sys.argv's arguments
        (_raises(SystemExit(None)), 0, ""),
        (_raises(SystemExit(2)), 2, ""),
        (_raises(SystemExit("flexshard: stop")), 1, "flexshard: stop\n"),
        (_raises(KeyboardInterrupt()), 130, ""),
        (lambda _argv: None, 0, ""),  # as sys.exit(None)
    ],
)
def test_a_worker_run_as_the_program_ends_with_its_status(worker, capsys, main, status, err):
    with pytest.raises(_ExitedError) as exited:
        cli_common.run_program(main, None)
    assert exited.value.status == status
    assert capsys.readouterr().err == err


def test_a_bug_prints_its_traceback_and_ends_with_1(worker, capsys):
    with pytest.raises(_ExitedError) as exited:
        cli_common.run_program(_raises(RuntimeError("a bug")), None)
    assert exited.value.status == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith("RuntimeError: a bug\n")


def test_called_with_arguments_or_outside_a_launcher_it_returns(worker, monkeypatch):
    assert cli_common.run_program(lambda argv: len(argv), ["x"]) == 1  # tests, other entry points
    monkeypatch.delenv("RANK")
    assert cli_common.run_program(lambda argv: len(argv), None) == 2  # a plain process: sys.argv's


def _torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    entry = tmp_path / "entry.py"
    entry.write_text(ENTRY)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return run_torchrun([*argv, str(entry), *args], timeout=300, env=env, cwd=tmp_path)


@pytest.mark.slow
def test_train_under_torchrun_ends_without_finalizing(tmp_path):
    metrics = tmp_path / "m.jsonl"
    done = _torchrun(tmp_path, "train", "--steps", "2", "--batch-size", "16", "--metrics-out", str(metrics))
    assert done.returncode == 0, done.stderr[-3000:]
    assert MARKER not in done.stdout + done.stderr  # both workers skipped the interpreter's finalization
    assert done.stdout.startswith("summary: 2 steps (steps 1-2), final loss ")  # flushed before the end
    assert "step 2/2 loss " in done.stderr and f"metrics: wrote {metrics} (2 steps)" in done.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2]


@pytest.mark.slow
def test_a_train_error_ends_every_worker_with_its_status(tmp_path):
    done = _torchrun(tmp_path, "train", "--steps", "0")
    assert done.returncode == 1  # torchrun's own status when a worker failed
    assert done.stderr.count("flexshard train: error: --steps: must be positive, got 0") == 1
    assert done.stderr.count("exitcode  : 2") == 2  # torchrun's summary: both workers exited 2
    assert MARKER not in done.stdout + done.stderr


@pytest.mark.slow
def test_bench_under_torchrun_ends_without_finalizing(tmp_path):
    done = _torchrun(
        tmp_path, "bench", "--groups", "1", "--steps", "1", "--rounds", "1", "--warmup", "0",
        "--batch", "8", "--no-torchrec", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert MARKER not in done.stdout + done.stderr
    recs = json.loads(done.stdout)  # rank 0's one JSON document, whole
    assert [r["strategy"] for r in recs] == [
        "flexshard",
        "row_wise",
        "row_wise_group_dedup",
        "torchrec_row_wise",
    ]
