"""What each exchange puts on the wire, in bytes: the one source of FlexShard's traffic formulas.

The functions take counts (lookups, peers, rows, payload bytes) and return bytes. They are plain
arithmetic, so they work on floats, numpy arrays and PuLP affine expressions alike: the cost model
(:mod:`solvers.cost_model`) applies them to expected counts, the optimizer's coefficients
(:mod:`solvers.coefficients`) to one unit, the placement program (:mod:`solvers.placement`) to its
share variables, and the runtime (:mod:`flexshard.runtime`) to the counts of each real batch.

Formulas (docs/cost_model.md, sections 2-4):

* a remote lookup moves one id requester -> owner (``INDEX_BYTES``), one embedding owner -> requester
  and one gradient requester -> owner (``vector_bytes`` each); in a group fetch the same three travel
  requester -> rail peer (NVLink), the embedding and gradient once per group between rail peer and
  owner (the fabric), and the id, as a slot, from every requester straight to an owner in another group;
* the split sizes of every exchange travel in one message: one int64 per table to each peer a column
  reaches (warm and group-fetch ids: the group; flat cold: every rank; group-fetch slots: the other
  groups);
* a ring all-reduce of ``S`` bytes over ``k`` ranks sends (and receives) ``2 (k - 1) / k * S`` per rank;
  the hierarchical all-reduce of the hot rows is a reduce-scatter in the group, a ring all-reduce of each
  ``1/g`` slice across the ``G`` groups and an all-gather in the group;
* a replica sync carries, per replica, the touched rows' vectors (``sparse``, after a one-byte touched
  mask per hot row and per warm row of the whole tier, all-reduced over every rank), or every
  replicated row (``dense``).
"""

from __future__ import annotations

from typing import Any

from core.vocabulary import (
    INDEX_BYTES,
    MASK_BYTES_PER_ROW,
    Component,
    Direction,
    LinkClass,
    SyncMode,
    WireDtype,
)


def vector_bytes(dim: Any, element_bytes: int, wire: WireDtype = WireDtype.FP32) -> Any:
    """Bytes of one embedding (= one gradient) of ``dim`` elements stored in ``element_bytes`` each, sent as
    ``wire``: a vector never travels wider than it is stored. ``dim`` may be an int or an array of dims."""
    return dim * min(int(element_bytes), wire.element_bytes)


SPLIT_BYTES_PER_TABLE = INDEX_BYTES  # one int64 length per (table, peer) before each tier's exchange

LOOKUP_COMPONENTS = (Component.IDS, Component.FORWARD, Component.BACKWARD)


def lookup_messages(asked: Any, served: Any, vector_bytes: Any) -> dict[tuple[Component, Direction], Any]:
    """Bytes of remote lookups on one link, by (component, direction).

    ``asked``: lookups this rank sends to owners over the link; ``served``: lookups it answers as an
    owner; ``vector_bytes``: bytes of one embedding (= one gradient) on the wire.
    """
    return {
        (Component.IDS, Direction.SEND): asked * INDEX_BYTES,
        (Component.IDS, Direction.RECV): served * INDEX_BYTES,
        (Component.FORWARD, Direction.SEND): served * vector_bytes,
        (Component.FORWARD, Direction.RECV): asked * vector_bytes,
        (Component.BACKWARD, Direction.SEND): asked * vector_bytes,
        (Component.BACKWARD, Direction.RECV): served * vector_bytes,
    }


def lookups_by_link(
    share: Any, group_share: Any, group_size: Any, num_ranks: int, volume: Any, within_group: bool
) -> tuple[dict[LinkClass, Any], dict[LinkClass, Any]]:
    """Expected (asked, served) lookups per link class of one rank in one tier's exchange.

    Rows (and so accesses) of the tier are dealt to owners: this rank owns ``share`` of them, its group
    ``group_share`` (this rank included), summing to 1 over the owners' scope (the group when
    ``within_group``, as for warm rows; else the cluster). Every rank looks up ``volume`` of the tier's
    rows per iteration. A requester asks its own share locally, the rest of its group's share over
    NVLink, the other groups' share over the fabric; an owner serves ``volume * share`` to each peer.
    """
    asked = {
        LinkClass.INTRA_GROUP: volume * (group_share - share),
        LinkClass.INTER_GROUP: 0.0 if within_group else volume * (1 - group_share),
    }
    served = {
        LinkClass.INTRA_GROUP: volume * share * (group_size - 1),
        LinkClass.INTER_GROUP: 0.0 if within_group else volume * share * (num_ranks - group_size),
    }
    return asked, served


def group_lookups_by_link(
    share: Any,
    position_share: Any,
    group_size: Any,
    num_groups: int,
    volume: Any,
    group_volume: Any,
) -> tuple[dict[LinkClass, Any], dict[LinkClass, Any]]:
    """Expected (asked, served) vectors per link class of one rank in a group fetch
    (:attr:`core.vocabulary.FetchMode.GROUP`); its ids are :func:`group_ids_by_link`.

    Every rank looks up ``volume`` of the tier's rows per iteration and sends each id to the GPU of its
    own group at the owner's position (its rail peer), over NVLink. That GPU deduplicates the group's ids
    and each row owned at its position in another group crosses the fabric once per group, from the
    owner. ``share``: this rank's share of the tier's rows; ``position_share``: the share owned at this
    rank's position over all groups (this rank included); ``group_volume``: the distinct rows of the
    tier a whole group looks up per iteration.

    * NVLink: asked ``volume * (1 - position_share)`` (ids owned at other positions), served
      ``(group_size - 1) * volume * position_share`` (the peers' ids owned at this position);
    * fabric: asked ``group_volume * (position_share - share)`` (as the rail peer, the group's distinct
      ids owned at this position in other groups), served ``(num_groups - 1) * group_volume * share``
      (as the owner, one row per other group).
    """
    asked = {
        LinkClass.INTRA_GROUP: volume * (1 - position_share),
        LinkClass.INTER_GROUP: group_volume * (position_share - share),
    }
    served = {
        LinkClass.INTRA_GROUP: volume * position_share * (group_size - 1),
        LinkClass.INTER_GROUP: group_volume * share * (num_groups - 1),
    }
    return asked, served


def group_ids_by_link(
    share: Any, position_share: Any, group_share: Any, group_size: Any, num_ranks: int, volume: Any
) -> tuple[dict[LinkClass, Any], dict[LinkClass, Any]]:
    """Expected (asked, served) ids per link class of one rank in a group fetch: each of its ``volume``
    lookups goes as an id to the rail peer (NVLink, as :func:`group_lookups_by_link`'s vectors) and, when
    the owner is in another group, as a slot straight to the owner (the fabric): asked
    ``volume * (1 - group_share)``, served ``(num_ranks - group_size) * volume * share`` (every rank of
    the other groups). ``group_share``: the share owned in this rank's group."""
    asked = {
        LinkClass.INTRA_GROUP: volume * (1 - position_share),
        LinkClass.INTER_GROUP: volume * (1 - group_share),
    }
    served = {
        LinkClass.INTRA_GROUP: volume * position_share * (group_size - 1),
        LinkClass.INTER_GROUP: volume * share * (num_ranks - group_size),
    }
    return asked, served


def group_fetch_messages(
    share: Any,
    position_share: Any,
    group_share: Any,
    group_size: Any,
    num_ranks: int,
    num_groups: int,
    volume: Any,
    group_volume: Any,
    vector_bytes: Any,
) -> dict[LinkClass, dict[tuple[Component, Direction], Any]]:
    """Bytes of a group fetch per link class, by (component, direction): ids of
    :func:`group_ids_by_link`, embeddings and gradients of :func:`group_lookups_by_link`."""
    asked, served = group_lookups_by_link(share, position_share, group_size, num_groups, volume, group_volume)
    ids_asked, ids_served = group_ids_by_link(
        share, position_share, group_share, group_size, num_ranks, volume
    )
    out = {}
    for link in LinkClass:
        messages = lookup_messages(asked[link], served[link], vector_bytes)
        messages[(Component.IDS, Direction.SEND)] = ids_asked[link] * INDEX_BYTES
        messages[(Component.IDS, Direction.RECV)] = ids_served[link] * INDEX_BYTES
        out[link] = messages
    return out


def split_bytes(peers: Any, num_tables: int) -> Any:
    """Bytes each way of the split sizes sent to ``peers`` ranks before one tier's exchange."""
    return peers * num_tables * SPLIT_BYTES_PER_TABLE


def ring_allreduce_bytes(participants: Any, payload_bytes: Any) -> Any:
    """Bytes each participant sends (= receives) in a bandwidth-optimal all-reduce of ``payload_bytes``
    over ``participants`` ranks: ``2 (k - 1) / k * S`` (0 for one rank)."""
    return 2.0 * (participants - 1.0) / participants * payload_bytes


def hierarchical_allreduce_bytes(
    group_size: Any, num_groups: int, payload_bytes: Any
) -> dict[LinkClass, Any]:
    """Bytes each rank sends (= receives) per link class in a hierarchical all-reduce of
    ``payload_bytes``: intra ``2 (g-1)/g * S``, inter ``2 (G-1)/G * S / g``."""
    return {
        LinkClass.INTRA_GROUP: ring_allreduce_bytes(group_size, payload_bytes),
        LinkClass.INTER_GROUP: ring_allreduce_bytes(num_groups, payload_bytes) / group_size,
    }


def sync_payload(touched_rows: Any, rows: Any, vector_bytes: Any, sync: SyncMode | str) -> Any:
    """Gradient bytes one replica contributes to the sync of ``rows`` replicated rows of which
    ``touched_rows`` were touched somewhere this iteration (the touched mask: :func:`sync_mask_bytes`)."""
    if SyncMode(sync) is SyncMode.DENSE:
        return rows * vector_bytes
    return touched_rows * vector_bytes


def sync_mask_bytes(rows: Any, sync: SyncMode | str) -> Any:
    """Bytes of the sparse sync's touched mask over ``rows`` rows (the hot rows and the whole warm tier of
    every table, one all-reduce over every rank, priced as :func:`hierarchical_allreduce_bytes`); none for
    a dense sync."""
    if SyncMode(sync) is SyncMode.DENSE:
        return 0 * rows
    return rows * MASK_BYTES_PER_ROW
