"""``flexshard probe``: a real multi-process gloo probe on loopback, a rank that never joins, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import time

import numpy as np
import pytest
from cli_helpers import fails, run

from flexshard import probe as probe_cli
from flexshard.cli import main
from topology import cluster_view, read_json

SMALL_WORKLOAD = ["--workload", "synthetic:6:2e6:1.0"]


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One real probe: 4 spawned gloo processes, 2 groups of 2, --quick with 2 repeats (not its 3); (topology
    path, printed report, log lines)."""
    path = tmp_path_factory.mktemp("probe") / "topo.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(
            ["probe", "--nproc", "4", "--groups", "2", "--quick", "--repeats", "2", "--timeout", "30"]
            + ["--out", str(path)]
        )
    assert rc == 0
    return path, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_four_rank_probe_writes_a_topology_the_planner_accepts(probed, capsys):
    path, _, _ = probed
    G = read_json(path)  # validates
    view = cluster_view(G)
    assert view.num_ranks == 4
    assert view.groups == ((0, 1), (2, 3))
    assert (view.intra_bw_Bps > 0).all() and (view.inter_bw_Bps > 0).all()
    measured = [a for *_, a in G.edges(data=True) if a.get("measured")]
    assert measured and all(a["measured_by"] == "collective" and a["bandwidth_GBps"] > 0 for a in measured)
    meta = G.graph["probe"]
    assert (meta["repeats"], len(meta["sizes"])) == (2, 3)  # --repeats over --quick's 3, its 3 sizes kept
    assert meta["groups"] == [[0, 1], [2, 3]]
    assert len(meta["pairs"]) == 6
    assert set(meta["collectives"]) == {
        "all_to_all/group",
        "all_to_all/world",
        "all_to_all/rail",
        "all_reduce/replicas",
        "all_reduce/world",
    }
    latency = view.collective_latency_us  # the measured latencies, read back from the written file
    assert set(latency) == {"all_to_all", "all_reduce"}
    assert set(latency["all_to_all"]) == {"group", "world", "rail"} and set(latency["all_reduce"]) == {
        "rail",
        "world",
    }
    assert latency["all_to_all"]["world"].keys() == {4} and latency["all_reduce"]["rail"].keys() == {2}
    assert all(c["bandwidth_GBps"] > 0 for c in meta["collectives"].values())
    assert np.isfinite([p["latency_us"] for p in meta["pairs"].values()]).all()
    rc, out, err = run(capsys, "plan", *SMALL_WORKLOAD, "--topology", str(path))
    assert rc == 0, err
    assert "4" in out


@pytest.mark.slow
def test_probe_prints_groups_table_and_slow_parts(probed):
    path, out, log = probed
    assert "NVML" in out  # this machine has none: said in one line, then measured
    assert "groups: g0: 0, 1; g1: 2, 3" in out
    for cls in ("p2p/intra", "p2p/inter", "all_to_all/group", "all_to_all/world", "all_reduce/replicas"):
        assert cls in out
    assert "slow:" in out and f"wrote {path}" in log.splitlines() and "wrote" not in out  # a log line


@pytest.mark.slow
def test_rank_that_never_joins_is_named_within_the_timeout(tmp_path, capsys):
    out_path = tmp_path / "never.json"
    start = time.monotonic()
    line = fails(
        capsys, "probe", "--nproc", "2", "--world-size", "3", "--timeout", "3", "--out", str(out_path)
    )
    elapsed = time.monotonic() - start
    assert "rank 2 of 3 did not join within 3 s" in line and "joined: 0, 1" in line
    assert elapsed < 3 + 60  # the timeout plus process start-up, never a hang
    assert not out_path.exists()


def test_bad_probe_arguments_fail_before_any_process_starts(capsys):
    start = time.monotonic()
    line = fails(capsys, "probe", "--nproc", "4", "--groups", "3")
    assert line == "flexshard probe: error: --groups: 3 groups do not divide 4 ranks evenly; choose a divisor"
    assert time.monotonic() - start < 60  # bounded by the timeout, with room for a loaded machine
    with pytest.raises(SystemExit):
        main(["probe", "--timeout", "0"])
    capsys.readouterr()


def test_bad_out_fails_first_naming_the_path(tmp_path, capsys, monkeypatch):
    """A bad --out ends the command before any probe process starts, in one line naming the path."""
    started = []
    monkeypatch.setattr(probe_cli, "spawn_local", lambda *a, **k: started.append(a) or "")
    missing = tmp_path / "no" / "topo.json"
    line = fails(capsys, "probe", "--nproc", "2", "--out", str(missing))
    assert line.startswith("flexshard probe: error: --out: ")
    assert str(missing) in line and "does not exist" in line
    assert probe_cli.main(["--out", str(missing)]) == 2  # python -m flexshard.probe: the same line
    assert capsys.readouterr().err.strip().splitlines() == [line]
    folder = fails(capsys, "probe", "--out", str(tmp_path))
    assert str(tmp_path) in folder and "is a folder" in folder
    assert started == []  # the probe never ran


def test_probe_bug_keeps_its_traceback(monkeypatch, capsys):
    """Only bad input is one line and exit 2; anything else is a bug and propagates with its traceback."""

    def broken(*args, **kwargs):
        raise KeyError("not an input error")

    monkeypatch.setattr(probe_cli, "spawn_local", broken)
    with pytest.raises(KeyError):
        probe_cli.main(["--nproc", "2"])
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_bug_in_a_spawned_rank_keeps_its_traceback():
    options = {"out": None, "quick": True, "timeout": 30.0, "groups": None}  # no "name": a bug in every rank
    with pytest.raises(RuntimeError, match=r"(?s)^rank 0 of the probe failed:\nTraceback.*KeyError: 'name'"):
        probe_cli.spawn_local(options, 2)


@pytest.mark.slow
def test_partial_probe_output_is_rejected_naming_the_file(probed, tmp_path, capsys):
    # topology.io covers malformed JSON and missing fields in general; here: a probe file cut short, and a
    # measured edge that lost its bandwidth
    path, _, _ = probed
    cut = tmp_path / "cut.json"
    cut.write_text(path.read_text()[: len(path.read_text()) // 2])
    line = fails(capsys, "plan", *SMALL_WORKLOAD, "--topology", str(cut))
    assert "cut.json" in line and "malformed JSON" in line
    data = json.loads(path.read_text())
    edge = next(e for e in data["edges"] if e.get("measured"))
    del edge["bandwidth_GBps"]
    lost = tmp_path / "lost.json"
    lost.write_text(json.dumps(data))
    line = fails(capsys, "topology", "--topology", str(lost))
    assert "lost.json" in line and "bandwidth_GBps" in line


@pytest.mark.slow
def test_a_taken_rendezvous_port_is_tried_again(monkeypatch, tmp_path):
    """Rank 0 cannot host the store on a port another process listens on: the probe starts again on a new
    port and writes its topology (real ranks; the first try's line is the one store_port_taken reads)."""
    import socket

    from core import osutil
    from core.osutil import free_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:  # another job listening on it
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        handed: list[int] = []

        def ports() -> int:
            handed.append(taken if not handed else free_port())
            return handed[-1]

        monkeypatch.setattr(osutil, "free_port", ports)  # what on_a_free_port calls
        path = tmp_path / "topo.json"
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["probe", "--nproc", "2", "--quick", "--timeout", "10", "--out", str(path)])
    assert rc == 0 and len(handed) == 2 and handed[0] == taken
    assert cluster_view(read_json(path)).num_ranks == 2
    assert not probe_cli.store_port_taken("rank 1: cannot reach the rendezvous store at ... (EADDRINUSE)")
