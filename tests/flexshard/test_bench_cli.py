"""``flexshard bench`` end to end on spawned gloo ranks (4 ranks in 2 groups, small): the records, the
collectives and bytes against the runtime's own figures, the alternating rounds, the output, bad flags."""

from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest

from core.osutil import RENDEZVOUS_TRIES
from flexshard.bench import results
from flexshard.bench.config import BenchConfig
from flexshard.bench.rotation import round_order
from flexshard.cli import main
from tests.flexshard.cli_helpers import fails

KEYS = {
    "strategy",
    "step_ms_median",
    "step_ms_mean",
    "collectives_per_step",
    "inter_group_bytes",
    "intra_group_bytes",
    "predicted_step_ms",
}
STRATEGIES = ["flexshard", "row_wise", "row_wise_group_dedup", "torchrec_row_wise"]


def _torchrec_installed() -> bool:
    try:
        import torchrec  # noqa: F401
    except Exception:  # not installed, or hidden (the bench says why in its record)
        return False
    return True


HAS_TORCHREC = _torchrec_installed()
RAN = STRATEGIES if HAS_TORCHREC else STRATEGIES[:3]  # the strategies that run here, in run order


def _bench_json(*argv: str) -> list[dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def first() -> list[dict]:
    """The brief's run: 4 ranks in 2 groups, 2 timed steps, one round (default batch)."""
    return _bench_json("--nproc", "4", "--groups", "2", "--steps", "2", "--rounds", "1")


@pytest.fixture(scope="module")
def second() -> list[dict]:
    """The same machine again, two rounds after one warm-up step."""
    return _bench_json("--nproc", "4", "--groups", "2", "--steps", "2", "--rounds", "2", "--warmup", "1")


def _by_key(recs: list[dict]) -> dict[str, dict]:
    return {r["strategy"]: r for r in recs if "skipped" not in r}


def _ran(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "skipped" not in r]


@pytest.mark.slow  # spawns ranks
def test_one_record_per_strategy_with_the_keys(first):
    assert [r["strategy"] for r in first] == STRATEGIES  # TorchRec's record says why when it did not run
    skipped = {r["strategy"]: r["skipped"] for r in first if "skipped" in r}
    if HAS_TORCHREC:
        assert skipped == {}
    else:
        assert list(skipped) == ["torchrec_row_wise"]
        assert skipped["torchrec_row_wise"].startswith("not installed ("), skipped
    for r in _ran(first):
        assert set(r) >= KEYS, r["strategy"]
        assert r["timed_steps"] == 2
        assert r["step_ms_median"] > 0 and r["step_ms_mean"] > 0
        assert r["inter_group_bytes"] > 0 and r["intra_group_bytes"] > 0
        assert r["predicted_step_ms"] > 0
        # priced with local rates measured on the 4 ranks before the rounds (--rates measured)
        assert r["local_rates"]["source"].startswith("measured on the job's 4 ranks at the run's sizes")
        # the plans made on the medians of 3 quick probes and rate measurements, the predictions on
        # these and one more of each after the one round
        assert r["probes"] == 4
        assert r["local_rates"]["source"].endswith("median of 4 measurements")
        # gloo: every link class priced at most at the all-to-all bandwidth of every rank at once
        assert r["concurrent_all_to_all_Bps"] > 1e6
        # each rank's median step, the slowest of which the step is (a rank's median is at most the
        # median over steps of the slowest rank's)
        assert len(r["step_ms_median_by_rank"]) == 4
        assert 0 < max(r["step_ms_median_by_rank"]) <= r["step_ms_median"] * (1 + 1e-9)
        # each rank's process CPU per step: some, and no more than its threads could take in the slowest
        # rank's step on every core of the machine
        assert len(r["cpu_ms_per_step_by_rank"]) == 4
        assert min(r["cpu_ms_per_step_by_rank"]) > 0
        assert r["cpu_ms_per_step"] == float(np.median(r["cpu_ms_per_step_by_rank"]))
        # the ratio of medians to the ablation's, and per round (1 round here); the ablation's is 1
        assert len(r["vs_ablation_by_round"]) == 1 and r["vs_ablation"] > 0
        if r["strategy"] == "row_wise":
            assert r["vs_ablation"] == 1.0 and r["vs_ablation_by_round"] == [1.0]
        cores = os.cpu_count() or 1
        assert max(r["cpu_ms_per_step_by_rank"]) <= max(r["step_ms_median_by_rank"]) * 4 * cores
        if r["strategy"] == "torchrec_row_wise":
            assert r["plan_tables"] == []
        else:  # the plan's tiers per table, as the summary line counts them
            assert [t["name"] for t in r["plan_tables"]] == ["item", "creator", "category"]
            cold = sum(t["cold_rows"] for t in r["plan_tables"])
            assert f"cold {cold:,} rows" in r["plan"]
            for t in r["plan_tables"]:
                assert len(t["cold_share"]) == 4 and abs(sum(t["cold_share"]) - 1) < 1e-9
        # minor page faults per step: each rank's mean, the median over the ranks
        faults = r["page_faults_per_step_by_rank"]
        assert len(faults) == 4 and min(faults) >= 0
        assert r["page_faults_per_step"] == float(np.median(faults))
        # the calling thread's CPU per step: part of the process's (every thread), step by step
        assert r["thread_cpu_ms_per_step"] == float(np.median(r["thread_cpu_ms_per_step_by_rank"]))
        by_rank = zip(r["thread_cpu_ms_per_step_by_rank"], r["cpu_ms_per_step_by_rank"], strict=True)
        assert all(0 < thread <= cpu for thread, cpu in by_rank)
        # TorchRec's local work: its timed steps' thread CPU times the ranks per core (at least 1)
        if r["strategy"] == "torchrec_row_wise":
            share = max(1.0, 4 / (os.cpu_count() or 1))
            assert r["torchrec_local_ms"] == pytest.approx(r["thread_cpu_ms_per_step"] * share, rel=1e-12)
        else:
            assert "torchrec_local_ms" not in r


@pytest.mark.slow  # spawns ranks
def test_collectives_per_step_repeat_and_match_the_runtime(first, second):
    a, b = _by_key(first), _by_key(second)
    for recs in (a, b):
        for r in recs.values():  # every timed step issues the same collectives
            assert r["collectives_each_step"] == [r["collectives_per_step"]] * r["timed_steps"]
        # today's runtime: ids out (headed by the split sizes), embeddings back, gradients out
        assert recs["row_wise"]["collectives_by_kind"] == {"all_to_all_single": 3.0}
        if HAS_TORCHREC:
            assert recs["torchrec_row_wise"]["collectives_per_step"] == 5
            # and the model prices the 5 it issues: world all-to-alls, as the ablation's 3
            latency = {k: recs[k]["predicted_parts_ms"]["latency"] for k in ("row_wise", "torchrec_row_wise")}
            assert latency["torchrec_row_wise"] == pytest.approx(latency["row_wise"] * 5 / 3, rel=1e-9)
    for key in RAN:  # a repeated run issues the same, wherever the plan is the same
        if a[key]["plan"] == b[key]["plan"]:
            assert a[key]["collectives_by_kind"] == b[key]["collectives_by_kind"], key


@pytest.mark.slow  # spawns ranks
def test_bytes_equal_the_runtime_traffic_counters(first, second):
    """Counted on the collectives = the runtime's own counter (what its byte counts price, and what they
    leave out: ``ids``' error codes, shared words and padding); FlexShard's replica sync splits a payload
    of an odd number of elements unevenly (its counter prices the even split): within one byte there."""
    for recs in (first, second):
        for r in _ran(recs):
            if r["strategy"] == "torchrec_row_wise":
                assert "runtime_inter_group_bytes" not in r
                continue
            for link in ("intra", "inter"):
                expected = r[f"runtime_{link}_group_bytes"]
                tol = 1.0 if r["strategy"] == "flexshard" else 0.0
                assert abs(r[f"{link}_group_bytes"] - expected) <= tol, (r["strategy"], link)


@pytest.mark.slow  # spawns ranks
def test_rounds_alternate_the_strategies(second):
    n = len(RAN)
    for i, r in enumerate(_ran(second)):
        # the first two rounds of the Williams design (with TorchRec: A B D C, then B C A D)
        assert r["ran_in_blocks"] == [round_order(0, n).index(i), n + round_order(1, n).index(i)], r[
            "strategy"
        ]
        assert r["probes"] == 5  # 3 before the rounds and one after each of the two


@pytest.mark.slow  # spawns ranks
def test_table_shows_every_strategy(second):
    cfg = BenchConfig(nproc=4, groups=2, steps=2, rounds=2, warmup=1)
    text = results.table(cfg, second)
    rows = {r["label"]: r for r in _ran(second)}
    assert len(rows) == len(RAN)
    for label, r in rows.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(label + "  "))
        assert f"{r['step_ms_median']:.1f}" in line and f"{r['inter_group_bytes'] / 1e6:.3f}" in line
        assert line.split()[-1] == (
            "n/a" if r["predicted_step_ms"] is None else f"{r['predicted_step_ms']:.1f}"
        )
        ablation = rows["row-wise ablation (dedup)"]["predicted_step_ms"]  # the model's ratio beside it
        assert line.split()[-2] == f"{r['predicted_step_ms'] / ablation:.2f}"
    assert "4 ranks in 2 groups of 2" in text
    gbps = next(iter(rows.values()))["concurrent_all_to_all_Bps"] / 1e9
    assert f"every link priced at most at {gbps:.2f} GB/s per rank" in text


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nproc", "4", "--groups", "3"], "--groups 3: does not divide --nproc 4"),
        (["--batch", "0"], "--batch: must be positive, got '0'"),
        (["--batch", "-5"], "--batch: must be positive, got '-5'"),
        (["--steps", "0"], "--steps: must be positive, got '0'"),
        (["--warmup", "-1"], "--warmup: must be >= 0, got '-1'"),
        (["--nproc", "64"], "--nproc 64: 64 local ranks need about"),
        (["--workload", "/no/such.npz"], "--workload: no such stats file '/no/such.npz'"),
        (["--plan-for", "a100"], "--plan-for: expected probed, h100 or a topology JSON file, got 'a100'"),
    ],
)
def test_argument_errors(capsys, monkeypatch, argv, expected):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    try:
        line = fails(capsys, "bench", *argv)
    except SystemExit as e:  # argparse's usage errors
        assert e.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        line = err[0]
    assert line.startswith("flexshard bench: error: ") and expected in line, line


TAKEN = "rank0.err:\n  dist.init_process_group(...)\nDistNetworkError: ... EADDRINUSE ..."
OWN = "rank1.err:\nValueError: bad"  # the run's own failure


@pytest.mark.parametrize(
    ("failures", "tries"), [([TAKEN, OWN], 2), ([OWN], 1), ([TAKEN] * RENDEZVOUS_TRIES, RENDEZVOUS_TRIES)]
)
def test_only_a_taken_rendezvous_port_is_tried_again(monkeypatch, failures, tries):
    """spawn_local's retry, on fake ranks (the detection itself runs on real ranks in
    tests/runtime/test_local_ranks.py): a port taken before rank 0 listened starts the run again on a new
    port, at most RENDEZVOUS_TRIES times; any other failure is raised at once."""
    import flexshard.bench.worker as worker

    ports: list[int] = []
    left = list(failures)
    monkeypatch.setattr(worker, "start_ranks", lambda fn, args, nprocs: ports.append(args[1]))
    monkeypatch.setattr(worker, "wait_for_ranks", lambda *a: (_ for _ in ()).throw(RuntimeError(left.pop(0))))
    with pytest.raises(RuntimeError, match="ValueError: bad" if OWN in failures else "EADDRINUSE"):
        worker.spawn_local(BenchConfig(nproc=2, groups=2))
    assert len(ports) == len(set(ports)) == tries  # a new port each try


def test_a_strategys_thread_cpu_is_the_median_over_ranks_of_each_ranks_median_step():
    gathered = [  # 3 ranks' calling-thread CPU per timed step, s
        {"systems": {"t": {"thread": [0.010, 0.030, 0.020]}}},  # median 0.020
        {"systems": {"t": {"thread": [0.050, 0.040, 0.060]}}},  # 0.050
        {"systems": {"t": {"thread": [0.001, 0.004, 0.002]}}},  # 0.002
    ]
    assert results.thread_cpu_s(gathered, "t", 2.0) == pytest.approx(0.040)  # 0.020 x 2 ranks per core
    assert results.thread_cpu_s(gathered, "t", 0.5) == pytest.approx(0.020)  # a core each at least


def test_round_ratios_are_medians_of_each_round_over_the_ablations():
    steps = np.array([10.0, 30.0, 20.0, 12.0, 14.0, 13.0])  # 2 rounds of 3 steps
    base = np.array([10.0, 10.0, 10.0, 13.0, 13.0, 13.0])
    assert results.round_ratios(steps, base, 2) == [2.0, 1.0]  # medians 20 / 10 and 13 / 13
    assert results.round_ratios(steps, base, 1) == [13.5 / 11.5]
