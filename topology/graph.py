"""Topology schema and builders: a cluster is a plain :class:`networkx.Graph`; its attributes are the data.

Schema ``flexshard-topology/1`` (``G.graph["schema"]``, ``G.graph["name"]``):

Nodes, by attribute ``kind``:

* ``"gpu"``: ``rank`` (int, ranks 0..N-1 contiguous), ``host`` (str), ``group`` (str, NVLink domain id),
  ``local_rank`` (int, index on its host), ``memory_bytes`` (int), ``model`` (str).
* ``"host"``: ``name`` (str); optional ``cores`` (int > 0: the CPU cores its ranks run on, as a probe saw
  them; the cost model prices each rank's host work slower where ranks outnumber them). Metadata only; no
  edges, so no path routes through a host.
* ``"nvswitch"``: ``group`` (str). The NVLink switch of one group.
* ``"nic"``: ``host`` (str).
* ``"switch"``: ``level`` (``"leaf"`` or ``"spine"``).

Edges (undirected), all with ``kind`` in ``{"nvlink", "pcie", "network"}``, ``bandwidth_GBps`` (per
direction, GB = 1e9 bytes) and ``latency_us`` (microseconds, one way). Layout: GPU --nvlink-- its group's
nvswitch; GPU --pcie-- its NIC; NIC --network-- a leaf switch; leaf --network-- spine. A pair of nodes
has at most one link, no link joins a node to itself, and every GPU reaches every other over links (one
host with no network is fine; hosts the network does not join are refused, not priced).

Optional graph attributes: ``collective_latency_us`` and ``collective_latency_source``, collective
latencies by kind, scope and participants (:mod:`topology.latency`).

Builders: :func:`new_topology`, :func:`add_node_group` (one host with its GPUs and NICs),
:func:`add_switch`, :func:`add_link`, and :func:`build_cluster` (hosts + leaf/spine fabric from
:class:`HostSpec`), which the presets use. :func:`validate` checks any graph against the schema.
"""

# ruff: noqa: N815  (unit suffixes such as _GBps keep their case: B = bytes)

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from core.errors import TopologyError
from topology.latency import graph_latency

SCHEMA = "flexshard-topology/1"
NODE_KINDS = ("gpu", "host", "nvswitch", "nic", "switch")
EDGE_KINDS = ("nvlink", "pcie", "network")
SWITCH_LEVELS = ("leaf", "spine")

# Required node attributes per kind, with the Python type each must have.
NODE_FIELDS: dict[str, dict[str, type]] = {
    "gpu": {"rank": int, "host": str, "group": str, "local_rank": int, "memory_bytes": int, "model": str},
    "host": {"name": str},
    "nvswitch": {"group": str},
    "nic": {"host": str},
    "switch": {"level": str},
}


def gpu_id(host: str, local_rank: int) -> str:
    """Node id of GPU ``local_rank`` on ``host``."""
    return f"{host}/gpu{local_rank}"


def nic_id(host: str, index: int) -> str:
    """Node id of NIC ``index`` on ``host``."""
    return f"{host}/nic{index}"


def nvswitch_id(group: str) -> str:
    """Node id of the NVSwitch of NVLink domain ``group``."""
    return f"nvswitch/{group}"


def new_topology(name: str) -> nx.Graph:
    """An empty topology graph carrying the schema tag and ``name``."""
    return nx.Graph(schema=SCHEMA, name=name)


def _add_node(G: nx.Graph, node: str, kind: str, **attrs: Any) -> None:
    if node in G:
        raise TopologyError(f"node {node!r}: already in the topology (kind {G.nodes[node].get('kind')!r})")
    G.add_node(node, kind=kind, **attrs)


def add_link(G: nx.Graph, u: str, v: str, kind: str, bandwidth_GBps: float, latency_us: float) -> None:
    """Add an undirected link of ``kind`` between existing nodes ``u`` and ``v``.

    ``bandwidth_GBps``: per direction, GB = 1e9 bytes/s; ``latency_us``: one way, microseconds.
    """
    for node in (u, v):
        if node not in G:
            raise TopologyError(f"link {u!r}-{v!r}: node {node!r} is not in the topology; add it first")
    if u == v:
        raise TopologyError(f"link {u!r}-{v!r}: a self-loop; a link joins two different nodes")
    if G.has_edge(u, v):
        raise TopologyError(
            f"link {u!r}-{v!r}: already in the topology (kind {G.edges[u, v].get('kind')!r}); "
            "a pair of nodes has one link, its bandwidth the sum of the lanes"
        )
    if kind not in EDGE_KINDS:
        raise TopologyError(f"link {u!r}-{v!r}: field 'kind' = {kind!r}; expected one of {EDGE_KINDS}")
    _check_bandwidth(f"link {u!r}-{v!r}", bandwidth_GBps)
    _check_latency(f"link {u!r}-{v!r}", latency_us)
    G.add_edge(u, v, kind=kind, bandwidth_GBps=float(bandwidth_GBps), latency_us=float(latency_us))


def add_switch(G: nx.Graph, name: str, level: str) -> str:
    """Add a network switch node (``level`` "leaf" or "spine"); returns its id."""
    if level not in SWITCH_LEVELS:
        raise TopologyError(f"switch {name!r}: field 'level' = {level!r}; expected 'leaf' or 'spine'")
    _add_node(G, name, "switch", level=level)
    return name


def add_node_group(
    G: nx.Graph,
    host: str,
    num_gpus: int,
    *,
    group: str | None = None,
    nvlink_GBps: float | None = 450.0,
    nvlink_latency_us: float = 3.0,
    pcie_GBps: float = 64.0,
    pcie_latency_us: float = 1.0,
    nics: bool = True,
    memory_bytes: int = 80 * 2**30,
    model: str = "H100",
) -> list[str]:
    """Add one host with ``num_gpus`` GPUs (ranks continue after the GPUs already in ``G``).

    Each GPU is linked by NVLink (``nvlink_GBps`` per direction per GPU, GB = 1e9 B/s) to the NVSwitch of
    ``group`` (default: the host itself; the switch is created on first use) and, when ``nics``, by PCIe
    (``pcie_GBps``) to a NIC of its own. ``nvlink_GBps=None`` builds a PCIe-only box (no NVLink; its group
    is the host). NICs are connected to the fabric later (:func:`build_cluster` or :func:`add_link`).
    Returns the GPU node ids in local order.
    """
    if num_gpus <= 0:
        raise TopologyError(f"host {host!r}: field 'num_gpus' = {num_gpus}; expected a positive integer")
    if nvlink_GBps is None:
        group = host
    group = host if group is None else group
    first_rank = sum(1 for _, kind in G.nodes(data="kind") if kind == "gpu")
    _add_node(G, host, "host", name=host)
    switch = nvswitch_id(group)
    if nvlink_GBps is not None and switch not in G:
        _add_node(G, switch, "nvswitch", group=group)
    gpus = []
    for local in range(num_gpus):
        gpu = gpu_id(host, local)
        _add_node(
            G,
            gpu,
            "gpu",
            rank=first_rank + local,
            host=host,
            group=group,
            local_rank=local,
            memory_bytes=int(memory_bytes),
            model=model,
        )
        if nvlink_GBps is not None:
            add_link(G, gpu, switch, "nvlink", nvlink_GBps, nvlink_latency_us)
        if nics:
            nic = nic_id(host, local)
            _add_node(G, nic, "nic", host=host)
            add_link(G, gpu, nic, "pcie", pcie_GBps, pcie_latency_us)
        gpus.append(gpu)
    return gpus


@dataclass(frozen=True)
class HostSpec:
    """One host for :func:`build_cluster`. Bandwidths per direction in GB/s (1e9 B/s), latencies in us."""

    name: str
    num_gpus: int = 8
    group: str | None = None  # NVLink domain id; None: the host itself
    nvlink_GBps: float | None = 450.0  # per GPU; None: PCIe-only box
    nvlink_latency_us: float = 3.0
    pcie_GBps: float = 64.0  # GPU <-> NIC
    pcie_latency_us: float = 1.0
    nic_GBps: float | None = 50.0  # NIC <-> leaf, per NIC (one per GPU); None: no network
    nic_latency_us: float = 2.0
    memory_bytes: int = 80 * 2**30  # per GPU
    model: str = "H100"


def build_cluster(
    name: str,
    hosts: Sequence[HostSpec],
    *,
    hosts_per_leaf: int = 4,
    oversubscription: float = 1.0,
    uplink_latency_us: float = 1.0,
) -> nx.Graph:
    """A cluster of ``hosts`` on a two-level leaf/spine fabric.

    Hosts fill leaf switches in order, ``hosts_per_leaf`` each; every NIC links to its host's leaf at
    ``nic_GBps``. With two or more leaves, each leaf links to one spine node (standing for the whole spine
    layer) with bandwidth = sum of the NIC bandwidth under the leaf / ``oversubscription`` (1.0 =
    non-blocking). A single leaf gets no spine. Ranks follow the order of ``hosts``.
    """
    if not hosts:
        raise TopologyError(f"cluster {name!r}: field 'hosts' is empty; give at least one HostSpec")
    if hosts_per_leaf <= 0:
        raise TopologyError(f"cluster {name!r}: field 'hosts_per_leaf' = {hosts_per_leaf}; expected > 0")
    if not (isinstance(oversubscription, numbers.Real) and oversubscription > 0):
        raise TopologyError(f"cluster {name!r}: field 'oversubscription' = {oversubscription}; expected > 0")
    G = new_topology(name)
    for spec in hosts:
        add_node_group(
            G,
            spec.name,
            spec.num_gpus,
            group=spec.group,
            nvlink_GBps=spec.nvlink_GBps,
            nvlink_latency_us=spec.nvlink_latency_us,
            pcie_GBps=spec.pcie_GBps,
            pcie_latency_us=spec.pcie_latency_us,
            nics=spec.nic_GBps is not None,
            memory_bytes=spec.memory_bytes,
            model=spec.model,
        )
    networked = [spec for spec in hosts if spec.nic_GBps is not None]
    leaves = [networked[i : i + hosts_per_leaf] for i in range(0, len(networked), hosts_per_leaf)]
    uplinks = []
    for index, members in enumerate(leaves):
        leaf = add_switch(G, f"leaf{index}", "leaf")
        for spec in members:
            for local in range(spec.num_gpus):
                add_link(G, nic_id(spec.name, local), leaf, "network", spec.nic_GBps, spec.nic_latency_us)
        uplinks.append(sum(spec.nic_GBps * spec.num_gpus for spec in members) / oversubscription)
    if len(leaves) >= 2:
        spine = add_switch(G, "spine0", "spine")
        for index, bandwidth in enumerate(uplinks):
            add_link(G, f"leaf{index}", spine, "network", bandwidth, uplink_latency_us)
    return G


# --- validation -------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_bandwidth(where: str, value: Any) -> None:
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise TopologyError(f"{where}: field 'bandwidth_GBps' = {value!r}; expected a finite number > 0")


def _check_latency(where: str, value: Any) -> None:
    if not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise TopologyError(f"{where}: field 'latency_us' = {value!r}; expected a finite number >= 0 (us)")


def _check_field(where: str, attrs: dict, field: str, expected: type) -> None:
    if field not in attrs:
        raise TopologyError(f"{where}: missing field {field!r}")
    value = attrs[field]
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if not ok:
        raise TopologyError(f"{where}: field {field!r} = {value!r}; expected {expected.__name__}")


def validate(G: nx.Graph, source: str | None = None, *, connected: bool = True) -> nx.Graph:
    """Check ``G`` against the schema; returns ``G`` or raises :class:`TopologyError` (one line).

    ``source`` (e.g. a file name) prefixes the message. ``connected=False`` skips the check that every
    GPU reaches every other, for a part of a cluster (one host before its NICs join the fabric).
    """
    prefix = f"{source}: " if source else ""

    def fail(message: str) -> None:
        raise TopologyError(prefix + message)

    if G.is_directed() or G.is_multigraph():
        fail(
            f"field 'directed'/'multigraph' = {G.is_directed()}/{G.is_multigraph()}; expected an undirected "
            "simple graph"
        )
    schema = G.graph.get("schema")
    if schema != SCHEMA:
        fail(f"field 'schema' = {schema!r}; expected {SCHEMA!r}")
    try:
        graph_latency(G)  # the optional collective latencies (topology.latency)
    except TopologyError as err:
        fail(str(err).removeprefix("topology: "))
    try:
        for node, attrs in G.nodes(data=True):
            where = f"node {node!r}"
            if "kind" not in attrs:
                fail(f"{where}: missing field 'kind'")
            kind = attrs["kind"]
            if not isinstance(kind, str) or kind not in NODE_FIELDS:
                fail(f"{where}: field 'kind' = {kind!r}; expected one of {', '.join(NODE_KINDS)}")
            for field, expected in NODE_FIELDS[kind].items():
                _check_field(where, attrs, field, expected)
            if kind == "switch" and attrs["level"] not in SWITCH_LEVELS:
                fail(f"{where}: field 'level' = {attrs['level']!r}; expected 'leaf' or 'spine'")
            if kind == "gpu" and attrs["memory_bytes"] <= 0:
                fail(f"{where}: field 'memory_bytes' = {attrs['memory_bytes']}; expected > 0")
            cores = attrs.get("cores", 1) if kind == "host" else 1
            if isinstance(cores, bool) or not isinstance(cores, int) or cores <= 0:
                fail(f"{where}: field 'cores' = {cores!r}; expected an integer > 0")
        for u, v, attrs in G.edges(data=True):
            where = f"edge {u!r}-{v!r}"
            if "kind" not in attrs:
                fail(f"{where}: missing field 'kind'")
            kind = attrs["kind"]
            if kind not in EDGE_KINDS:
                fail(f"{where}: field 'kind' = {kind!r}; expected one of {', '.join(EDGE_KINDS)}")
            for field in ("bandwidth_GBps", "latency_us"):
                if field not in attrs:
                    fail(f"{where}: missing field {field!r}")
            _check_bandwidth(where, attrs["bandwidth_GBps"])
            _check_latency(where, attrs["latency_us"])
    except TopologyError as err:
        if prefix and not str(err).startswith(prefix):
            raise TopologyError(prefix + str(err)) from None
        raise
    owner: dict[int, Any] = {}
    for node, attrs in gpu_nodes(G):
        rank = attrs["rank"]
        if rank in owner:
            fail(f"field 'rank' = {rank} is used by gpus {owner[rank]!r} and {node!r}; ranks must be unique")
        owner[rank] = node
    if not owner:
        fail("field 'nodes' has no node of kind 'gpu'; a topology needs at least one GPU")
    n = len(owner)
    if set(owner) != set(range(n)):
        bad = sorted(set(owner) - set(range(n)))
        missing = sorted(set(range(n)) - set(owner))
        fail(f"field 'rank': ranks must be contiguous 0..{n - 1}; found {bad[:3]}, missing {missing[:3]}")
    loop = next(iter(nx.selfloop_edges(G)), None)
    if loop is not None:
        fail(f"edge {loop[0]!r}-{loop[1]!r}: a self-loop; a link joins two different nodes")
    apart = _unreachable_pair(G) if connected else None
    if apart is not None:
        (a, a_attrs), (b, b_attrs) = apart
        if a_attrs["host"] == b_attrs["host"]:
            fail(f"host {a_attrs['host']!r}: gpus {a!r} and {b!r} are not joined by any path of links")
        fail(
            f"hosts {a_attrs['host']!r} and {b_attrs['host']!r}: no network path between them (gpu {a!r} "
            f"cannot reach gpu {b!r} over any link); link their NICs to a common fabric"
        )
    return G


def _unreachable_pair(G: nx.Graph) -> tuple[tuple[Any, dict], tuple[Any, dict]] | None:
    """The lowest-ranked GPU and the first GPU (by rank) it cannot reach over links, or None when every GPU
    reaches every other. Host nodes carry no links (metadata), so no path goes through one."""
    links = G.subgraph(node for node, kind in G.nodes(data="kind") if kind != "host")
    gpus = gpu_nodes(G)
    reached = nx.node_connected_component(links, gpus[0][0])
    return next(((gpus[0], gpu) for gpu in gpus[1:] if gpu[0] not in reached), None)


def gpu_nodes(G: nx.Graph) -> list[tuple[Any, dict]]:
    """``(node, attrs)`` of every GPU, in rank order when ranks are valid (else node order)."""
    gpus = [(node, attrs) for node, attrs in G.nodes(data=True) if attrs.get("kind") == "gpu"]
    if all(isinstance(attrs.get("rank"), int) for _, attrs in gpus):
        gpus.sort(key=lambda item: item[1]["rank"])
    return gpus


def edges_of_kind(
    G: nx.Graph, node: Any, kind: str, neighbor_kinds: Iterable[str] | None = None
) -> list[tuple[Any, Any, dict]]:
    """``(node, neighbor, attrs)`` of the ``kind`` edges at ``node``, optionally only to given node kinds."""
    wanted = None if neighbor_kinds is None else set(neighbor_kinds)
    return [
        (node, nbr, attrs)
        for nbr, attrs in G.adj[node].items()
        if attrs.get("kind") == kind and (wanted is None or G.nodes[nbr].get("kind") in wanted)
    ]
