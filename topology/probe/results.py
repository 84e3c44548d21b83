"""What the probe's measurements say: per-rank links, slow parts, the measured graph and a text report.

:func:`measured_graph` writes the fits of :func:`topology.probe.timing.measure` onto a topology graph
(``measured=True``, ``measured_by="collective"``, the nominal figure kept as ``nominal_GBps``; not
``source``, which node-link JSON uses for the edge's end): either onto the NVML graph of the job
(:func:`restrict_to_job`) or onto a graph built from the measurements alone (one switch per group standing
for its intra-group link, one NIC per rank for the path out of the group). Bandwidths are GB/s per
direction (1 GB = 1e9 B), latencies microseconds one way. No ``torch`` here.
"""

# ruff: noqa: N802, N815  (unit suffixes such as _GBps keep their case: B = bytes)

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from topology.graph import add_link, gpu_id, new_topology, nic_id, nvswitch_id, validate
from topology.latency import LATENCY_KEY, SOURCE_KEY
from topology.probe.measurements import Measurements, RankInfo
from topology.views import ranks_per_core, sharing_text

MEASURED_BY = "collective"
LINK_CLASSES = ("p2p/intra", "p2p/inter")

# --- per-rank numbers, slow parts -------------------------------------------------------------------


@dataclass(frozen=True)
class RankLinks:
    """A rank's links as measured: the best pair bandwidth of each class (a pair runs at the slower end's
    speed, so the best pair bounds the rank's own link from below) and the lowest latency; None when the
    rank has no pair of that class."""

    intra_GBps: float | None
    intra_latency_us: float | None
    inter_GBps: float | None
    inter_latency_us: float | None


def rank_links(m: Measurements) -> list[RankLinks]:
    """:class:`RankLinks` of every rank, in rank order."""
    out = []
    for r in range(len(m.ranks)):
        best: dict[str, tuple[float, float]] = {}
        for (a, b), fit in m.pairs.items():
            if r in (a, b):
                cls = "intra" if m.same_group(a, b) else "inter"
                bw, lat = best.get(cls, (0.0, math.inf))
                best[cls] = (max(bw, fit.bandwidth_GBps), min(lat, fit.latency_us))
        intra, inter = best.get("intra"), best.get("inter")
        out.append(RankLinks(intra and intra[0], intra and intra[1], inter and inter[0], inter and inter[1]))
    return out


def _below_median(what: str, of: str, cls: str, values: dict[str, float], factor: float) -> list[dict]:
    """The entries of ``values`` (name -> GB/s) below ``factor`` x their median (needs two values)."""
    if len(values) < 2:
        return []
    median = float(np.median(list(values.values())))
    return [
        {
            "what": what,
            "name": key,
            "class": cls,
            "bandwidth_GBps": bw,
            "median_GBps": median,
            "ratio": bw / median,
            "of": of,
        }
        for key, bw in values.items()
        if median > 0 and bw < factor * median
    ]


def slow_parts(m: Measurements, factor: float | None = None) -> list[dict]:
    """Hosts, ranks and pairs measured below ``factor`` x the median of their class, slowest first."""
    factor = m.config.slow_factor if factor is None else factor
    found: list[dict] = []
    for cls in LINK_CLASSES:
        values = {f"{a}-{b}": f.bandwidth_GBps for (a, b), f in m.pairs.items() if m.link_class(a, b) == cls}
        found += _below_median("pair", "ranks", cls, values, factor)
    links = rank_links(m)
    for cls in ("intra", "inter"):
        per_rank = {str(r): getattr(lk, f"{cls}_GBps") for r, lk in enumerate(links)}
        per_rank = {k: v for k, v in per_rank.items() if v is not None}
        found += _below_median("rank", "rank", f"p2p/{cls}", per_rank, factor)
        per_host: dict[str, list[float]] = {}
        for r, bw in per_rank.items():
            per_host.setdefault(m.ranks[int(r)].host, []).append(bw)
        medians = {h: float(np.median(v)) for h, v in per_host.items()}
        found += _below_median("host", "host", f"p2p/{cls}", medians, factor)
    found.sort(key=lambda d: (d["ratio"], d["what"], d["name"]))
    return found


# --- graphs -----------------------------------------------------------------------------------------


def restrict_to_job(G: nx.Graph, infos: Sequence[RankInfo]) -> nx.Graph | None:
    """The NVML graph ``G`` (from :func:`topology.probe.merge_hosts`) cut to the GPUs of the job and
    renumbered so that GPU ``rank`` = torch rank. GPUs are matched by PCI bus id, else by local rank.
    Returns None when a rank has no GPU in ``G`` (the caller then builds the graph from measurements)."""
    G = G.copy()
    by_bus = {
        (attrs["host"], attrs.get("bus_id")): node
        for node, attrs in G.nodes(data=True)
        if attrs.get("kind") == "gpu" and attrs.get("bus_id")
    }
    chosen: dict[Any, int] = {}
    for info in infos:
        node = by_bus.get((info.host, info.bus_id)) if info.bus_id else None
        if node is None:
            node = gpu_id(info.host, info.local_rank)
        if node not in G or G.nodes[node].get("kind") != "gpu" or node in chosen:
            return None
        chosen[node] = info.rank
    for node, attrs in list(G.nodes(data=True)):
        if attrs.get("kind") == "gpu" and node not in chosen:
            nic = nic_id(attrs["host"], attrs["local_rank"])
            G.remove_node(node)
            if nic in G:
                G.remove_node(nic)
    for node, rank in chosen.items():
        G.nodes[node]["rank"] = rank
    return validate(G)


def _set(G: nx.Graph, u: Any, v: Any, bandwidth_GBps: float, latency_us: float) -> None:
    """Put measured numbers on edge u-v, keeping the nominal bandwidth as ``nominal_GBps``."""
    attrs = G.edges[u, v]
    attrs.pop("source", None)  # the NVML half's provenance; node-link JSON would drop it anyway
    if not attrs.get("measured"):
        attrs["nominal_GBps"] = attrs["bandwidth_GBps"]
    attrs.update(
        bandwidth_GBps=float(bandwidth_GBps),
        latency_us=float(max(latency_us, 0.0)),
        measured=True,
        measured_by=MEASURED_BY,
    )


def _metadata(m: Measurements) -> dict:
    """``G.graph["probe"]``: settings, groups, every fit and the slow parts."""
    return {
        "seconds": round(m.seconds, 3),
        "sizes": list(m.config.sizes),
        "repeats": m.config.repeats,
        "groups": [list(g) for g in m.groups],
        "group_names": list(m.group_names),
        "pairs": {f"{a}-{b}": f.to_dict() for (a, b), f in sorted(m.pairs.items())},
        "collectives": {
            name: {**f.to_dict(), "bus_GBps": f.bandwidth_GBps * m.bus_factor[name]}
            for name, f in m.collectives.items()
        },
        "slow": slow_parts(m),
    }


def _median_known(values: Sequence[float | None], default: float) -> float:
    """Median of the positive ``values``; ``default`` when there is none."""
    known = [v for v in values if v is not None and v > 0]
    return float(np.median(known)) if known else default


def _measure_onto(G: nx.Graph, m: Measurements, links: Sequence[RankLinks]) -> None:
    """Measured numbers onto the job's NVML graph: GPU-NVSwitch edges get the rank's intra-group figures,
    direct GPU-GPU edges their pair's, each NIC's network edge the rank's inter-group figures."""
    node_of = {attrs["rank"]: node for node, attrs in G.nodes(data=True) if attrs.get("kind") == "gpu"}
    for r, lk in enumerate(links):
        node = node_of[r]
        for _, nbr, attrs in list(G.edges(node, data=True)):
            kind_nbr = G.nodes[nbr].get("kind")
            if attrs["kind"] == "nvlink" and kind_nbr == "nvswitch" and lk.intra_GBps:
                _set(G, node, nbr, lk.intra_GBps, lk.intra_latency_us or 0.0)
            elif kind_nbr == "gpu":
                pair = (min(r, G.nodes[nbr]["rank"]), max(r, G.nodes[nbr]["rank"]))
                if pair in m.pairs:
                    _set(G, node, nbr, m.pairs[pair].bandwidth_GBps, m.pairs[pair].latency_us)
            elif kind_nbr == "nic" and lk.inter_GBps:
                for _, up, up_attrs in G.edges(nbr, data=True):
                    if up_attrs["kind"] == "network":
                        lat = (lk.inter_latency_us or 0.0) / 2 - attrs["latency_us"]
                        _set(G, nbr, up, lk.inter_GBps, lat)


def _graph_of(m: Measurements, links: Sequence[RankLinks], name: str) -> nx.Graph:
    """A graph from the measurements alone: a switch per group, a NIC per rank on one leaf (several
    groups). A rank missing a class borrows the median of the others (``measured=False``)."""
    intra_bw = _median_known(
        [lk.intra_GBps for lk in links], _median_known([lk.inter_GBps for lk in links], 1.0)
    )
    inter_bw = _median_known([lk.inter_GBps for lk in links], intra_bw)
    intra_lat = _median_known([lk.intra_latency_us for lk in links], 1.0)
    inter_lat = _median_known([lk.inter_latency_us for lk in links], intra_lat)
    multi = len(m.groups) > 1
    G = new_topology(name)
    for info in m.ranks:
        if info.host not in G:
            G.add_node(info.host, kind="host", name=info.host)
    for group in m.group_names:
        G.add_node(nvswitch_id(group), kind="nvswitch", group=group)
    if multi:
        G.add_node("leaf0", kind="switch", level="leaf")
    for info, lk in zip(m.ranks, links, strict=True):
        node = gpu_id(info.host, info.local_rank)
        group = m.group_names[m.group_index(info.rank)]
        G.add_node(
            node,
            kind="gpu",
            rank=info.rank,
            host=info.host,
            group=group,
            local_rank=info.local_rank,
            memory_bytes=int(info.memory_bytes),
            model=info.model,
            device=info.device,
        )
        lat = lk.intra_latency_us if lk.intra_latency_us is not None else intra_lat
        add_link(G, node, nvswitch_id(group), "nvlink", lk.intra_GBps or intra_bw, lat)
        G.edges[node, nvswitch_id(group)].update(measured=lk.intra_GBps is not None, measured_by=MEASURED_BY)
        if multi:
            nic = nic_id(info.host, info.local_rank)
            G.add_node(nic, kind="nic", host=info.host)
            bw = lk.inter_GBps or inter_bw
            lat = lk.inter_latency_us if lk.inter_latency_us is not None else inter_lat
            add_link(G, node, nic, "pcie", bw, 0.0)
            add_link(G, nic, "leaf0", "network", bw, lat / 2)
            for u, v in ((node, nic), (nic, "leaf0")):
                G.edges[u, v].update(measured=lk.inter_GBps is not None, measured_by=MEASURED_BY)
    return G


def _mark_slow(G: nx.Graph) -> None:
    """A ``slow`` list on each host and GPU node ``G.graph["probe"]["slow"]`` names (pairs are edges, which
    :func:`topology.views.slow_links` finds)."""
    gpu_of = {a["rank"]: n for n, a in G.nodes(data=True) if a.get("kind") == "gpu"}
    for part in G.graph["probe"]["slow"]:
        if part["what"] == "host":
            target = part["name"]
        elif part["what"] == "rank":
            target = gpu_of.get(int(part["name"]))
        else:
            continue
        if target in G:
            entry = {k: part[k] for k in ("class", "bandwidth_GBps", "median_GBps", "ratio")}
            G.nodes[target].setdefault("slow", []).append(entry)


def measured_graph(m: Measurements, base: nx.Graph | None = None, name: str = "probe") -> nx.Graph:
    """A topology carrying the measured numbers (validated).

    With ``base`` (the job's NVML graph, ranks = torch ranks): each GPU's NVLink edge to its switch gets
    the rank's intra-group bandwidth and latency, a direct GPU-GPU edge (NVLink bridge or PCIe) its pair's
    numbers, and each NIC's network edge the rank's inter-group numbers. Without ``base``: one node per
    rank (``host``, ``group`` from the measurements), an NVSwitch-style node per group linked at the
    measured intra-group numbers, and one NIC per rank on a single leaf at the measured inter-group
    numbers (GPU->NIC at the same bandwidth and 0 latency, NIC->leaf at half the one-way latency, so the
    cluster view reads back the measured figures). Numbers a class lacks (a group of one) take the median
    of the others, marked ``measured=False``. ``G.graph["probe"]`` keeps every fit and the slow parts; a
    slow host or GPU node also gets ``slow``: a list of ``{class, bandwidth_GBps, median_GBps, ratio}``.
    """
    links = rank_links(m)
    if base is not None:
        G = base.copy()
        G.graph["name"] = name
        _measure_onto(G, m, links)
    else:
        G = _graph_of(m, links, name)
    G.graph["probe"] = _metadata(m)
    for host, cores in host_cores(m).items():
        if G.nodes.get(host, {}).get("kind") == "host":
            G.nodes[host]["cores"] = cores
    latency = collective_latency(m)
    if latency:
        G.graph[LATENCY_KEY] = latency
        G.graph[SOURCE_KEY] = f"flexshard probe ({m.ranks[0].device.split(':')[0]}, {len(m.ranks)} ranks)"
    _mark_slow(G)
    return validate(G)


def host_cores(m: Measurements) -> dict[str, int]:
    """Each host's CPU cores its ranks may run on: the union of their affinity masks
    (:attr:`RankInfo.cpus`; ranks pinned to cores of their own add up, ranks sharing a mask do not), for
    the hosts whose ranks said."""
    cpus: dict[str, set[int]] = {}
    for info in m.ranks:
        if info.cpus:
            cpus.setdefault(info.host, set()).update(info.cpus)
    return {host: len(ids) for host, ids in cpus.items()}


# probe collective name -> (kind, scope) of topology.latency
_LATENCY_OF = {
    "all_to_all/group": ("all_to_all", "group"),
    "all_to_all/world": ("all_to_all", "world"),
    "all_to_all/rail": ("all_to_all", "rail"),
    "all_reduce/replicas": ("all_reduce", "rail"),
    "all_reduce/world": ("all_reduce", "world"),
}


def collective_latency(m: Measurements) -> dict[str, dict[str, dict[str, float]]]:
    """The measured collective latencies as ``G.graph["collective_latency_us"]`` (:mod:`topology.latency`):
    each collective's fitted latency (the intercept of time over bytes; its median time at the smallest
    size where the intercept is not positive), at its participants (the largest of its groups)."""
    sizes = {
        "group": max(len(g) for g in m.groups),
        "world": len(m.ranks),
        "rail": len(m.groups),
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, fit in m.collectives.items():
        if name not in _LATENCY_OF:
            continue
        kind, scope = _LATENCY_OF[name]
        seconds = fit.latency_s if fit.latency_s > 0 else min(fit.median_s)
        if sizes[scope] >= 2 and seconds > 0:
            out.setdefault(kind, {}).setdefault(scope, {})[str(sizes[scope])] = seconds * 1e6
    return out


# --- text -------------------------------------------------------------------------------------------


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n > 1 else ''}"


def _table_rows(m: Measurements) -> list[str]:
    """One row per point-to-point class (pairs, GB/s min / median / max, median latency) and per
    collective (bus GB/s, latency)."""
    rows = []
    for cls in LINK_CLASSES:
        fits = [f for (a, b), f in m.pairs.items() if m.link_class(a, b) == cls]
        if fits:
            bws = [f.bandwidth_GBps for f in fits]
            lat = float(np.median([f.latency_us for f in fits]))
            rows.append(
                f"{cls:<27}{len(fits):>5}{min(bws):>10.2f}{np.median(bws):>10.2f}{max(bws):>10.2f}{lat:>10.1f}"
            )
    for name, f in m.collectives.items():
        bus = f.bandwidth_GBps * m.bus_factor[name]
        rows.append(f"{name + ' (bus)':<27}{'':>5}{'':>10}{bus:>10.2f}{'':>10}{f.latency_us:>10.1f}")
    return rows


def _slow_line(slow: list[dict], factor: float) -> str:
    """The one count of slow parts, by kind: ``slow: 5 below 0.5 x the median of their class (2 pairs,
    2 ranks, 1 host)``, or ``slow: none ...``."""
    head = f"slow: {len(slow) if slow else 'none'} below {factor:g} x the median of their class"
    kinds = [(what, sum(s["what"] == what for s in slow)) for what in ("pair", "rank", "host")]
    return head + (" (" + ", ".join(_plural(n, what) for what, n in kinds if n) + ")" if slow else "")


def report(m: Measurements, max_slow: int = 10) -> str:
    """Groups, a bandwidth table per link class, and the slow parts (at most ``max_slow`` listed)."""
    hosts = sorted({i.host for i in m.ranks})
    sizes = sorted({len(g) for g in m.groups})
    named = "; ".join(f"{m.group_names[k]}: {', '.join(map(str, g))}" for k, g in enumerate(m.groups[:8]))
    slow = slow_parts(m)
    cores = host_cores(m)
    sharing = sharing_text(ranks_per_core([i.host for i in m.ranks], cores), len(cores))
    on_cores = f" ({sharing})" if sharing else ""
    lines = [
        f"probe: {len(m.ranks)} ranks on {_plural(len(hosts), 'host')}{on_cores}, "
        f"{_plural(len(m.groups), 'group')} of {'/'.join(map(str, sizes))}, {len(m.pairs)} pairs, "
        f"{m.seconds:.1f} s",
        f"groups: {named}{' ...' if len(m.groups) > 8 else ''}",
        f"{'link class':<27}{'n':>5}{'GB/s min':>10}{'median':>10}{'max':>10}{'lat us':>10}",
        *_table_rows(m),
        _slow_line(slow, m.config.slow_factor),
    ]
    lines += [
        f"  {s['what']} {s['name']} ({s['class']}): {s['bandwidth_GBps']:.2f} GB/s, "
        f"{s['ratio']:.2f} x median {s['median_GBps']:.2f}"
        for s in slow[:max_slow]
    ]
    if len(slow) > max_slow:
        lines.append(f"  ... and {len(slow) - max_slow} more")
    return "\n".join(lines)
