"""The checkpoint folder (issue 22, Deliver 4), one process: a refused newest checkpoint names the older one
that would load, and following the advice resumes from it; --overwrite and --keep remove only folders
this tool wrote; a job holds the folder with a lock (host, pid), a second job is refused with one line
naming the holder, a stale lock is taken over, and exactly one of many racing processes gets it."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import OutputError
from core.folder_lock import LOCK_NAME, FolderLock, holder_record
from flexshard import checkpoint
from flexshard.train import main

SMALL = ["--batch-size", "8", "--quiet", "--dim", "8"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)


def _train(ckpt: Path, *flags: str) -> int:
    return main(["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", *SMALL, *flags])


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_a_refused_newest_checkpoint_names_the_older_one_that_loads(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "3") == 0
    newest = ckpt / "step-00000003"
    (newest / "rank0.pt").write_bytes(b"hi\n")
    size = json.loads((newest / "manifest.json").read_text())["files"][0]["bytes"]
    capsys.readouterr()
    assert _train(ckpt, "--steps", "4", "--resume") == 2
    aside = ckpt / "refused-step-00000003"
    assert _err(capsys) == (
        f"flexshard train: error: checkpoint '{newest}': rank0.pt: 3 bytes, the manifest records {size} "
        "(truncated, damaged, or a file of another checkpoint); step-00000002 would load (its manifest and "
        f"rank file hashes verify): to resume from it, move the refused one aside (mv {newest} {aside}) and "
        "--resume again"
    )
    assert not (ckpt / LOCK_NAME).exists()  # the failed run released the folder
    newest.rename(aside)  # as the line says
    assert _train(ckpt, "--steps", "4", "--resume") == 0
    assert "summary: 2 steps (steps 3-4)" in capsys.readouterr().out  # resumed at step 2
    assert checkpoint.latest(ckpt).name == "step-00000004"
    assert aside.is_dir()  # not a checkpoint any more, never removed


def test_when_no_older_checkpoint_would_load_the_line_says_so(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "2") == 0
    (ckpt / "step-00000001" / "rank0.pt").write_bytes(b"x")
    manifest = ckpt / "step-00000002" / "manifest.json"
    doc = json.loads(manifest.read_text())
    del doc["world_size"]
    manifest.write_text(json.dumps(doc))
    capsys.readouterr()
    assert _train(ckpt, "--steps", "3", "--resume") == 2
    assert _err(capsys) == (
        f"flexshard train: error: checkpoint '{ckpt / 'step-00000002'}': manifest.json: field 'world_size' "
        f"missing; no older checkpoint in {ckpt} would load either"
    )


def test_overwrite_and_keep_remove_only_what_this_tool_wrote(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "2") == 0
    notes = ckpt / "step-notes"  # a user's folders and files beside the checkpoints
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me\n")
    (ckpt / "notes.txt").write_text("mine\n")
    (ckpt / "step-1").mkdir()
    (ckpt / ".tmp-step-00000009").mkdir()  # an interrupted save's leftover: this tool's
    (ckpt / ".tmp-step-00000009" / "rank0.pt.part").write_bytes(b"half")
    capsys.readouterr()
    assert _train(ckpt, "--steps", "1", "--seed", "3", "--overwrite") == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes.txt", "step-00000001", "step-1", "step-notes"]
    assert (notes / "todo.txt").read_text() == "keep me\n"
    assert _train(ckpt, "--steps", "4", "--seed", "3", "--resume", "--keep", "1") == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes.txt", "step-00000004", "step-1", "step-notes"]
    # a step-NNNNNNNN folder this tool did not write: a fresh run would replace it, so it is refused
    foreign = ckpt / "step-00000002"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("x\n")
    capsys.readouterr()
    assert _train(ckpt, "--steps", "2", "--overwrite") == 2
    assert _err(capsys) == (
        f"flexshard train: error: --checkpoint-dir: {foreign} is not a checkpoint this tool wrote (no "
        "FlexShard manifest), and this run's saves would replace it; move it out of the folder"
    )
    assert (foreign / "mine.txt").exists()
    assert checkpoint.latest(ckpt).name == "step-00000004"  # --overwrite removed ours; the run never began


def test_an_input_inside_a_checkpoint_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "1") == 0
    data = ckpt / "step-00000001" / "h.txt"
    data.write_text("".join(f"{u} {u % 9} {(u + 4) % 9}\n" for u in range(20)))
    capsys.readouterr()
    assert _train(ckpt, "--steps", "1", "--data", str(data), "--overwrite") == 2
    assert _err(capsys) == (
        f"flexshard train: error: --checkpoint-dir: --data '{data}' lies in {ckpt / 'step-00000001'}, a "
        "folder that checkpoints replace or remove; move it out"
    )
    assert data.exists()
    metrics = ckpt / "step-00000001" / "m.jsonl"  # not there yet: a later --keep would remove it
    assert _train(ckpt, "--steps", "2", "--resume", "--metrics-out", str(metrics)) == 2
    assert _err(capsys) == (
        f"flexshard train: error: --checkpoint-dir: --metrics-out '{metrics}' lies in "
        f"{ckpt / 'step-00000001'}, a folder that checkpoints replace or remove; move it out"
    )
    assert not metrics.exists() and checkpoint.latest(ckpt).name == "step-00000001"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _lock_file(folder: Path, **holder) -> dict:
    record = {**holder_record(), "job": None, "attempt": 0, **holder}
    (folder / LOCK_NAME).write_text(json.dumps(record))
    return record


def test_a_second_job_on_the_folder_is_refused_naming_the_holder(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "2") == 0
    other = _sleeper()
    try:
        holder = _lock_file(ckpt, pid=other.pid, ticks=None)
        for flags in (["--resume"], ["--overwrite"], []):
            assert _train(ckpt, "--steps", "3", *flags) == 2
            assert _err(capsys) == (
                f"flexshard train: error: --checkpoint-dir: {ckpt} is in use by another job (host "
                f"{socket.gethostname()!r}, pid {other.pid}, since {holder['started']}; lock "
                f"{ckpt / LOCK_NAME}); wait for it to end, or remove the lock if that job is gone"
            )
            assert checkpoint.latest(ckpt).name == "step-00000002"  # --overwrite removed nothing
            assert json.loads((ckpt / LOCK_NAME).read_text()) == holder  # and the lock is the holder's
        _lock_file(ckpt, host="another-host", pid=1)  # another host: cannot be checked, stands
        assert _train(ckpt, "--steps", "3", "--resume") == 2
        assert "in use by another job (host 'another-host', pid 1," in _err(capsys)
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_is_taken_over(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, "--steps", "1") == 0
    gone = _sleeper()
    gone.kill()
    gone.wait()
    _lock_file(ckpt, pid=gone.pid)  # its process ended (killed: the lock never released)
    assert _train(ckpt, "--steps", "2", "--resume") == 0
    _lock_file(ckpt, pid=os.getpid(), ticks=12345)  # a live pid, but another process's start: reused
    assert _train(ckpt, "--steps", "3", "--resume") == 0
    # an earlier attempt of the same torchrun job, on another host: the agent restarted its workers
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    _lock_file(ckpt, host="another-host", pid=1, job="job-7", attempt=1)
    assert _train(ckpt, "--steps", "4", "--resume") == 0
    _lock_file(ckpt, host="another-host", pid=1, job="job-8", attempt=1)  # another job: stands
    assert _train(ckpt, "--steps", "5", "--resume") == 2
    assert "in use by another job (host 'another-host', pid 1," in _err(capsys)
    (ckpt / LOCK_NAME).unlink()
    assert _train(ckpt, "--steps", "5", "--resume") == 0
    assert not (ckpt / LOCK_NAME).exists() and checkpoint.latest(ckpt).name == "step-00000005"


def test_a_run_whose_lock_was_taken_stops_before_writing(tmp_path, capsys, monkeypatch):
    """Someone removed the lock by hand and another job took the folder: the first run stops at its next
    checkpoint, so the two never both write, or both report success."""
    from flexshard.runtime import ShardedSequenceEmbedding

    ckpt = tmp_path / "ckpt"
    original = ShardedSequenceEmbedding.step

    def step(self):
        original(self)
        if (ckpt / "step-00000001").exists():
            _lock_file(ckpt, pid=os.getppid())

    monkeypatch.setattr(ShardedSequenceEmbedding, "step", step)
    assert _train(ckpt, "--steps", "3") == 2
    assert _err(capsys) == (
        f"flexshard train: error: --checkpoint-dir: {ckpt}: this run's lock {ckpt / LOCK_NAME} was removed "
        "or taken by another job; stopping before writing"
    )
    assert checkpoint.latest(ckpt).name == "step-00000001"
    assert json.loads((ckpt / LOCK_NAME).read_text())["pid"] == os.getppid()  # the other job's, kept


def _contend(folder: str, start, results) -> None:
    start.wait()
    try:
        lock = FolderLock.acquire(folder, "--checkpoint-dir")
        results.put(("held", os.getpid()))
        start.wait()  # hold it until every contender has tried
        lock.release()
    except OutputError as e:
        results.put(("refused", str(e)))
        start.wait()


@pytest.mark.parametrize("stale", [False, True])
def test_exactly_one_of_racing_processes_gets_the_lock(tmp_path, stale):
    """8 processes try at once (on a free folder, or on one with a stale lock that all of them find):
    exactly one holds it; the others are refused with one line (the holder, or the takeover in progress)."""
    if stale:
        gone = _sleeper()
        gone.kill()
        gone.wait()
        _lock_file(tmp_path, pid=gone.pid)
    ctx = multiprocessing.get_context("fork")
    n = 8
    start, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), start, results)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(60)
    held = [o for o in outcomes if o[0] == "held"]
    assert len(held) == 1, outcomes
    for kind, text in outcomes:
        if kind == "refused":
            assert f"is in use by another job (host {socket.gethostname()!r}, pid " in text or (
                "is taking over its stale lock" in text
            ), text
    assert not (tmp_path / LOCK_NAME).exists()  # released by its holder
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary or break file left


def test_a_lock_is_released_only_by_its_holder(tmp_path):
    lock = FolderLock.acquire(tmp_path, "--checkpoint-dir")
    assert lock.held() and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(OutputError, match="is in use by another job"):
        FolderLock.acquire(tmp_path, "--checkpoint-dir")  # this very process again: still refused
    other = _lock_file(tmp_path, pid=1)
    lock.release()  # no longer its lock: left alone
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == other


def test_without_hard_links_the_lock_is_an_exclusive_create(tmp_path, monkeypatch):
    import errno

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    lock = FolderLock.acquire(tmp_path, "--checkpoint-dir")
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == lock.holder
    with pytest.raises(OutputError, match="is in use by another job"):
        FolderLock.acquire(tmp_path, "--checkpoint-dir")
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_two_jobs_started_together_never_both_succeed(tmp_path):
    """Two real training processes launched at once into one fresh folder: exactly one exits 0; the
    other stops with one line (the folder in use by the first, or, if the first finished before it
    looked, the first's checkpoints)."""
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "flexshard.train", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
            "--steps", "20", *SMALL]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    jobs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    done = [(j.wait(timeout=300), j.stderr.read().strip()) for j in jobs]
    for j in jobs:
        j.stdout.close()
        j.stderr.close()
    assert sorted(rc for rc, _ in done) == [0, 2], done
    line = next(err for rc, err in done if rc == 2)
    assert "\n" not in line
    assert line.startswith(f"flexshard train: error: --checkpoint-dir: {ckpt} ")
    assert "is in use by another job (host" in line or "holds 20 checkpoint(s) of another run" in line, line
    assert checkpoint.latest(ckpt).name == "step-00000020" and not (ckpt / LOCK_NAME).exists()


def test_steps_past_eight_digits_order_by_step_not_by_name(tmp_path):
    from flexshard.training.resume import prune

    for step in (99_999_999, 100_000_000, 7):
        folder = checkpoint.step_dir(tmp_path, step)
        folder.mkdir()
        (folder / "manifest.json").write_text(json.dumps({"schema": "flexshard-checkpoint/2"}))
    assert checkpoint.latest(tmp_path).name == "step-100000000"
    assert [p.name for p in prune(tmp_path, 1)] == ["step-00000007", "step-99999999"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-100000000"]
