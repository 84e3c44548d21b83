"""Bytes of the exchange protocol (:mod:`~flexshard.runtime.exchange_protocol`) per link class, counted
from the realised counts with :mod:`solvers.wire`'s formulas (what :mod:`solvers.cost_model` prices):

* ids (``INDEX_BYTES`` each): every entry of every id column sent to another rank (warm and flat slots,
  group-fetch ids to the rail peer, group-fetch slots to owners in other groups), and the split sizes
  in ``meta`` (:func:`solvers.wire.split_bytes`: one int64 per table per column a peer is reached by;
  the error words are not counted);
* embeddings forward and gradients backward (``vector_bytes`` each): warm and flat lookups between
  requester and owner, group-fetch ids between requester and rail peer (``scatter`` / ``grads``), and
  each distinct row once per group between the owner and the rail peer (``rows`` / ``rail_grads``).

A rank's own blocks are local copies and never counted. The fp16 gradient exponent (one element per peer
block) is not counted. Ids and forward bytes are added at ``rows``, backward bytes at ``rail_grads``.
"""

from __future__ import annotations

import numpy as np

from core.ranks import RankLayout
from core.traffic import Traffic
from core.vocabulary import FLOAT32_BYTES, INDEX_BYTES, Component, LinkClass, WireDtype
from solvers import wire

ROW_COLUMNS = [0, 1, 2]  # WARM, FLAT, GIDS: the id columns whose entries get a vector back


class ProtocolBytes:
    """One rank's byte counter for the exchange protocol. ``active[p, k]``: id column k reaches rank p."""

    def __init__(
        self, layout: RankLayout, me: int, dims: np.ndarray, wire_dtype: WireDtype, active: np.ndarray
    ) -> None:
        world = layout.num_ranks
        self.link_of_peer = layout.link_class(me, np.arange(world))
        self.others = np.arange(world) != me
        self.vector_bytes = np.asarray(wire.vector_bytes(dims, FLOAT32_BYTES, wire_dtype), dtype=np.float64)
        self.active, self.num_tables = active, int(np.size(dims))
        self._backward = Traffic.zeros()

    def forward(self, sent: np.ndarray, asked, traffic: Traffic) -> None:
        """Add one batch's ids and forward bytes to ``traffic`` (``sent``: int64[world, tables, kinds]
        entries sent; ``asked``: the :class:`~flexshard.runtime.exchange_protocol.Asked` of the batch)
        and keep its backward bytes."""
        self._backward = Traffic.zeros()
        recv = asked.recv_counts
        for link in LinkClass:
            peers = self.others & (self.link_of_peer == link)
            split = wire.split_bytes(float(self.active[peers].sum()), self.num_tables)
            ids_send = float(sent[peers].sum()) * INDEX_BYTES + split
            ids_recv = float(recv[peers].sum()) * INDEX_BYTES + split
            traffic.add(link, Component.IDS, ids_send, ids_recv)
            asked_rows = sent[peers][:, :, ROW_COLUMNS].sum(axis=(0, 2)) + asked.fetch_counts[peers].sum(
                axis=0
            )
            served_rows = recv[peers][:, :, ROW_COLUMNS].sum(axis=(0, 2)) + asked.owner_counts[peers].sum(
                axis=0
            )
            asked_b = float(asked_rows @ self.vector_bytes)
            served_b = float(served_rows @ self.vector_bytes)
            traffic.add(link, Component.FORWARD, served_b, asked_b)
            self._backward.add(link, Component.BACKWARD, asked_b, served_b)

    def backward(self, traffic: Traffic) -> None:
        """Add the kept backward bytes of the batch to ``traffic``."""
        traffic += self._backward
        self._backward = Traffic.zeros()
