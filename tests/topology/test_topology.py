"""Topology graphs, presets, JSON files and the derived ClusterView, checked against hand-computed figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

import topology
from topology import (
    PRESETS,
    ClusterView,
    HostSpec,
    TopologyError,
    build_cluster,
    cluster_view,
    from_preset,
    groups,
    h100_cluster,
    load_topology,
    nvl72_pod,
    read_json,
    skewed_fabric,
    slow_links,
    summary,
    write_json,
)
from topology.presets import H100_NCCL_LATENCY_US, NCCL_LATENCY_SOURCE

GB = 1e9


def assert_views_equal(a: ClusterView, b: ClusterView) -> None:
    assert a.groups == b.groups
    assert a.host_of_rank == b.host_of_rank
    for field in (
        "group_of_rank",
        "local_index",
        "intra_bw_Bps",
        "inter_bw_Bps",
        "intra_latency_s",
        "inter_latency_s",
        "memory_bytes",
    ):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype, field
        assert np.array_equal(x, y), field


def node_link(G: nx.Graph) -> dict:
    return nx.node_link_data(G, edges="edges")


def write_data(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(data))
    return path


# --- presets and views --------------------------------------------------------------------------------


def test_h100_two_nodes_view():
    G = h100_cluster(2)
    assert G.graph == {
        "schema": "flexshard-topology/1",
        "name": "h100:2x8",
        "collective_latency_us": H100_NCCL_LATENCY_US,
        "collective_latency_source": NCCL_LATENCY_SOURCE,
    }
    view = cluster_view(G)
    assert view.num_ranks == 16
    assert view.groups == (tuple(range(8)), tuple(range(8, 16)))
    assert groups(G) == [list(range(8)), list(range(8, 16))]
    assert view.group_of_rank.tolist() == [0] * 8 + [1] * 8
    assert view.local_index.tolist() == list(range(8)) * 2
    assert view.host_of_rank == ("node0",) * 8 + ("node1",) * 8
    assert np.all(view.intra_bw_Bps == 450e9)
    assert np.all(view.inter_bw_Bps == 50e9)
    assert np.all(view.intra_latency_s == 3e-6)
    # Both hosts sit under one leaf, so no spine: 2 * (pcie 1 us + nic->leaf 2 us).
    assert np.allclose(view.inter_latency_s, 6e-6, rtol=0, atol=1e-15)
    assert np.all(view.memory_bytes == 80 * 2**30)
    assert view.uniform_group_size == 8


def test_h100_non_blocking_spine():
    view = cluster_view(h100_cluster(8))
    # 2 leaves of 4 hosts: uplink 32 NICs * 50 GB/s = 1600 GB/s shared by 32 GPUs -> 50 GB/s each.
    assert np.all(view.inter_bw_Bps == 50e9)
    assert np.allclose(view.inter_latency_s, 8e-6, rtol=0, atol=1e-15)  # 2 * (1 + 2 + 1) us
    assert view.num_groups == 8


def test_h100_custom_gpus_per_node():
    view = cluster_view(from_preset("h100:8x4"))
    assert view.num_ranks == 32
    assert view.uniform_group_size == 4


def test_skewed_fabric_default_figures():
    view = cluster_view(skewed_fabric(8))
    inter = view.inter_bw_Bps
    nic = 50.0
    # Host 0: NIC at 50/4 = 12.5 GB/s. Leaf0 = hosts 0,1: uplink (8*12.5 + 8*50)/2 = 250 GB/s over 16 GPUs
    # = 15.625 GB/s, above 12.5, so the slow NIC is the bottleneck.
    assert np.all(inter[:8] == nic / 4 * GB)
    assert np.all(inter[8:16] == 250 / 16 * GB)  # host 1 shares leaf0's uplink
    assert np.all(inter[16:] == (16 * 50 / 2) / 16 * GB)  # other leaves: 400 GB/s over 16 GPUs = 25
    assert np.all(view.intra_bw_Bps == 450e9)


def test_skewed_fabric_uplink_bottleneck_hand_computed():
    G = skewed_fabric(4, gpus_per_node=2, slow_hosts=(1,), slow_factor=2.0, oversubscription=4.0)
    # leaf0 = hosts 0 (2 NICs x 50) and 1 (2 NICs x 25): uplink (100 + 50) / 4 = 37.5 GB/s over 4 GPUs.
    assert G.edges["leaf0", "spine0"]["bandwidth_GBps"] == 37.5
    assert G.edges["leaf1", "spine0"]["bandwidth_GBps"] == 50.0  # (4 * 50) / 4
    view = cluster_view(G)
    assert view.inter_bw_Bps.tolist() == [9.375e9] * 4 + [12.5e9] * 4


def test_skewed_fabric_bad_slow_host():
    with pytest.raises(TopologyError, match="slow_hosts"):
        skewed_fabric(2, slow_hosts=(5,))


def test_nvl72_two_pods():
    G = nvl72_pod(2)
    view = cluster_view(G)
    assert view.num_ranks == 144
    assert view.groups == (tuple(range(72)), tuple(range(72, 144)))
    assert view.local_index.tolist() == list(range(72)) * 2
    assert len(set(view.host_of_rank)) == 36
    assert view.host_of_rank[:5] == ("pod0-host0",) * 4 + ("pod0-host1",)
    assert sum(1 for _, k in G.nodes(data="kind") if k == "host") == 36
    assert np.all(view.intra_bw_Bps == 900e9)
    assert np.all(view.inter_bw_Bps == 50e9)
    local_ranks = [a["local_rank"] for _, a in G.nodes(data=True) if a["kind"] == "gpu"]
    assert set(local_ranks) == {0, 1, 2, 3}


def test_pcie_only_box_groups_by_host():
    hosts = [HostSpec(f"box{i}", 4, nvlink_GBps=None, pcie_GBps=32.0, nic_GBps=25.0) for i in range(2)]
    view = cluster_view(build_cluster("pcie", hosts))
    assert view.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert np.all(view.intra_bw_Bps == 32e9)
    assert np.all(view.intra_latency_s == 1e-6)
    assert np.all(view.inter_bw_Bps == 25e9)


def test_groups_spanning_hosts_ordered_by_lowest_rank():
    hosts = [HostSpec("a", 2, group="g1"), HostSpec("b", 2, group="g0"), HostSpec("c", 2, group="g1")]
    view = cluster_view(build_cluster("mixed", hosts))
    assert view.groups == ((0, 1, 4, 5), (2, 3))
    assert view.local_index.tolist() == [0, 1, 0, 1, 2, 3]
    assert view.group_of_rank.tolist() == [0, 0, 1, 1, 0, 0]


def test_single_group_without_network():
    view = cluster_view(build_cluster("lonely", [HostSpec("solo", 4, nic_GBps=None)]))
    assert np.all(view.inter_bw_Bps == 0.0)
    with pytest.raises(TopologyError, match="no network path"):
        cluster_view(build_cluster("cut", [HostSpec("a", 2, nic_GBps=None), HostSpec("b", 2)]))


# --- preset specs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "ranks"),
    [("h100", 64), ("h100:2", 16), ("nvl72", 72), ("nvl72:2", 144), ("skewed", 64), (" H100:1x2 ", 2)],
)
def test_from_preset_sizes(spec, ranks):
    assert cluster_view(from_preset(spec)).num_ranks == ranks


@pytest.mark.parametrize("spec", ["h100:0", "h100:x", "h100:2x0", "nvl72:2x4", "h100:-1"])
def test_from_preset_bad_size(spec):
    with pytest.raises(TopologyError, match="valid presets: h100") as err:
        from_preset(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("spec", "gpus"),
    [
        ("h100:100000", "800,000"),
        ("h100:4097", "32,776"),
        ("nvl72:456", "32,832"),
        ("skewed:4097x8", "32,776"),
    ],
)
def test_presets_beyond_the_size_limit_fail_at_once(spec, gpus):
    with pytest.raises(TopologyError) as err:
        from_preset(spec)
    assert str(err.value) == (
        f"preset {spec!r}: {gpus} GPUs, over the 32,768 a preset builds; describe a larger cluster in a "
        "topology file"
    )


def test_a_preset_at_the_limit_builds(monkeypatch):
    from topology import presets

    monkeypatch.setattr(presets, "MAX_PRESET_GPUS", 16)  # the real limit's graph takes 25 s to build
    assert cluster_view(from_preset("h100:2")).num_ranks == 16
    with pytest.raises(TopologyError, match="24 GPUs, over the 16 a preset builds"):
        from_preset("h100:3")


def test_unknown_preset():
    with pytest.raises(TopologyError, match=r"preset 'dgx'.*h100.*nvl72.*skewed"):
        from_preset("dgx:4")
    assert set(PRESETS) == {"h100", "nvl72", "skewed"}


# --- JSON ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["h100:2", "skewed:8", "nvl72:2"])
def test_json_round_trip(tmp_path, spec):
    G = from_preset(spec)
    path = tmp_path / "t.json"
    write_json(G, path)
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left behind
    H = read_json(path)
    assert H.graph == G.graph
    assert dict(H.nodes(data=True)) == dict(G.nodes(data=True))
    assert_views_equal(cluster_view(H), cluster_view(G))
    assert slow_links(H) == slow_links(G)


def test_load_topology_path_or_preset(tmp_path):
    path = tmp_path / "h100:2"  # a file named like a preset: the existing path wins
    write_json(h100_cluster(1, 2), path)
    assert cluster_view(load_topology(str(path))).num_ranks == 2
    assert cluster_view(load_topology("h100:2")).num_ranks == 16
    with pytest.raises(TopologyError, match="neither an existing file nor a preset"):
        load_topology(str(tmp_path / "missing.json"))


def test_malformed_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"nodes": [\n  {"id": 1,}\n]}')
    with pytest.raises(TopologyError, match=r"malformed JSON at line 2, column \d+"):
        read_json(path)


def test_unreadable_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read"):
        read_json(tmp_path / "absent.json")
    with pytest.raises(TopologyError, match="cannot read"):
        read_json(tmp_path)  # a directory


def test_nan_bandwidth(tmp_path):
    data = node_link(h100_cluster(1, 2))
    data["edges"][0]["bandwidth_GBps"] = float("nan")
    with pytest.raises(TopologyError, match=r"field 'bandwidth_GBps' = nan") as err:
        read_json(write_data(tmp_path, data))
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize("value", [0, -5.0, "fast", True])
def test_non_positive_or_non_number_bandwidth(tmp_path, value):
    data = node_link(h100_cluster(1, 2))
    data["edges"][0]["bandwidth_GBps"] = value
    with pytest.raises(TopologyError, match="bandwidth_GBps"):
        read_json(write_data(tmp_path, data))


def test_no_gpus(tmp_path):
    data = node_link(h100_cluster(1, 2))
    data["nodes"] = [n for n in data["nodes"] if n["kind"] != "gpu"]
    data["edges"] = [e for e in data["edges"] if "gpu" not in e["source"] + e["target"]]
    with pytest.raises(TopologyError, match="no node of kind 'gpu'"):
        read_json(write_data(tmp_path, data))


def test_duplicate_rank(tmp_path):
    data = node_link(h100_cluster(1, 4))
    gpus = [n for n in data["nodes"] if n["kind"] == "gpu"]
    gpus[3]["rank"] = 1
    with pytest.raises(TopologyError, match=r"field 'rank' = 1 is used by gpus"):
        read_json(write_data(tmp_path, data))


def test_non_contiguous_rank(tmp_path):
    data = node_link(h100_cluster(1, 4))
    [n for n in data["nodes"] if n["kind"] == "gpu"][3]["rank"] = 7
    with pytest.raises(TopologyError, match=r"field 'rank': ranks must be contiguous 0..3; found \[7\]"):
        read_json(write_data(tmp_path, data))


def test_wrong_schema(tmp_path):
    data = node_link(h100_cluster(1, 2))
    data["graph"]["schema"] = "other/2"
    with pytest.raises(TopologyError, match="field 'schema' = 'other/2'"):
        read_json(write_data(tmp_path, data))


@pytest.mark.parametrize(
    ("where", "field"),
    [("nodes", "memory_bytes"), ("nodes", "kind"), ("edges", "latency_us"), ("edges", "kind")],
)
def test_missing_attribute(tmp_path, where, field):
    data = node_link(h100_cluster(1, 2))
    item = next(x for x in data[where] if field in x)
    del item[field]
    with pytest.raises(TopologyError, match=field):
        read_json(write_data(tmp_path, data))


@pytest.mark.parametrize("cores", [0, -2, "2", 1.5, True])
def test_a_hosts_cores_must_be_a_positive_integer(tmp_path, cores):
    data = node_link(h100_cluster(1, 2))
    next(x for x in data["nodes"] if x["kind"] == "host")["cores"] = cores
    expected = f"node 'node0': field 'cores' = {cores!r}; expected an integer > 0"
    with pytest.raises(TopologyError, match=re.escape(expected)):
        read_json(write_data(tmp_path, data))
    next(x for x in data["nodes"] if x["kind"] == "host")["cores"] = 4
    assert cluster_view(read_json(write_data(tmp_path, data))).ranks_per_core == 0.5  # 2 GPUs, 4 cores


def test_edge_to_unknown_node(tmp_path):
    data = node_link(h100_cluster(1, 2))
    data["edges"][0]["target"] = "nowhere"
    with pytest.raises(TopologyError, match="field 'target' = 'nowhere'"):
        read_json(write_data(tmp_path, data))


def test_write_refuses_invalid_graph(tmp_path):
    G = h100_cluster(1, 2)
    G.nodes["node0/gpu1"]["rank"] = 0
    with pytest.raises(TopologyError, match="rank"):
        write_json(G, tmp_path / "x.json")
    assert list(tmp_path.iterdir()) == []


# --- slow links and summary ---------------------------------------------------------------------------


def test_slow_links_find_slow_host_nics():
    found = slow_links(skewed_fabric(8))
    assert {(d["u"], d["v"]) for d in found} == {(f"node0/nic{i}", "leaf0") for i in range(8)}
    assert all(
        d["kind"] == "network"
        and d["bandwidth_GBps"] == 12.5
        and d["median_GBps"] == 50.0
        and d["ratio"] == 0.25
        for d in found
    )


@pytest.mark.parametrize("spec", ["h100:8", "h100:2", "nvl72:2"])
def test_slow_links_uniform_cluster(spec):
    assert slow_links(from_preset(spec)) == []


def test_summary():
    text = summary(skewed_fabric(8))
    assert "64 GPUs, 8 hosts, 8 groups of 8" in text
    assert "inter GB/s             12.50     25.00     25.00" in text
    assert "slow links: 8" in text
    assert "slow links: none" in summary(h100_cluster(2))


def test_package_imports_no_torch_or_planner():
    code = (
        "import sys, topology; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'solvers', 'flexshard', 'pulp')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(topology.__file__).parent.parent)


def test_errors_are_value_errors_and_one_line():
    with pytest.raises(ValueError) as err:
        from_preset("nope")
    assert "\n" not in str(err.value)


def test_atomic_open_replaces_on_success_and_keeps_the_old_file_on_error(tmp_path):
    from core.osutil import atomic_open

    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError, match="boom"), atomic_open(target) as f:
        f.write("half")
        raise RuntimeError("boom")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no temporary file left
    with atomic_open(target, "wb") as f:
        f.write(b"new\n")
    assert target.read_bytes() == b"new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
