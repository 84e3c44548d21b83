"""Topology files: node-link JSON (``networkx.node_link_data``) with validation on read and write."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import networkx as nx

from core.errors import TopologyError
from core.osutil import atomic_open
from topology.graph import validate
from topology.presets import from_preset, is_preset_name, preset_help

# networkx >= 3.4 names the edge list key with ``edges=``; older releases with ``link=``.
_EDGES_KW = "edges" if "edges" in inspect.signature(nx.node_link_data).parameters else "link"


def write_json(G: nx.Graph, path: str | os.PathLike) -> None:
    """Validate ``G`` and write it as node-link JSON, atomically (:func:`atomic_open`)."""
    validate(G)
    data = nx.node_link_data(G, **{_EDGES_KW: "edges"})
    with atomic_open(path) as f:
        json.dump(data, f, indent=1, allow_nan=False)
        f.write("\n")


def _check_structure(data: Any, where: str) -> str:
    """Check the node-link skeleton before networkx sees it; returns the edge list key."""
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: top level is a {type(data).__name__}; expected a node-link object")
    if not isinstance(data.get("graph", {}), dict):
        raise TopologyError(f"{where}: field 'graph' = {data['graph']!r}; expected an object")
    edges_key = "edges" if "edges" in data or "links" not in data else "links"
    for key in ("nodes", edges_key):
        if not isinstance(data.get(key), list):
            raise TopologyError(f"{where}: field {key!r} = {data.get(key)!r}; expected a list")
    ids: dict[Any, int] = {}
    for i, node in enumerate(data["nodes"]):
        if not isinstance(node, dict) or "id" not in node:
            raise TopologyError(f"{where}: nodes[{i}]: missing field 'id'")
        if not isinstance(node["id"], (str, int)) or isinstance(node["id"], bool):
            raise TopologyError(f"{where}: nodes[{i}]: field 'id' = {node['id']!r}; expected str or int")
        if node["id"] in ids:  # networkx would merge the two silently
            raise TopologyError(
                f"{where}: nodes[{i}]: node {node['id']!r} repeats nodes[{ids[node['id']]}]; "
                "list each node once"
            )
        ids[node["id"]] = i
    seen: dict[frozenset, int] = {}
    for i, edge in enumerate(data[edges_key]):
        for end in ("source", "target"):
            if not isinstance(edge, dict) or end not in edge:
                raise TopologyError(f"{where}: {edges_key}[{i}]: missing field {end!r}")
            if not isinstance(edge[end], (str, int)) or isinstance(edge[end], bool) or edge[end] not in ids:
                raise TopologyError(f"{where}: {edges_key}[{i}]: field {end!r} = {edge[end]!r}; no such node")
        u, v = edge["source"], edge["target"]
        if u == v:
            raise TopologyError(
                f"{where}: {edges_key}[{i}]: edge {u!r}-{v!r} is a self-loop; a link joins two "
                "different nodes"
            )
        pair = frozenset((u, v))
        if pair in seen:  # either direction: the graph is undirected, and networkx would merge the two
            raise TopologyError(
                f"{where}: {edges_key}[{i}]: edge {u!r}-{v!r} repeats {edges_key}[{seen[pair]}]; a pair of "
                "nodes has one link (sum parallel lanes into its bandwidth)"
            )
        seen[pair] = i
    for flag in ("directed", "multigraph"):
        if data.get(flag, False) is not False:
            raise TopologyError(f"{where}: field {flag!r} = {data[flag]!r}; expected false")
    return edges_key


def read_json(path: str | os.PathLike) -> nx.Graph:
    """Read and validate a node-link JSON topology; any problem raises :class:`TopologyError` (one line)."""
    where = f"topology file {str(path)!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise TopologyError(f"{where}: cannot read ({reason})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise TopologyError(
            f"{where}: malformed JSON at line {err.lineno}, column {err.colno}: {err.msg}"
        ) from None
    edges_key = _check_structure(data, where)
    G = nx.node_link_graph(data, directed=False, multigraph=False, **{_EDGES_KW: edges_key})
    return validate(G, source=where)


def load_topology(spec: str | os.PathLike | nx.Graph) -> nx.Graph:
    """A topology from a JSON file path or a preset spec (``"h100:8"``); an existing path wins.

    A graph is validated and returned as is.
    """
    if isinstance(spec, nx.Graph):
        return validate(spec)
    if Path(spec).exists():
        return read_json(spec)
    if is_preset_name(str(spec)):
        return from_preset(str(spec))
    raise TopologyError(
        f"topology {str(spec)!r}: neither an existing file nor a preset; valid presets: {preset_help()}"
    )
