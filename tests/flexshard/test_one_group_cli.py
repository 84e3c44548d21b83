"""The most common first run: one host, one NVLink group. ``flexshard probe`` then ``plan``, ``simulate``
and ``topology`` on its file, and on the ``h100:1`` / ``h100:1x4`` presets.

Each reproduction of issue 22 is a test here: ``plan`` on a probed one-host file crashed writing ``inf``
into the plan (exit 1), a ``--nproc 4 --groups 1`` file crashed placement (PuLP: NaN/inf), ``simulate``
printed ``inf`` ms, ``-0 B`` and "inter vs row-wise -346.7%" (0 against -2e-10 bytes)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
from cli_helpers import fails, run
from torchrun_jobs import run_torchrun

from flexshard.plan_file import write_plan
from flexshard.report import human_bytes
from topology import cluster_view, h100_cluster, read_json, write_json

FIXTURES = Path(__file__).resolve().parents[1] / "topology" / "fixtures"
PROBED = {  # made by the real probe on one host: `flexshard probe --quick` and `--nproc 4 --groups 1`
    "2 ranks": FIXTURES / "probe_one_host.json",
    "4 ranks, --groups 1": FIXTURES / "probe_one_group_4.json",
}


def strict_json(text: str):
    """JSON as the standard has it: Infinity and NaN are refused."""

    def refuse(name: str):
        raise AssertionError(f"non-finite number {name} in a JSON file")

    return json.loads(text, parse_constant=refuse)


def _table(text: str) -> list[str]:
    """The rows of simulate's table (after its title and heading, before the legend and headline)."""
    lines = text.splitlines()[3:]
    return lines[: next(i for i, line in enumerate(lines) if not line.strip() or line.startswith("* "))]


def assert_clean(text: str) -> None:
    """No -0 B and no infinite or undefined figure (inf, nan as words: not "infeasible")."""
    assert "-0 B" not in text
    assert re.search(r"(?<![a-z])(inf|nan)(?![a-z])", text.lower()) is None, text


def plan_on(capsys, topology: str, out: Path, *more: str) -> tuple[str, dict]:
    rc, text, err = run(capsys, "plan", "--topology", topology, "--out", str(out), *more)
    assert rc == 0, err
    return text, strict_json(out.read_text())


@pytest.mark.parametrize("name", sorted(PROBED))
def test_plan_on_a_probed_one_host_file(capsys, tmp_path, name):
    text, doc = plan_on(capsys, str(PROBED[name]), tmp_path / "plan.json")
    view = cluster_view(read_json(PROBED[name]))
    assert doc["world"] == {"size": view.num_ranks, "groups": [list(range(view.num_ranks))]}
    predicted = doc["predicted"]
    assert predicted["inter_group_bytes"] == 0.0 and predicted["intra_group_bytes"] > 0
    assert math.isfinite(predicted["modeled_time_s"]) and predicted["modeled_time_s"] > 0
    assert all(math.isfinite(t) for t in predicted["per_rank_time_s"])
    assert all(t["warm_rows"] == 0 and t["fetch"] == "flat" for t in doc["tables"])
    assert "Bytes per iteration (max of send and receive); one group, so no inter-group links:" in text
    rows = [line.split()[0] for line in text.splitlines() if line.startswith(("intra_group", "inter_group"))]
    assert rows == ["intra_group"]
    assert_clean(text)


def test_plan_balances_the_unequal_links_of_a_probed_group_of_four(capsys, tmp_path):
    """The 4-rank probe measured 3.7-5.3 GB/s inside its one group: placement balances owner shares over
    those links (it used to divide by the missing inter-group bandwidth). Placement balances bytes, so
    this is the bytes objective's plan (under the step objective the even shares' step is shorter)."""
    text, doc = plan_on(
        capsys, str(PROBED["4 ranks, --groups 1"]), tmp_path / "plan.json", "--objective", "bytes"
    )
    assert doc["solver"]["placement"] == "balanced"
    assert "Placement: owner shares balanced by link speed" in text
    assert doc["predicted"]["modeled_time_s"] < doc["solver"]["objective_s"]  # balanced beats even shares


@pytest.mark.parametrize("topology", [*PROBED, "h100:1", "h100:1x4"])
def test_simulate_on_one_group(capsys, topology):
    topology = str(PROBED.get(topology, topology))
    rc, text, err = run(capsys, "simulate", "--topology", topology, "--budgets", "1,2")
    assert rc == 0, err
    assert_clean(text)
    rows = _table(text)
    assert "%" not in "".join(rows)  # inter-group bytes relative to row-wise's 0: no percentage
    table = [line.split() for line in rows]
    assert table and all(row[3:5] == ["0", "B"] or row[3] == "-" for row in table), text
    assert all(row[-1] == "-" for row in table)
    rc, text, err = run(
        capsys, "simulate", "--topology", topology, "--budgets", "1,2", "--dedup", "both", "--json"
    )
    assert rc == 0, err
    records = strict_json(text)
    feasible = [r for r in records if r["feasible"]]
    assert len(feasible) >= len(records) - 4  # table-wise may not fit
    assert all(r["inter_group_bytes"] == 0.0 and math.isfinite(r["modeled_time_s"]) for r in feasible)


def test_simulate_h100_1_at_2x_has_no_negative_zero_or_percentage(capsys):
    """The issue's reproduction: ``simulate --topology h100:1 --budgets 2`` printed -0 B and -346.7%."""
    rc, text, err = run(capsys, "simulate", "--topology", "h100:1", "--budgets", "2")
    assert rc == 0, err
    assert "-0 B" not in text and "-346.7%" not in text and "%" not in "".join(_table(text))
    flexshard = next(line.split() for line in text.splitlines() if " *flexshard " in line)
    assert flexshard[3:5] == ["0", "B"] and flexshard[-1] == "-"


def test_topology_summary_of_one_group_says_there_are_no_inter_group_links(capsys):
    rc, text, err = run(capsys, "topology", "--topology", str(PROBED["2 ranks"]))
    assert rc == 0, err
    lines = text.splitlines()
    assert "topology 'one-host': 2 GPUs, 1 hosts, 1 groups of 2" in lines[0]
    for label in ("inter GB/s", "inter latency us"):
        line = next(line for line in lines if line.startswith(label))
        assert line.split()[-8:] == ["-", "-", "-", "(one", "group:", "no", "inter-group", "links)"]


@pytest.mark.parametrize("x", [-2.3e-10, -0.4, 0.0, 1e-12, 0.49])
def test_human_bytes_never_prints_negative_zero(x):
    assert human_bytes(x) == "0 B"
    assert human_bytes(-3.0) == "-3 B" and human_bytes(0.6) == "1 B"


def test_a_non_finite_number_is_never_written_to_a_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    doc = {"schema": "x", "predicted": {"per_rank_time_s": [0.1, float("inf")]}, "solver": {"gap": 0.0}}
    with pytest.raises(ValueError, match=r"field 'predicted.per_rank_time_s\[1\]' = inf is not a finite"):
        write_plan(path, doc)
    doc["predicted"]["per_rank_time_s"][1] = float("nan")
    with pytest.raises(ValueError, match=r"'predicted.per_rank_time_s\[1\]' = nan"):
        write_plan(path, doc)
    assert list(tmp_path.iterdir()) == []


# --- topologies refused before any planning: one line, exit 2, no plan file ------------------------------


def _broken(tmp_path: Path, what: str) -> Path:
    path = tmp_path / f"{what}.json"
    write_json(h100_cluster(2, 2), path)
    data = json.loads(path.read_text())
    link = {"kind": "network", "bandwidth_GBps": 50.0, "latency_us": 1.0}
    if what == "disconnected":  # node1's NICs lose their link to the leaf
        data["edges"] = [e for e in data["edges"] if not e["source"].startswith("node1/nic")]
    elif what == "duplicate":  # node0/nic1 - leaf0 again, the other way round
        data["edges"].append({"source": "leaf0", "target": "node0/nic1", **link})
    else:
        data["edges"].append({"source": "leaf0", "target": "leaf0", **link})
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("what", "message"),
    [
        (
            "disconnected",
            "hosts 'node0' and 'node1': no network path between them (gpu 'node0/gpu0' cannot reach gpu "
            "'node1/gpu0' over any link); link their NICs to a common fabric",
        ),
        ("duplicate", "edges[{last}]: edge 'leaf0'-'node0/nic1' repeats edges[{first}]; a pair of nodes has"),
        ("self-loop", "edges[{last}]: edge 'leaf0'-'leaf0' is a self-loop; a link joins two different nodes"),
    ],
)
def test_plan_and_simulate_refuse_a_broken_topology_in_one_line(capsys, tmp_path, what, message):
    path = _broken(tmp_path, what)
    edges = json.loads(path.read_text())["edges"]
    first = next(i for i, e in enumerate(edges) if {e["source"], e["target"]} == {"node0/nic1", "leaf0"})
    message = message.format(last=len(edges) - 1, first=first)
    out = tmp_path / "plan.json"
    line = fails(capsys, "plan", "--topology", str(path), "--out", str(out))
    assert line.startswith(f"flexshard plan: error: topology file '{path}': {message}"), line
    assert not out.exists()
    line = fails(capsys, "simulate", "--topology", str(path), "--budgets", "2")
    assert line.startswith(f"flexshard simulate: error: topology file '{path}': {message}"), line


# --- the real probe on this machine, then the planner (multi-process) ------------------------------------


@pytest.mark.slow
def test_probe_quick_then_plan_and_simulate(capsys, tmp_path):
    """Done when: ``flexshard probe --quick`` followed by ``plan`` and ``simulate`` on that file works on
    one host."""
    topo = tmp_path / "topo.json"
    rc, text, err = run(capsys, "probe", "--quick", "--timeout", "60", "--out", str(topo))
    assert rc == 0, err
    assert cluster_view(read_json(topo)).num_groups == 1
    plan_text, doc = plan_on(capsys, str(topo), tmp_path / "plan.json")
    assert doc["predicted"]["inter_group_bytes"] == 0.0
    assert_clean(plan_text)
    rc, text, err = run(capsys, "simulate", "--topology", str(topo), "--budgets", "1,2")
    assert rc == 0, err
    assert_clean(text)


@pytest.mark.slow
def test_probe_under_torchrun_on_one_host_then_plan(tmp_path, capsys):
    """``torchrun -m flexshard.probe`` on one host (2 workers), then ``plan`` on its file."""
    topo = tmp_path / "topo.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "flexshard.probe", "--quick", "--timeout", "60", "--out", str(topo)]  # fmt: skip
    done = run_torchrun(argv, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    view = cluster_view(read_json(topo))
    assert view.num_ranks == 2 and view.num_groups == 1
    plan_text, doc = plan_on(capsys, str(topo), tmp_path / "plan.json")
    assert doc["predicted"]["inter_group_bytes"] == 0.0
    assert_clean(plan_text)
