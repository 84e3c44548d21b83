"""``flexshard probe``: a real multi-process gloo probe on loopback, a rank that never joins, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import time

import numpy as np
import pytest
from cli_helpers import fails, run

from flexshard.cli import main
from topology import cluster_view, read_json

SMALL_WORKLOAD = ["--workload", "synthetic:6:2e6:1.0"]


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One real probe: 4 spawned gloo processes, 2 groups of 2, --quick; (topology path, printed report)."""
    path = tmp_path_factory.mktemp("probe") / "topo.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(
            ["probe", "--nproc", "4", "--groups", "2", "--quick", "--timeout", "30", "--out", str(path)]
        )
    assert rc == 0
    return path, out.getvalue()


def test_four_rank_probe_writes_a_topology_the_planner_accepts(probed, capsys):
    path, _ = probed
    G = read_json(path)  # validates
    view = cluster_view(G)
    assert view.num_ranks == 4
    assert view.groups == ((0, 1), (2, 3))
    assert (view.intra_bw_Bps > 0).all() and (view.inter_bw_Bps > 0).all()
    measured = [a for *_, a in G.edges(data=True) if a.get("measured")]
    assert measured and all(a["measured_by"] == "collective" and a["bandwidth_GBps"] > 0 for a in measured)
    meta = G.graph["probe"]
    assert meta["groups"] == [[0, 1], [2, 3]]
    assert len(meta["pairs"]) == 6
    assert set(meta["collectives"]) == {"all_to_all/group", "all_to_all/world", "all_reduce/replicas"}
    assert all(c["bandwidth_GBps"] > 0 for c in meta["collectives"].values())
    assert np.isfinite([p["latency_us"] for p in meta["pairs"].values()]).all()
    rc, out, err = run(capsys, "plan", *SMALL_WORKLOAD, "--topology", str(path))
    assert rc == 0, err
    assert "4" in out


def test_probe_prints_groups_table_and_slow_parts(probed):
    path, out = probed
    assert "NVML" in out  # this machine has none: said in one line, then measured
    assert "groups: g0: 0, 1; g1: 2, 3" in out
    for cls in ("p2p/intra", "p2p/inter", "all_to_all/group", "all_to_all/world", "all_reduce/replicas"):
        assert cls in out
    assert "slow:" in out and f"wrote {path}" in out


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


def test_bad_probe_arguments_fail_before_any_process_starts(tmp_path, capsys):
    start = time.monotonic()
    assert "do not divide 4 ranks" in fails(capsys, "probe", "--nproc", "4", "--groups", "3")
    missing = tmp_path / "no" / "topo.json"
    assert "does not exist" in fails(capsys, "probe", "--out", str(missing))
    assert time.monotonic() - start < 60  # bounded by the timeout, with room for a loaded machine
    with pytest.raises(SystemExit):
        main(["probe", "--timeout", "0"])
    capsys.readouterr()


def test_partial_probe_output_is_rejected_naming_the_file(probed, tmp_path, capsys):
    # topology.io covers malformed JSON and missing fields in general; here: a probe file cut short, and a
    # measured edge that lost its bandwidth
    path, _ = probed
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
