"""Derived views of a topology graph: ranks, groups and per-rank link speeds as arrays.

The planner never walks the graph itself; it reads a :class:`ClusterView`.
"""

# ruff: noqa: N815  (unit suffixes such as _Bps keep their case: B = bytes)

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from core.errors import TopologyError
from core.ranks import RankLayout
from core.vocabulary import LinkClass
from topology.graph import edges_of_kind, gpu_nodes, validate
from topology.latency import LatencyPoints, graph_latency

__all__ = ["ClusterView", "TopologyError", "cluster_view", "groups", "slow_links", "summary", "uniform_view"]


@dataclass(frozen=True)
class ClusterView:
    """The cluster as the cost model sees it: one entry per rank (GPU), ranks 0..N-1.

    ``layout`` holds the groups (NVLink domains, by default one host each). Bandwidths are per
    direction, in bytes per second (``_Bps``); latencies in seconds.

    A cluster of one group has no inter-group link class: nothing leaves the group, so its
    ``inter_bw_Bps`` and ``inter_latency_s`` are 0 for every rank, whatever the graph's NICs say (set so
    on construction), and :attr:`link_classes` is the intra-group class alone.
    """

    layout: RankLayout
    host_of_rank: tuple[str, ...]
    intra_bw_Bps: np.ndarray  # float64[N], to peers in the same group (NVLink)
    inter_bw_Bps: np.ndarray  # float64[N], fair share of the path out of the group (NIC, fabric)
    intra_latency_s: np.ndarray  # float64[N]
    inter_latency_s: np.ndarray  # float64[N]
    memory_bytes: np.ndarray  # int64[N], device memory
    collective_latency_us: LatencyPoints | None = None  # measured/published figures (topology.latency)
    collective_latency_source: str = ""
    ranks_per_core: float = 1.0  # the most ranks per CPU core on any host (hosts' ``cores``); 1: not known

    def __post_init__(self) -> None:
        if self.layout.num_groups == 1:  # no inter-group link class (see the class docstring)
            object.__setattr__(self, "inter_bw_Bps", np.zeros(self.layout.num_ranks))
            object.__setattr__(self, "inter_latency_s", np.zeros(self.layout.num_ranks))

    @property
    def has_inter_group(self) -> bool:
        """Whether the cluster has an inter-group link class (two or more groups)."""
        return self.layout.num_groups > 1

    @property
    def link_classes(self) -> tuple[LinkClass, ...]:
        """The link classes traffic can use: intra-group, and inter-group when there are several groups."""
        return tuple(LinkClass) if self.has_inter_group else (LinkClass.INTRA_GROUP,)

    @property
    def group_of_rank(self) -> np.ndarray:
        """int64[N]: group index 0..G-1 of each rank."""
        return self.layout.group_of_rank

    @property
    def local_index(self) -> np.ndarray:
        """int64[N]: index of each rank inside its group."""
        return self.layout.position_of_rank

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of each group, ascending."""
        return self.layout.groups

    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def group_sizes(self) -> np.ndarray:
        return self.layout.group_sizes

    @property
    def uniform_group_size(self) -> int | None:
        """The common group size, or None when groups differ in size."""
        return self.layout.uniform_group_size

    def group_size_of_rank(self) -> np.ndarray:
        """int64[N]: size of each rank's group."""
        return self.layout.group_size_of_rank()

    def group_share(self, share: np.ndarray) -> np.ndarray:
        """float64[..., N]: for each rank, the sum of ``share[..., r]`` over the ranks of its group (its
        group's share of a tier's accesses). Exactly 1 on a cluster of one group when ``share`` sums to
        1: nothing leaves the group, whatever the rounding of the sum."""
        if not self.has_inter_group:
            return np.ones_like(np.asarray(share, dtype=np.float64))
        onehot = np.eye(self.num_groups)[self.group_of_rank]  # [N, G]
        return (np.asarray(share, dtype=np.float64) @ onehot)[..., self.group_of_rank]


def uniform_view(
    num_groups: int,
    group_size: int,
    intra_bw_Bps: float,
    inter_bw_Bps: float,
    intra_latency_s: float = 0.0,
    inter_latency_s: float = 0.0,
    memory_bytes: int = 80 * 2**30,
) -> ClusterView:
    """A homogeneous cluster view without building a graph (for tests and quick models); with one group the
    inter-group figures are 0 (:class:`ClusterView`)."""
    if num_groups <= 0 or group_size <= 0:
        raise TopologyError(
            f"uniform_view: num_groups and group_size must be positive, got {num_groups}, {group_size}"
        )
    n = num_groups * group_size
    return ClusterView(
        layout=RankLayout.consecutive(n, num_groups),
        host_of_rank=tuple(f"node{r // group_size}" for r in range(n)),
        intra_bw_Bps=np.full(n, float(intra_bw_Bps)),
        inter_bw_Bps=np.full(n, float(inter_bw_Bps)),
        intra_latency_s=np.full(n, float(intra_latency_s)),
        inter_latency_s=np.full(n, float(inter_latency_s)),
        memory_bytes=np.full(n, int(memory_bytes), dtype=np.int64),
    )


# --- views of a topology graph ----------------------------------------------------------------------

_LEVEL_ORDER = {"leaf": 0, "spine": 1}


def _rank_groups(G: nx.Graph) -> tuple[list[tuple[Any, dict]], list[str]]:
    """Validated GPUs in rank order and each rank's group key (its host when it has no NVLink edge)."""
    validate(G)
    gpus = gpu_nodes(G)
    keys = [attrs["group"] if edges_of_kind(G, node, "nvlink") else attrs["host"] for node, attrs in gpus]
    return gpus, keys


def _group_lists(keys: list[str]) -> list[list[int]]:
    """Ranks per group key; groups ordered by their lowest rank (``keys`` is in rank order)."""
    members: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        members.setdefault(key, []).append(rank)
    return list(members.values())


def groups(G: nx.Graph) -> list[list[int]]:
    """Ranks of each NVLink group, ascending; groups ordered by their lowest rank."""
    return _group_lists(_rank_groups(G)[1])


def _network_hops(G: nx.Graph, gpu: Any) -> list[list[tuple[Any, Any]]]:
    """Edges of each hop of ``gpu``'s path to the top of the fabric: GPU -pcie-> NIC -network-> leaf
    -network-> spine. A hop with several parallel edges (several NICs, several spines) lists them all."""
    hops = []
    frontier = {gpu}
    up = [("pcie", ("nic",)), ("network", ("switch",))]
    for kind, to in up:
        hop = [(u, v) for node in frontier for u, v, _ in edges_of_kind(G, node, kind, to)]
        if not hop:
            return hops
        hops.append(hop)
        frontier = {v for _, v in hop}
    while True:  # climb switch levels: leaf -> spine
        hop = []
        for node in frontier:
            level = _LEVEL_ORDER[G.nodes[node]["level"]]
            hop += [
                (u, v)
                for u, v, _ in edges_of_kind(G, node, "network", ("switch",))
                if _LEVEL_ORDER[G.nodes[v]["level"]] > level
            ]
        if not hop:
            return hops
        hops.append(hop)
        frontier = {v for _, v in hop}


def cluster_view(G: nx.Graph) -> ClusterView:
    """The :class:`ClusterView` of a topology graph (validated first).

    * Groups: the GPU ``group`` attribute (a GPU without NVLink edges, e.g. in a PCIe-only box, is grouped
      by its ``host``); group order = order of their lowest rank; ``local_index`` = position by rank in the
      group.
    * ``intra_bw_Bps``: sum of the GPU's NVLink edge bandwidths (without NVLink: its fastest PCIe edge);
      ``intra_latency_s``: the largest latency among those edges.
    * ``inter_bw_Bps``: fair-share bottleneck on the path GPU -> NIC -> leaf -> spine: every edge's
      bandwidth is split evenly among the GPUs whose path uses it, a hop's share is the sum over its parallel
      edges, and the GPU gets the minimum over hops.
    * ``collective_latency_us``: the graph's collective latencies (:mod:`topology.latency`), if any.
    * ``inter_latency_s``: twice the one-way latency up that path (sum over hops of the hop's largest edge
      latency): up to the top of the fabric and back down to a GPU of the same shape.
    * ``ranks_per_core``: the most GPUs (ranks) per CPU core over the hosts whose node has ``cores`` (1
      where none has).

    A single group has no inter-group link class: ``inter_bw_Bps = 0`` and ``inter_latency_s = 0`` for every
    rank, with or without NICs (no traffic leaves the group). With several groups a GPU with no path to the
    network is a :class:`TopologyError`.
    """
    gpus, keys = _rank_groups(G)
    latency, latency_source = graph_latency(G)
    group_lists = _group_lists(keys)
    n = len(gpus)

    intra_bw = np.empty(n)
    intra_lat = np.empty(n)
    for rank, (node, _) in enumerate(gpus):
        links = edges_of_kind(G, node, "nvlink")
        if links:
            intra_bw[rank] = sum(attrs["bandwidth_GBps"] for *_, attrs in links) * 1e9
            intra_lat[rank] = max(attrs["latency_us"] for *_, attrs in links) * 1e-6
        else:
            pcie = edges_of_kind(G, node, "pcie")
            if not pcie:
                raise TopologyError(f"gpu {node!r}: no 'nvlink' or 'pcie' edge; cannot size its group link")
            fastest = max((attrs for *_, attrs in pcie), key=lambda a: a["bandwidth_GBps"])
            intra_bw[rank] = fastest["bandwidth_GBps"] * 1e9
            intra_lat[rank] = fastest["latency_us"] * 1e-6

    paths = [_network_hops(G, node) for node, _ in gpus]
    users: dict[frozenset, int] = {}
    for hops in paths:
        for edge in {frozenset(e) for hop in hops for e in hop}:
            users[edge] = users.get(edge, 0) + 1
    inter_bw = np.zeros(n)
    inter_lat = np.zeros(n)
    for rank, hops in enumerate(paths):
        if len(hops) < 2:  # no network hop: its PCIe edge to a NIC alone is no way out of the group
            if len(group_lists) > 1:
                dead_end = f"; NIC {hops[0][0][1]!r} has no network link" if hops else ""
                raise TopologyError(
                    f"gpu {gpus[rank][0]!r}: no network path (pcie -> nic -> switch) to reach other groups"
                    + dead_end
                )
            continue
        shares = [sum(G.edges[e]["bandwidth_GBps"] / users[frozenset(e)] for e in hop) for hop in hops]
        inter_bw[rank] = min(shares) * 1e9
        inter_lat[rank] = 2 * sum(max(G.edges[u, v]["latency_us"] for u, v in hop) for hop in hops) * 1e-6

    return ClusterView(
        layout=RankLayout.of(group_lists, n),
        host_of_rank=tuple(attrs["host"] for _, attrs in gpus),
        intra_bw_Bps=intra_bw,
        inter_bw_Bps=inter_bw,
        intra_latency_s=intra_lat,
        inter_latency_s=inter_lat,
        memory_bytes=np.array([attrs["memory_bytes"] for _, attrs in gpus], dtype=np.int64),
        collective_latency_us=latency,
        collective_latency_source=latency_source,
        ranks_per_core=_ranks_per_core(G, [attrs["host"] for _, attrs in gpus]),
    )


def _ranks_per_core(G: nx.Graph, host_of_rank: list[str]) -> float:
    """The most ranks per CPU core over the hosts whose node says its ``cores``; 1.0 where none does."""
    cores = {h: a["cores"] for h, a in G.nodes(data=True) if a.get("kind") == "host" and a.get("cores")}
    return ranks_per_core(host_of_rank, cores)


def ranks_per_core(host_of_rank: list[str], cores: dict[str, int]) -> float:
    """The most ranks per CPU core over the hosts in ``cores`` (host -> its cores; ``host_of_rank``: every
    rank's host); 1.0 where ``cores`` is empty."""
    ranks_on = Counter(host_of_rank)
    return max((ranks_on[host] / n for host, n in cores.items()), default=1.0)


def sharing_text(per_core: float, hosts: int) -> str:
    """``'2 ranks a CPU core'`` (``per_core`` ranks a core; ``'up to ...'`` over several ``hosts``) where
    ranks outnumber cores; else ''."""
    if per_core <= 1:
        return ""
    return f"{'up to ' if hosts > 1 else ''}{per_core:g} ranks a CPU core"


def _edge_class(G: nx.Graph, u: Any, v: Any) -> tuple[str, tuple[str, ...]]:
    """An edge's kind and end roles (node kind, or switch level), e.g. ``("network", ("leaf", "nic"))``."""
    attrs = (G.nodes[u], G.nodes[v])
    roles = tuple(sorted(a["level"] if a["kind"] == "switch" else a["kind"] for a in attrs))
    return G.edges[u, v]["kind"], roles


def slow_links(G: nx.Graph, factor: float = 0.5) -> list[dict]:
    """Edges slower than ``factor`` x the median bandwidth of their class, slowest first.

    A class is the edge ``kind`` refined by its end roles (NIC->leaf and leaf->spine network links are
    compared separately). Each entry: ``u``, ``v``, ``kind``, ``bandwidth_GBps``, ``median_GBps``, ``ratio``
    (bandwidth / median), ``latency_us``.
    """
    validate(G)
    classes: dict[tuple, list[tuple[Any, Any, dict]]] = {}
    for u, v, attrs in G.edges(data=True):
        classes.setdefault(_edge_class(G, u, v), []).append((u, v, attrs))
    found = []
    for edges in classes.values():
        median = float(np.median([attrs["bandwidth_GBps"] for *_, attrs in edges]))
        for u, v, attrs in edges:
            bw = attrs["bandwidth_GBps"]
            if bw < factor * median:
                found.append(
                    {
                        "u": u,
                        "v": v,
                        "kind": attrs["kind"],
                        "bandwidth_GBps": bw,
                        "median_GBps": median,
                        "ratio": bw / median,
                        "latency_us": attrs["latency_us"],
                    }
                )
    found.sort(key=lambda d: (d["ratio"], str(d["u"]), str(d["v"])))
    return found


def summary(G: nx.Graph, max_slow: int = 10, slow: bool = True) -> str:
    """A short human-readable table: GPUs, hosts, groups, per-rank speeds (min/median/max), and (with
    ``slow``) the slow links; the probe leaves them out, its report lists the slow parts measured."""
    view = cluster_view(G)
    sizes = sorted({len(g) for g in view.groups})
    size_text = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]}"
    sharing = sharing_text(view.ranks_per_core, len(set(view.host_of_rank)))
    sharing = f", {sharing}" if sharing else ""
    lines = [
        f"topology {G.graph.get('name', '?')!r}: {view.num_ranks} GPUs, {len(set(view.host_of_rank))} hosts, "
        f"{view.num_groups} groups of {size_text}{sharing}",
        f"{'per rank':<18}{'min':>10}{'median':>10}{'max':>10}",
    ]
    for label, values in (
        ("intra GB/s", view.intra_bw_Bps / 1e9),
        ("inter GB/s", view.inter_bw_Bps / 1e9),
        ("intra latency us", view.intra_latency_s * 1e6),
        ("inter latency us", view.inter_latency_s * 1e6),
        ("memory GiB", view.memory_bytes / 2**30),
    ):
        if label.startswith("inter") and not view.has_inter_group:
            lines.append(f"{label:<18}{'-':>10}{'-':>10}{'-':>10}  (one group: no inter-group links)")
            continue
        lines.append(f"{label:<18}{values.min():>10.2f}{np.median(values):>10.2f}{values.max():>10.2f}")
    if not slow:
        return "\n".join(lines)
    found = slow_links(G)
    lines.append(f"slow links: {len(found) if found else 'none'}")
    for link in found[:max_slow]:
        lines.append(
            f"  {link['u']} - {link['v']} ({link['kind']}): {link['bandwidth_GBps']:g} GB/s, "
            f"{link['ratio']:.2f} x median {link['median_GBps']:g}"
        )
    if len(found) > max_slow:
        lines.append(f"  ... and {len(found) - max_slow} more")
    return "\n".join(lines)
