"""The collectives of one training step, in the order a rank issues them: the one description of a step
that the runtime executes, the time model prices and the reports count.

A plan's step is a short list of :class:`Stage` s. Every stage is one collective on one process group
(:class:`Scope`): the whole world, this rank's NVLink group, or its rail group (the ranks at the same
position of every group). The lookup exchange carries every table and every tier in the same collectives,
so the number of stages depends on which exchanges a plan uses, never on how many tables it has:

forward
    ``ids`` (world all-to-all): warm and flat cold slots to their owners, group-fetch ids to the rail
    peer and their slots to the owner, each peer's block headed by the sender's input check code and
    the split sizes of every later lookup stage (with nothing remote, the headers alone); ``rows``
    (all-to-all): warm and flat rows back to the requesters and, for the group fetch, each distinct row
    once per group to that group's rail peer; ``scatter`` (group all-to-all, group fetch only): the rail
    peer hands the rows to its group.
backward
    ``grads`` (all-to-all): warm and flat gradients to the owners, group-fetch gradients to the rail
    peer; ``rail_grads`` (rail all-to-all, group fetch only): the rail peer's per-row sums to the owners.

``rows`` and ``grads`` run on the smallest process group every block they carry stays in
(:func:`lookup_scopes`): a plan whose cold rows are all group-fetched and which has no warm rows sends
``rows`` on the rail only (owner to rail peer), and one with no flat-fetched cold rows sends ``grads``
inside the group only (warm owners and rail peers are in the requester's group). Fewer ranks meet in the
collective: on gloo every peer of an all-to-all is a message pair even when its block is empty, and every
rank of the group waits for the slowest.
sync (replicated rows, :class:`core.vocabulary.SyncMode`)
    ``sync_mask`` (world all-reduce, sparse sync only): which hot and warm rows some rank touched;
    ``sync_group_reduce`` (group all-to-all): a reduce-scatter of the hot gradients inside the group;
    ``sync_rail`` (rail all-reduce): the hot slices and the warm shards summed across groups, one
    bucket; in half precision a reduce-scatter and an all-gather (``sync_rail_reduce``,
    ``sync_rail_gather``, two all-to-alls); ``sync_group_gather`` (group all-to-all): the summed hot
    slices back to every GPU of the group.

A stage on a process group of one rank is a local copy and is left out. Groups of unequal size have no
rail groups: the hot sync is then one world all-reduce (``sync_world``; in half precision a
reduce-scatter and an all-gather, ``sync_world_reduce`` and ``sync_world_gather``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from core.vocabulary import FetchMode, LinkClass, SyncMode, WireDtype
from solvers.types import Plan
from topology.views import ClusterView


class CollectiveKind(str, Enum):
    """Which collective a stage is."""

    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"


class Scope(str, Enum):
    """The process group a stage runs on."""

    WORLD = "world"  # every rank
    GROUP = "group"  # this rank's NVLink group
    RAIL = "rail"  # the ranks at this rank's position in every group


class Phase(str, Enum):
    """Where in the step a stage runs."""

    FORWARD = "forward"
    BACKWARD = "backward"
    SYNC = "sync"


@dataclass(frozen=True)
class Stage:
    """One collective of a step. ``name`` is one of the names in the module docstring."""

    name: str
    phase: Phase
    kind: CollectiveKind
    scope: Scope

    def participants(self, view: ClusterView) -> int:
        """Ranks taking part (the largest such group in ``view``)."""
        if self.scope is Scope.WORLD:
            return view.num_ranks
        if self.scope is Scope.GROUP:
            return int(view.group_sizes.max())
        return view.num_groups

    def link_classes(self, view: ClusterView) -> tuple[LinkClass, ...]:
        """The link classes its bytes can cross: a group stage stays on NVLink, a rail stage crosses the
        fabric only, a world stage crosses both (one group: NVLink only)."""
        if self.scope is Scope.GROUP:
            return (LinkClass.INTRA_GROUP,)
        if self.scope is Scope.RAIL:
            return (LinkClass.INTER_GROUP,)
        return view.link_classes


@dataclass(frozen=True)
class StepShape:
    """What of a plan decides its stages."""

    remote: bool  # some lookup leaves its rank (warm rows, or cold rows on a cluster of several ranks)
    group_fetch: bool  # some table's cold rows are fetched once per group
    flat_fetch: bool  # some table's cold rows are fetched from their owner by every rank (row-wise)
    warm: bool  # some table has warm rows
    hot_sync: bool  # hot rows exist and there are several ranks
    warm_sync: bool  # warm rows exist and there are several groups
    sync: SyncMode
    wire: WireDtype


def step_shape(plan: Plan, view: ClusterView) -> StepShape:
    """The :class:`StepShape` of ``plan`` on ``view``."""
    several = view.num_ranks > 1
    warm = any(tp.warm_rows > 0 for tp in plan.tables)
    cold = any(tp.cold_rows > 0 for tp in plan.tables)
    return StepShape(
        remote=several and (warm or cold),
        group_fetch=several and plan.cold_fetch(FetchMode.GROUP),
        flat_fetch=several and plan.cold_fetch(FetchMode.FLAT),
        warm=several and warm,
        hot_sync=several and any(tp.hot_rows > 0 for tp in plan.tables),
        warm_sync=warm and view.num_groups > 1,
        sync=plan.sync,
        wire=plan.wire,
    )


def step_schedule(plan: Plan, view: ClusterView) -> tuple[Stage, ...]:
    """The collectives of one step of ``plan`` on ``view``, in the order every rank issues them."""
    return shape_schedule(step_shape(plan, view), view)


def shape_schedule(shape: StepShape, view: ClusterView) -> tuple[Stage, ...]:
    """:func:`step_schedule` from a :class:`StepShape` (what the optimizer enumerates)."""
    if view.num_ranks == 1:
        return ()
    g, big_g = int(view.group_sizes.max()), view.num_groups
    a2a, ar = CollectiveKind.ALL_TO_ALL, CollectiveKind.ALL_REDUCE
    fwd, bwd, sync = Phase.FORWARD, Phase.BACKWARD, Phase.SYNC
    stages = [Stage("ids", fwd, a2a, Scope.WORLD)]  # the input check travels even with nothing remote
    if shape.remote:
        rows, grads = shape_scopes(shape, view)
        stages.append(Stage("rows", fwd, a2a, rows))
        if shape.group_fetch and g > 1:
            stages.append(Stage("scatter", fwd, a2a, Scope.GROUP))
        stages.append(Stage("grads", bwd, a2a, grads))
        if shape.group_fetch and big_g > 1:
            stages.append(Stage("rail_grads", bwd, a2a, Scope.RAIL))
    if not (shape.hot_sync or shape.warm_sync):
        return tuple(stages)
    if shape.sync is SyncMode.SPARSE:
        stages.append(Stage("sync_mask", sync, ar, Scope.WORLD))
    equal_groups = view.uniform_group_size is not None
    if shape.hot_sync and not equal_groups:
        if shape.wire is WireDtype.FP32:
            stages.append(Stage("sync_world", sync, ar, Scope.WORLD))
        else:  # half precision: sums in float32 at the slice's rank, as on the rail
            stages += [
                Stage("sync_world_reduce", sync, a2a, Scope.WORLD),
                Stage("sync_world_gather", sync, a2a, Scope.WORLD),
            ]
        return tuple(stages)
    hierarchical_hot = shape.hot_sync and g > 1
    if hierarchical_hot:
        stages.append(Stage("sync_group_reduce", sync, a2a, Scope.GROUP))
    if big_g > 1:
        if shape.wire is WireDtype.FP32:
            stages.append(Stage("sync_rail", sync, ar, Scope.RAIL))
        else:
            stages += [
                Stage("sync_rail_reduce", sync, a2a, Scope.RAIL),
                Stage("sync_rail_gather", sync, a2a, Scope.RAIL),
            ]
    if hierarchical_hot:
        stages.append(Stage("sync_group_gather", sync, a2a, Scope.GROUP))
    return tuple(stages)


def shape_scopes(shape: StepShape, view: ClusterView) -> tuple[Scope, Scope]:
    """:func:`lookup_scopes` of ``rows`` and ``grads`` for a :class:`StepShape` on ``view``."""
    g, equal = int(view.group_sizes.max()), view.uniform_group_size is not None
    return lookup_scopes(shape.warm, shape.flat_fetch, shape.group_fetch, view.num_groups, g, equal)


def lookup_scopes(
    warm: bool, flat_fetch: bool, group_fetch: bool, num_groups: int, group_size: int, equal_groups: bool
) -> tuple[Scope, Scope]:
    """The process groups of ``rows`` and ``grads`` for a plan with warm rows, flat-fetched and
    group-fetched cold rows (or not) on ``num_groups`` groups of at most ``group_size`` ranks: the
    smallest group every block of the stage stays in. ``rows``: warm rows come from the requester's
    group, flat rows from anywhere, a group fetch's distinct rows from the owner to its rail peer (the
    rail, which exists with ``equal_groups`` only); ``grads``: warm gradients and the group fetch's go
    inside the group, flat ones anywhere. The world wherever a smaller group would not hold every
    block, or would be the world itself (one group), or a rank alone (groups of one rank)."""
    several_groups = num_groups > 1
    rows = Scope.WORLD
    if several_groups and not flat_fetch:
        if group_fetch and not warm and equal_groups:
            rows = Scope.RAIL
        elif warm and not group_fetch and group_size > 1:
            rows = Scope.GROUP
    grads = Scope.GROUP if several_groups and not flat_fetch and group_size > 1 else Scope.WORLD
    return rows, grads


def rows_in_wire_order(plan: Plan, view: ClusterView) -> bool:
    """Whether the runtime keeps a requester's rows of every table in one buffer in the exchange's wire
    order (``flexshard.runtime.relay.WireRows``): dedup on, every table's rows cold, and either every
    table group fetched with ``grads`` inside the group (``scatter``'s order) or every table fetched flat
    on more than one rank (``rows``' order: its lookups sorted by owner). Its requested rows and gradients
    are then never copied into or out of a buffer (where every table has one dim and the wire is float32:
    :class:`solvers.time_types.BufferCopies`)."""
    all_cold = all(tp.hot_rows + tp.warm_rows == 0 for tp in plan.tables)
    if not (plan.dedup and plan.tables and all_cold and view.num_ranks > 1):
        return False
    if all(tp.fetch is FetchMode.FLAT for tp in plan.tables):
        return True
    if not all(tp.fetch is FetchMode.GROUP for tp in plan.tables):
        return False
    shape = step_shape(plan, view)
    return shape.group_fetch and shape_scopes(shape, view)[1] is Scope.GROUP


def torchrec_schedule(view: ClusterView) -> tuple[Stage, ...]:
    """The collectives of one step of TorchRec's own sequence sharding (its ``EmbeddingCollection``
    sharded row-wise, TorchRec 1.8; the plan it executes is priced as the row-wise plan without dedup).
    Its input distribution (``KJTAllToAll``) sends the split sizes, then the jagged ids' lengths, then
    their values, one world all-to-all each (``splits``, ``lengths``, ``ids``); its
    ``SequenceEmbeddingsAllToAll`` sends the rows back (``rows``) and, in the backward, their gradients
    (``grads``). Five world all-to-alls however many tables (weighted features would add one for the
    weights; none here). The bytes of ``splits`` and ``lengths`` (a few words per peer and per sample and
    feature) are left out of the byte counts."""
    if view.num_ranks == 1:
        return ()
    fwd, a2a, world = Phase.FORWARD, CollectiveKind.ALL_TO_ALL, Scope.WORLD
    names = ("splits", "lengths", "ids", "rows")
    return (*(Stage(n, fwd, a2a, world) for n in names), Stage("grads", Phase.BACKWARD, a2a, world))


def collectives_per_step(plan: Plan, view: ClusterView) -> int:
    """How many collectives one rank issues per step of ``plan`` on ``view``."""
    return len(step_schedule(plan, view))
