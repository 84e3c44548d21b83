"""Step time of ``flexshard train --pipeline on`` against ``--pipeline off`` on local gloo ranks.

Each round trains the same batches twice in the same process group, once per mode, alternating which
goes first; per mode it prints the median step time over every round's steps after the first (the
slowest rank's time of each step, from ``--metrics-out``), the ratio on/off of the medians, and the
median, lowest and highest of the rounds' own ratios (each round's median on / median off: the spread
the machine's noise gives). Run from the repository
root::

    PYTHONPATH=$PWD python experiments/pipeline_step.py --world 4 --groups 2 --batch-size 256 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
from pathlib import Path

from flexshard.runtime.local import run_on_ranks


def _rank(rank: int, world: int, argv: list[str], rounds: int, folder: str) -> dict[str, list[list[float]]]:
    """Train ``argv`` with ``--pipeline off`` and ``on`` ``rounds`` times each; rank 0 returns, per mode
    and round, the step times (s) after the run's first step."""
    from flexshard.training.config import parse_args
    from flexshard.training.loop import run

    times: dict[str, list[list[float]]] = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            metrics = Path(folder) / f"{r}_{mode}.jsonl"
            config = parse_args([*argv, "--pipeline", mode, "--metrics-out", str(metrics), "--quiet"])
            with contextlib.redirect_stdout(io.StringIO()):
                run(config)
            if rank == 0:
                records = [json.loads(line) for line in metrics.read_text().splitlines()]
                times[mode].append([x["elapsed_s"] for x in records if x["kind"] == "step"][1:])
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategy", default="flexshard")
    p.add_argument("extra", nargs="*", help="more train flags (after --)")
    a = p.parse_args()
    argv = ["--groups", str(a.groups), "--batch-size", str(a.batch_size), "--steps", str(a.steps)]
    argv += ["--strategy", a.strategy, *a.extra]
    with tempfile.TemporaryDirectory() as folder:
        times = run_on_ranks(_rank, a.world, argv, a.rounds, folder, timeout_s=3600.0)[0]
    med = {mode: 1e3 * statistics.median(sum(t, [])) for mode, t in times.items()}
    ratios = [
        statistics.median(on) / statistics.median(off)
        for on, off in zip(times["on"], times["off"], strict=True)
    ]
    print(
        f"world {a.world} in {a.groups} groups, batch {a.batch_size} per rank, {a.strategy}, "
        f"{a.rounds} rounds of {a.steps} steps: median step {med['off']:.1f} ms off, {med['on']:.1f} ms on "
        f"(on/off {med['on'] / med['off']:.3f}; per round median {statistics.median(ratios):.3f}, "
        f"{min(ratios):.3f} to {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
