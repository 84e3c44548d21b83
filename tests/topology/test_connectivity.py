"""Topologies the planner must not price: hosts the network does not join, links listed twice (which
networkx would merge silently) and self-loops. Each is refused with one line naming the hosts or the
edge, on read and in the builders; one host with no network at all is a valid cluster of one group."""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from topology import (
    HostSpec,
    TopologyError,
    add_link,
    add_node_group,
    add_switch,
    build_cluster,
    cluster_view,
    h100_cluster,
    new_topology,
    read_json,
    validate,
    write_json,
)


def node_link(G: nx.Graph) -> dict:
    return nx.node_link_data(G, edges="edges")


def written(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(data))
    return path


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# --- hosts with no network path -----------------------------------------------------------------------


def two_leaves_without_spine() -> nx.Graph:
    """Hosts a and b, each with 2 GPUs and NICs, each on its own leaf switch, and no spine above them."""
    G = new_topology("islands")
    for host, leaf in (("a", "leaf0"), ("b", "leaf1")):
        add_node_group(G, host, 2)
        add_switch(G, leaf, "leaf")
        for i in range(2):
            add_link(G, f"{host}/nic{i}", leaf, "network", 50.0, 2.0)
    return G


def test_hosts_on_unjoined_leaves_are_refused_not_priced():
    """Before: each GPU's path reached its own leaf, so the view priced 50 GB/s between the hosts."""
    with pytest.raises(TopologyError) as err:
        validate(two_leaves_without_spine())
    assert one_line(err) == (
        "hosts 'a' and 'b': no network path between them (gpu 'a/gpu0' cannot reach gpu 'b/gpu0' over any "
        "link); link their NICs to a common fabric"
    )
    with pytest.raises(TopologyError, match="^hosts 'a' and 'b': no network path"):
        cluster_view(two_leaves_without_spine())


def test_a_disconnected_file_is_refused_naming_the_hosts(tmp_path):
    data = node_link(h100_cluster(3, 2))  # node0..node2 on leaf0
    data["edges"] = [e for e in data["edges"] if not e["source"].startswith("node2/nic")]
    with pytest.raises(TopologyError) as err:
        read_json(written(tmp_path, data))
    assert one_line(err).endswith(
        "topo.json': hosts 'node0' and 'node2': no network path between them (gpu 'node0/gpu0' cannot reach "
        "gpu 'node2/gpu0' over any link); link their NICs to a common fabric"
    )


def test_a_host_without_network_beside_networked_hosts_is_refused():
    G = build_cluster("cut", [HostSpec("a", 2), HostSpec("b", 2, nic_GBps=None), HostSpec("c", 2)])
    with pytest.raises(TopologyError, match="^hosts 'a' and 'b': no network path between them"):
        validate(G)


def test_gpus_of_one_host_with_no_link_between_them_are_refused():
    G = build_cluster("bare", [HostSpec("box", 2, nvlink_GBps=None, nic_GBps=None)])  # no edge at all
    with pytest.raises(TopologyError) as err:
        validate(G)
    assert one_line(err) == "host 'box': gpus 'box/gpu0' and 'box/gpu1' are not joined by any path of links"


def test_a_path_through_a_host_node_does_not_join_gpus():
    """Host nodes are metadata: a link drawn to one (outside the schema) is no route between GPUs."""
    G = two_leaves_without_spine()
    G.add_edge("leaf0", "a", kind="network", bandwidth_GBps=50.0, latency_us=1.0)
    G.add_edge("a", "leaf1", kind="network", bandwidth_GBps=50.0, latency_us=1.0)
    with pytest.raises(TopologyError, match="^hosts 'a' and 'b': no network path"):
        validate(G)


def test_one_host_without_any_network_is_one_group(tmp_path):
    G = build_cluster("solo", [HostSpec("solo", 4, nic_GBps=None)])
    write_json(G, tmp_path / "solo.json")
    view = cluster_view(read_json(tmp_path / "solo.json"))
    assert view.num_groups == 1 and not view.has_inter_group
    assert np.array_equal(view.inter_bw_Bps, np.zeros(4)) and np.array_equal(
        view.inter_latency_s, np.zeros(4)
    )
    assert np.all(view.intra_bw_Bps == 450e9)


# --- links listed twice, self-loops ---------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
def test_a_repeated_edge_in_a_file_is_refused_naming_it(tmp_path, reverse):
    data = node_link(h100_cluster(1, 2))
    first = data["edges"][0]
    again = dict(first, bandwidth_GBps=1.0)
    if reverse:  # the graph is undirected: b-a repeats a-b
        again["source"], again["target"] = first["target"], first["source"]
    data["edges"].append(again)
    last = len(data["edges"]) - 1
    with pytest.raises(TopologyError) as err:
        read_json(written(tmp_path, data))
    assert one_line(err).endswith(
        f"topo.json': edges[{last}]: edge {again['source']!r}-{again['target']!r} repeats edges[0]; a pair "
        "of nodes has one link (sum parallel lanes into its bandwidth)"
    )


def test_a_repeated_link_in_an_old_links_file_is_refused(tmp_path):
    data = node_link(h100_cluster(1, 2))
    data["links"] = data.pop("edges")
    data["links"].insert(1, dict(data["links"][0]))
    with pytest.raises(
        TopologyError, match=r"links\[1\]: edge 'nvswitch/node0'-'node0/gpu0' repeats links\[0\]"
    ):
        read_json(written(tmp_path, data))


def test_a_self_loop_in_a_file_is_refused_naming_it(tmp_path):
    data = node_link(h100_cluster(1, 2))
    data["edges"].append({"source": "leaf0", "target": "leaf0", "kind": "network", "bandwidth_GBps": 1.0,
                          "latency_us": 1.0})  # fmt: skip
    with pytest.raises(TopologyError) as err:
        read_json(written(tmp_path, data))
    last = len(data["edges"]) - 1
    assert one_line(err).endswith(
        f"topo.json': edges[{last}]: edge 'leaf0'-'leaf0' is a self-loop; a link joins two different nodes"
    )


def test_a_repeated_node_in_a_file_is_refused_naming_it(tmp_path):
    data = node_link(h100_cluster(1, 2))
    data["nodes"].append(dict(data["nodes"][1], memory_bytes=1))
    where = next(i for i, n in enumerate(data["nodes"]) if n["id"] == data["nodes"][1]["id"])
    with pytest.raises(TopologyError) as err:
        read_json(written(tmp_path, data))
    assert one_line(err).endswith(
        f"nodes[{len(data['nodes']) - 1}]: node {data['nodes'][1]['id']!r} repeats nodes[{where}]; list each "
        "node once"
    )


def test_builders_refuse_a_second_link_and_a_self_loop():
    G = h100_cluster(1, 2)
    with pytest.raises(TopologyError) as err:
        add_link(G, "nvswitch/node0", "node0/gpu0", "nvlink", 100.0, 1.0)
    assert one_line(err) == (
        "link 'nvswitch/node0'-'node0/gpu0': already in the topology (kind 'nvlink'); a pair of nodes has "
        "one link, its bandwidth the sum of the lanes"
    )
    assert G.edges["node0/gpu0", "nvswitch/node0"]["bandwidth_GBps"] == 450.0  # not overwritten
    with pytest.raises(TopologyError, match="^link 'leaf0'-'leaf0': a self-loop"):
        add_link(G, "leaf0", "leaf0", "network", 1.0, 1.0)


def test_validate_refuses_a_self_loop_added_by_hand(tmp_path):
    G = h100_cluster(1, 2)
    G.add_edge("leaf0", "leaf0", kind="network", bandwidth_GBps=1.0, latency_us=1.0)
    with pytest.raises(TopologyError) as err:
        write_json(G, tmp_path / "x.json")
    assert one_line(err) == "edge 'leaf0'-'leaf0': a self-loop; a link joins two different nodes"
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_whose_nic_reaches_no_switch_is_not_priced_at_its_pcie_link():
    """node1/gpu1's NIC lost its network link, but the GPU still reaches the others through its group's
    NVSwitch: the graph is connected, yet its way out of the group ended at the NIC, and the view priced
    its inter-group bandwidth at the PCIe edge (64 GB/s, above the 50 GB/s NICs). Refused, naming both."""
    G = h100_cluster(2, 2)
    G.remove_edge("node1/nic1", "leaf0")
    validate(G)  # connected
    with pytest.raises(TopologyError) as err:
        cluster_view(G)
    assert one_line(err) == (
        "gpu 'node1/gpu1': no network path (pcie -> nic -> switch) to reach other groups; NIC 'node1/nic1' "
        "has no network link"
    )
    single = h100_cluster(1, 2)
    single.remove_edge("node0/nic1", "leaf0")
    assert cluster_view(single).num_groups == 1  # one group: nothing has to leave it
