"""Soak benchmark: a long torchrun job whose workers are killed on a schedule, against the same job run
without a fault.

Two runs of ``flexshard.train`` under ``torchrun --standalone``, ``--ranks`` workers in ``--groups``
groups, ``--steps`` steps at ``--batch-size`` samples per rank, a checkpoint every
``--checkpoint-every`` steps (the newest 2 kept):

1. uninterrupted;
2. under ``--max-restarts`` with ``--resume``, one worker killed with SIGKILL each time the run reaches
   a multiple of ``--kill-every`` steps (rank 1, 2, ... in turn).

While they run, every worker's resident memory (VmRSS) is sampled every 0.25 s with the step the run is
on. Printed, and written to docs/results/soak.md and soak.png:

* steps completed, restarts, and for each kill the step it landed at, the checkpoint the restart
  resumed from and the steps trained again; a restart must resume from the last complete checkpoint
  at the kill (no step lost beyond it);
* whether the final state (every table's rows and optimizer state, the dense model and its optimizer)
  and every step's loss equal the uninterrupted run's, bit for bit;
* peak RSS per rank in windows of ``--window`` steps, and each rank's growth from the second window
  (after warm-up) to the last; in the uninterrupted run it must stay under ``RSS_GROWTH_LIMIT``.

Exit status 1 when a check fails. Run:

    .venv/bin/python experiments/soak.py [--ranks 8] [--steps 1000] [--kill-every 200] [--quick]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import study
import torch

from core.osutil import process_alive
from flexshard import checkpoint

SAMPLE_EVERY_S = 0.25  # how often every worker's RSS is read
RSS_GROWTH_LIMIT = 0.05  # largest accepted RSS growth per rank after the first window, as a fraction
MIB = 2**20


@dataclass
class Kill:
    step: int  # the last step the run had logged when the worker was killed
    rank: int
    checkpoint: int  # the newest complete checkpoint once the worker was gone (0: none)


@dataclass
class Run:
    """One torchrun job: its exit status, wall time (s), RSS samples (time s, step, rank, bytes), kills,
    and the metrics log's records."""

    name: str
    returncode: int = -1
    seconds: float = 0.0
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    def headers(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "header"]

    def losses(self) -> dict[int, float]:
        """Each step's loss, the last logged one for steps trained again after a restart."""
        return {r["step"]: r["loss"] for r in self.records if r["kind"] == "step"}


def _workers(agent: int) -> dict[int, int]:
    """The agent's worker processes: pid -> rank."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != agent or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            found[int(entry)] = int(env[b"RANK"])
        except (OSError, KeyError, ValueError, IndexError):
            continue  # gone, or not a worker yet
    return found


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Tail:
    """The records of a JSON Lines file as it grows (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.records = path, 0, []

    def read(self) -> list[dict]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self.offset += end
            self.records += [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        return self.records

    def step(self) -> int:
        steps = [r["step"] for r in self.read()[-3:] if r["kind"] == "step"]
        return steps[-1] if steps else 0


def run_job(name: str, workdir: Path, args, kill_every: int = 0) -> Run:
    """One torchrun job; with ``kill_every``, a worker killed at every multiple of it (progress on stderr)."""
    ckpt, metrics = workdir / "ckpt", workdir / "metrics.jsonl"
    kills_planned = (args.steps - 1) // kill_every if kill_every else 0
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(args.ranks), "--max-restarts", str(kills_planned)]  # fmt: skip
    train = ["-m", "flexshard.train", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
             "--groups", str(args.groups), "--checkpoint-dir", str(ckpt), "--checkpoint-every",
             str(args.checkpoint_every), "--keep", "2", "--metrics-out", str(metrics), "--quiet",
             "--resume", "--timeout", "60"]  # fmt: skip
    run, tail, next_kill = Run(name), _Tail(metrics), kill_every
    env = study.cpu_job_env()
    t0 = time.monotonic()
    with open(workdir / "stdout.txt", "w") as out, open(workdir / "stderr.txt", "w") as err:
        job = subprocess.Popen([*launcher, *train], stdout=out, stderr=err, env=env)
        last_report = 0
        while job.poll() is None:
            step, workers = tail.step(), _workers(job.pid)
            now = time.monotonic() - t0
            for pid, rank in workers.items():
                rss = _rss_bytes(pid)
                if rss is not None:
                    run.samples.append((now, step, rank, rss))
            if step >= last_report + 100:
                last_report = step - step % 100
                print(f"  {name}: step {step}/{args.steps} ({now:.0f} s)", file=sys.stderr)
            if (
                next_kill
                and step >= next_kill
                and len(run.kills) < kills_planned
                and len(workers) == args.ranks
            ):
                rank = (len(run.kills) + 1) % args.ranks
                pid = next(p for p, r in workers.items() if r == rank)
                os.kill(pid, signal.SIGKILL)
                while process_alive(pid):
                    time.sleep(0.01)
                found = checkpoint.latest(ckpt)
                saved = checkpoint.read_manifest(found).step if found else 0
                run.kills.append(Kill(step, rank, saved))
                print(
                    f"  {name}: step {step}: killed rank {rank}; last checkpoint: step {saved}",
                    file=sys.stderr,
                )
                next_kill += kill_every
            time.sleep(SAMPLE_EVERY_S)
    run.returncode, run.seconds, run.records = job.returncode, time.monotonic() - t0, tail.read()
    if run.returncode:
        print((workdir / "stderr.txt").read_text()[-3000:], file=sys.stderr)
    return run


def same_final_state(a: Path, b: Path) -> tuple[bool, str]:
    """Whether two checkpoints hold the same rows, optimizer state and dense model, bit for bit."""
    x, y = checkpoint.load_full(a), checkpoint.load_full(b)
    for name in x.weights:
        same_states = x.states[name].keys() == y.states[name].keys() and all(
            torch.equal(s, y.states[name][k]) for k, s in x.states[name].items()
        )
        if not (torch.equal(x.weights[name], y.weights[name]) and same_states):
            return False, f"table {name!r} differs"
    for key in x.dense:
        if not torch.equal(x.dense[key], y.dense[key]):
            return False, f"dense {key!r} differs"
    if not _equal(x.dense_optimizer, y.dense_optimizer):
        return False, "dense optimizer state differs"
    return True, "identical"


def _equal(a, b) -> bool:
    """Bitwise equality of nested dicts / lists / tensors / plain values."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b, strict=True))
    return a == b


def rss_windows(run: Run, ranks: int, steps: int, window: int) -> np.ndarray:
    """Peak RSS (bytes) per window of ``window`` steps (rows) and rank (columns); 0 where unsampled."""
    peaks = np.zeros((-(-steps // window), ranks), np.int64)
    for _t, step, rank, rss in run.samples:
        w = min(step // window, len(peaks) - 1)
        peaks[w, rank] = max(peaks[w, rank], rss)
    return peaks


def report(args, plain: Run, soak: Run, equal: tuple[bool, str], seconds: float) -> tuple[str, bool]:
    """The markdown report and whether every check passed."""
    restarts = len(soak.headers()) - 1
    resumed = [h["start_step"] for h in soak.headers()[1:]]
    completed = max(soak.losses(), default=0)
    kill_rows, lost_ok = [], len(resumed) == len(soak.kills)
    for k, start in zip(soak.kills, resumed, strict=False):
        ok = start == k.checkpoint
        lost_ok &= ok
        kill_rows.append([k.step, k.rank, k.checkpoint, start, k.step - start, "yes" if ok else "NO"])
    losses_equal = plain.losses() == soak.losses()
    planned = (args.steps - 1) // args.kill_every
    peaks = rss_windows(plain, args.ranks, args.steps, args.window)
    growth = float(
        np.max((peaks[-1] - peaks[min(1, len(peaks) - 1)]) / np.maximum(peaks[min(1, len(peaks) - 1)], 1))
    )
    checks = {
        "both runs exit 0": plain.returncode == 0 and soak.returncode == 0,
        f"{planned} kills, each restarted": len(soak.kills) == planned and restarts == planned,
        "every restart resumed from the last checkpoint at its kill": lost_ok,
        f"steps completed: {completed} of {args.steps}": completed == args.steps,
        "final state equal to the uninterrupted run's, bit for bit": equal[0],
        "every step's loss equal to the uninterrupted run's": losses_equal,
        f"RSS growth after the first window under {RSS_GROWTH_LIMIT:.0%} on every rank (largest: "
        f"{growth:+.1%})": growth < RSS_GROWTH_LIMIT,
    }
    lines = [
        "# Soak: kills under torchrun --max-restarts, against an uninterrupted run",
        "",
        study.generated(study.command(__file__, *sys.argv[1:]), seconds),
        "",
        f"{args.ranks} ranks in {args.groups} groups (gloo on loopback), {args.steps} steps at batch "
        f"{args.batch_size} per rank, the embedded synthetic workload, a checkpoint every "
        f"{args.checkpoint_every} steps, one worker killed with SIGKILL at every {args.kill_every} steps. "
        f"Uninterrupted: {plain.seconds:.0f} s; with kills: {soak.seconds:.0f} s.",
        "",
        study.md_table(
            [
                "killed at step",
                "rank",
                "last checkpoint",
                "resumed from",
                "steps trained again",
                "as expected",
            ],
            kill_rows,
            "rrrrrl",
        ),
        "",
        study.md_table(["check", "holds"], [[c, "yes" if ok else "NO"] for c, ok in checks.items()]),
        "",
    ]
    for run in (plain, soak):
        peaks = rss_windows(run, args.ranks, args.steps, args.window)
        spans = [f"{w * args.window}-{min((w + 1) * args.window, args.steps) - 1}" for w in range(len(peaks))]
        rows = [[span, *(f"{v / MIB:.0f}" for v in row)] for span, row in zip(spans, peaks, strict=True)]
        base = peaks[min(1, len(peaks) - 1)]
        growth = peaks[-1] - base
        rows.append(["growth from the second window (MiB)", *(f"{g / MIB:+.1f}" for g in growth)])
        lines += [
            f"Peak RSS per rank (MiB), {run.name} run, per window of {args.window} steps:",
            "",
            study.md_table(
                ["steps", *(f"rank {r}" for r in range(args.ranks))], rows, "l" + "r" * args.ranks
            ),
            "",
        ]
    lines.append(f"Final state: {equal[1]}.")
    return "\n".join(lines), all(checks.values())


def plot(args, plain: Run, soak: Run, path: Path) -> None:
    fig, axes = study.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, run in zip(axes, (plain, soak), strict=True):
        samples = np.array(run.samples, dtype=np.float64).reshape(-1, 4)
        for rank in range(args.ranks):
            mine = samples[samples[:, 2] == rank]
            ax.plot(mine[:, 0], mine[:, 3] / MIB, lw=0.8, label=f"rank {rank}")
        for k in run.kills:
            t = next((s[0] for s in run.samples if s[1] >= k.step), None)
            if t is not None:
                ax.axvline(t, color="k", ls=":", lw=0.8)
        ax.set(title=f"{run.name} run", xlabel="seconds")
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].legend(fontsize=7, ncol=2)
    study.save_figure(fig, path)


def main() -> int:
    p = study.arguments(__doc__, quick="4 ranks, 300 steps, a kill every 100")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--kill-every", type=int, default=200)
    p.add_argument("--window", type=int, default=100, help="steps per row of the RSS table")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.steps, args.kill_every = 4, 300, 100
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flexshard-soak-") as tmp:
        runs = {}
        for name, kill_every in (("uninterrupted", 0), ("killed", args.kill_every)):
            (Path(tmp) / name).mkdir()
            print(f"{name} run:", file=sys.stderr)
            runs[name] = run_job(name, Path(tmp) / name, args, kill_every)
        plain, soak = runs["uninterrupted"], runs["killed"]
        final = [checkpoint.step_dir(Path(tmp) / n / "ckpt", args.steps) for n in runs]
        equal = (
            same_final_state(*final) if all(f.is_dir() for f in final) else (False, "a run did not finish")
        )
    text, ok = report(args, plain, soak, equal, time.monotonic() - t0)
    print(text)
    if not args.no_write and not args.quick:
        study.write_markdown(study.RESULTS / "soak.md", text + "\n\n![RSS per rank](soak.png)")
        plot(args, plain, soak, study.RESULTS / "soak.png")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
