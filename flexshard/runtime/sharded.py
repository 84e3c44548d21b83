"""A torch module that executes a FlexShard plan on torch.distributed.

Every rank holds all hot rows of every table, its share of its group's warm rows and its share of the
cluster's cold rows (plus their optimizer state, placed like the rows; :mod:`~flexshard.runtime.shards`).
A forward pass checks its input (:mod:`~flexshard.runtime.features`), reads hot rows locally
(:mod:`~flexshard.runtime.lookups`), exchanges the remote lookups with their owners and puts the rows back
in input order. Warm lookups, and the cold lookups of tables fetched flat, go straight to their owners
(:mod:`~flexshard.runtime.exchange`); the cold lookups of tables fetched per group go through the rail
peers, once per group (:mod:`~flexshard.runtime.group_exchange`). Backward (through a
``torch.autograd.Function``) sends the output gradients back along the same routes and sums them per row
at the owner. :meth:`ShardedSequenceEmbedding.step` then synchronises replicas
(:mod:`~flexshard.runtime.replicas`: hot gradients by a hierarchical all-reduce, warm shard gradients over
the replica group) and applies row-wise SGD or row-wise Adagrad to the rows that received gradient.

Gradient semantics: the gradient a row receives is the sum over all ranks of the gradient of that rank's
loss (as if the global loss were the sum of the per-rank losses; divide the loss by the world size
yourself for a mean). Every copy of a replicated row gets the same summed gradient and the same update,
so copies stay bitwise equal.

The plan file is a contract (:mod:`flexshard.contract`): a plan made for another world size, other
groups, other tables (names, rows, dim) or other data (another hotness order) is refused on every rank
with one :class:`~core.errors.PlanMismatchError`. Dedup and sync follow the plan; run other settings
with :meth:`flexshard.plan_file.PlanFile.with_overrides`.

Traffic (bytes per rank per iteration) is a :class:`core.traffic.Traffic` record: lookups counted from
the realised split sizes, sync bytes from the realised payload, both with :mod:`solvers.wire`'s formulas
(vectors as ``dim`` elements of the plan's wire dtype, :func:`solvers.wire.vector_bytes`).

Wire precision: embeddings and gradients cross every all-to-all and the replica sync as the plan's
``settings.wire`` (:class:`~core.vocabulary.WireDtype`; ``wire_dtype``, when given, must agree with it).
Rows, optimizer state and every gradient sum stay float32: a vector is rounded when it is sent and
widened when it arrives (:mod:`~flexshard.runtime.transfer`, :mod:`~flexshard.runtime.replicas`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from core.errors import ConfigError, PlanMismatchError, agreed
from core.traffic import Traffic
from core.vocabulary import Component, FetchMode, LinkClass, Tier, WireDtype
from flexshard.contract import tables_mismatch, world_mismatch
from flexshard.plan_file import PlanFile
from flexshard.runtime.agreement import agreed_message
from flexshard.runtime.exchange import FlatBatch, FlatExchange, FlatState
from flexshard.runtime.features import check_features, features_from_kjt, raise_input_error, to_padded
from flexshard.runtime.group_exchange import GroupBatch, GroupExchange, GroupState
from flexshard.runtime.groups import ProcessGroups, make_process_groups
from flexshard.runtime.initializer import Initializer, seeded_initializer
from flexshard.runtime.lookups import TableLookup, local_lookups
from flexshard.runtime.replicas import hierarchical_all_reduce, ring_all_reduce, sync_gradients
from flexshard.runtime.routing import (
    LAYOUTS,
    CompactTableRouting,
    TableRouting,
    build_compact_routing,
    build_routing,
)
from flexshard.runtime.shards import OPTIMIZERS, Shard
from flexshard.runtime.transfer import gradient_scale
from solvers import wire


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, module, batch):  # noqa: ARG004
        outs, state = module._forward_impl(*batch)
        ctx.module, ctx.state = module, state
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.module._backward_impl(*ctx.state, grads)
        ctx.state = None
        return None, None, None


class ShardedSequenceEmbedding(torch.nn.Module):
    """Sequence embedding tables sharded by a plan (see the module docstring).

    ``tables``: ``(name, num_rows, dim)`` in the plan's table order. ``orders``: per table the hotness
    order the plan was made from (touched ids hottest first, completed by
    :func:`~flexshard.runtime.routing.complete_order`); a table without one is numbered hottest first.
    ``init``: a row initializer ``(name, ids int64[n], dim) -> float32[n, dim]`` that gives the same row
    for the same id on every rank, or a seed for :func:`seeded_initializer`. Each rank initialises only
    the rows it holds. ``layout``: ``"exact"`` (per-row routing arrays, cold rows dealt in hotness order
    as the cost model prices them) or ``"compact"`` (only replicated rows listed, cold rows dealt by id;
    for tables too large for 9 bytes per row on every rank), see :mod:`flexshard.runtime.routing`.
    ``wire_dtype``: ``"fp32"``, ``"bf16"`` or ``"fp16"``; None follows the plan, another value than the
    plan's is refused (the plan priced its bytes at its own). ``timeout_s``: how long a collective on the
    module's subgroups waits for a peer before it fails (None: torch's default; pass the job's).
    """

    def __init__(
        self,
        plan_file: PlanFile,
        tables: list[tuple[str, int, int]],
        orders: dict[str, np.ndarray] | None = None,
        init: Initializer | int = 0,
        optimizer: str = "sgd",
        lr: float = 0.01,
        eps: float = 1e-8,
        period: int | None = None,
        device: torch.device | str | None = None,
        layout: str = "exact",
        wire_dtype: WireDtype | str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError("ShardedSequenceEmbedding: torch.distributed is not initialised")
        self.device = _device(device)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.optimizer, self.lr, self.eps = optimizer, float(lr), float(eps)
        self.plan_file = plan_file
        self.dedup, self.sync, self.wire_dtype = (
            plan_file.plan.dedup,
            plan_file.plan.sync,
            plan_file.plan.wire,
        )
        self.table_names = [str(t[0]) for t in tables]
        self.dims = [int(t[2]) for t in tables]
        self.layout = layout
        self._agree(ConfigError, self._option_problem() or self._wire_problem(wire_dtype))
        self._agree(
            PlanMismatchError,
            world_mismatch(plan_file, self.world_size) or tables_mismatch(plan_file, tables, orders),
        )

        timeout = None if timeout_s is None else timedelta(seconds=float(timeout_s))
        self.pg: ProcessGroups = make_process_groups(plan_file.layout, timeout)
        build = build_compact_routing if layout == "compact" else build_routing
        self.routing: list[TableRouting | CompactTableRouting] = [
            build(tp, plan_file.groups, (orders or {}).get(name), period or plan_file.owner_pattern_period)
            for tp, name in zip(plan_file.plan.tables, self.table_names, strict=True)
        ]
        self.shards = self._init_shards(seeded_initializer(init) if isinstance(init, int) else init)
        self.uses_warm = any(r.warm_rows > 0 for r in self.routing)
        fetch = np.array([tp.fetch is FetchMode.GROUP for tp in plan_file.plan.tables])
        cold = np.array([r.cold_rows > 0 for r in self.routing])
        flat_cold, group_cold = cold & ~fetch, cold & fetch
        tiers = ([Tier.WARM] if self.uses_warm else []) + ([Tier.COLD] if flat_cold.any() else [])
        takes = np.array([[tier is Tier.WARM or f for tier in tiers] for f in flat_cold], dtype=bool)
        self.exchange = FlatExchange(
            plan_file.layout, self.rank, tiers, takes, self.dims, self.shards, self.device, self.wire_dtype
        )
        self.group_exchange = (
            GroupExchange(
                self.pg, group_cold, self.routing, self.dims, self.shards, self.device, self.wire_dtype
            )
            if group_cold.any()
            else None
        )
        self._hot_all_reduce = hierarchical_all_reduce(self.pg, self.wire_dtype)
        replica = self.pg.replica_ranks
        self._warm_all_reduce = ring_all_reduce(
            self.pg.replica, len(replica), replica.index(self.rank), self.wire_dtype
        )
        self._anchor = torch.zeros((), requires_grad=True)
        self.traffic = Traffic.zeros()  # this iteration's bytes
        self.traffic_total = Traffic.zeros()  # bytes of every completed step

    # --- setup ----------------------------------------------------------------------------------

    def _option_problem(self) -> str:
        if self.optimizer not in OPTIMIZERS:
            return f"optimizer: must be one of {OPTIMIZERS}, got {self.optimizer!r}"
        if self.layout not in LAYOUTS:
            return f"layout: must be one of {LAYOUTS}, got {self.layout!r}"
        bad = [(n, d) for n, d in zip(self.table_names, self.dims, strict=True) if d <= 0]
        if bad:
            return f"table {bad[0][0]!r}: dim must be positive, got {bad[0][1]}"
        return ""

    def _wire_problem(self, wire_dtype: WireDtype | str | None) -> str:
        """'' when ``wire_dtype`` is None or the plan's ``settings.wire``, else why not."""
        if wire_dtype is None:
            return ""
        try:
            asked = WireDtype.parse(wire_dtype)
        except ConfigError as e:
            return f"wire_dtype: {e}"
        if asked is self.wire_dtype:
            return ""
        return (
            f"wire_dtype: {asked} differs from the plan's settings.wire {self.wire_dtype}; make the plan "
            f"with --wire-dtype {asked}, or run it with PlanFile.with_overrides(wire={asked.value!r})"
        )

    def _agree(self, error: type[Exception], message: str) -> None:
        """Raise ``error`` on every rank when any rank's ``message`` is not empty (collective)."""
        message = agreed_message(message, self.device)
        if message:
            raise agreed(error(message))

    def _init_shards(self, init: Initializer) -> dict[tuple[int, Tier], Shard]:
        """This rank's rows of every table and tier, initialised by ``init`` (rows in slot order)."""
        shards = {}
        for t, (name, r) in enumerate(zip(self.table_names, self.routing, strict=True)):
            for tier, owner in ((Tier.HOT, -1), (Tier.WARM, self.pg.position), (Tier.COLD, self.rank)):
                ids = r.ids_of(tier, owner)
                w = init(name, ids, self.dims[t])
                if tuple(w.shape) != (ids.size, self.dims[t]):
                    raise ConfigError(
                        f"table {name!r}: initializer returned shape {tuple(w.shape)} for {ids.size} rows, "
                        f"expected {(ids.size, self.dims[t])}"
                    )
                shards[(t, tier)] = Shard.of(ids, w.to(device=self.device, dtype=torch.float32).contiguous())
        return shards

    # --- forward -----------------------------------------------------------------------------------

    def forward(self, features) -> dict[str, torch.Tensor]:
        """Jagged embeddings ``[sum(lengths), dim]`` per table, in input order. ``features``: per
        table ``(values, lengths)``, or a TorchRec KeyedJaggedTensor (keys = table names). Collective:
        every rank calls it (and, when training, backward) the same number of times."""
        if not isinstance(features, dict):
            features = features_from_kjt(features)
        num_rows = [r.num_rows for r in self.routing]
        parsed, err = check_features(features, self.table_names, num_rows, self.device)
        lookups = flat = None
        if int(err[0]) == 0:
            hot = self._tier_shards(Tier.HOT)
            lookups = local_lookups(parsed, self.routing, self.dedup, hot, self.device)
            flat = self.exchange.prepare(lookups)
        counts = flat.counts if flat is not None else self.exchange.empty_counts(len(self.dims))
        recv_counts, codes = self.exchange.exchange_meta(err, counts)  # every rank's error code, too
        if any(int(e[0]) for e in codes):
            raise_input_error(codes, self.table_names, num_rows)
        group = self.group_exchange.prepare(lookups) if self.group_exchange is not None else None
        self.traffic = Traffic.zeros()
        outs = _Lookup.apply(self._anchor, self, (lookups, flat, recv_counts, group))
        return dict(zip(self.table_names, outs, strict=True))

    def padded(self, jagged: torch.Tensor, lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        """[batch, max_len, dim] view of one table's jagged output (see :func:`to_padded`)."""
        return to_padded(jagged, lengths, max_len)

    def _forward_impl(
        self,
        lookups: list[TableLookup],
        flat: FlatBatch,
        recv_counts: np.ndarray,
        group: GroupBatch | None,
    ):
        flat_state = (
            self.exchange.forward(flat, recv_counts, lookups, self.traffic) if self.exchange.tiers else None
        )
        group_state = (
            self.group_exchange.forward(group, lookups, self.traffic) if self.group_exchange else None
        )
        return [lk.output() for lk in lookups], (lookups, flat_state, group_state)

    # --- backward ----------------------------------------------------------------------------------

    def _backward_impl(
        self,
        lookups: list[TableLookup],
        flat_state: FlatState | None,
        group_state: GroupState | None,
        grads,
    ) -> None:
        unique_grads = []
        for t, (lk, g) in enumerate(zip(lookups, grads, strict=True)):
            gu = lk.unique_gradient(g.to(device=self.device, dtype=torch.float32))
            self.shards[(t, Tier.HOT)].add_gradient(lk.hot_slot, gu.index_select(0, lk.hot_index))
            unique_grads.append(gu)
        scale = gradient_scale(unique_grads, self.wire_dtype, self.world_size, self.device)
        if flat_state is not None:
            self.exchange.backward(flat_state, unique_grads, self.traffic, scale)
        if group_state is not None:
            self.group_exchange.backward(group_state, unique_grads, self.traffic, scale)

    # --- replica sync and optimizer step ----------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002
        for shard in self.shards.values():
            shard.clear_gradients()

    def _tier_shards(self, tier: Tier) -> list[Shard]:
        return [self.shards[(t, tier)] for t in range(len(self.dims))]

    def step(self) -> None:
        """Synchronise replica gradients, apply the optimizer to rows that received gradient, zero the
        gradients. Collective."""
        g_size = len(self.pg.intra_ranks)
        n_groups = self.pg.num_groups
        hot_shards = self._tier_shards(Tier.HOT)
        scale = gradient_scale([s.grads for s in hot_shards], self.wire_dtype, self.world_size, self.device)
        hot_payload = sync_gradients(hot_shards, self._hot_all_reduce, self.sync, self.wire_dtype, scale)
        hot = wire.hierarchical_allreduce_bytes(g_size, n_groups, hot_payload)
        for link in LinkClass:
            self.traffic.add(link, Component.SYNC, hot[link], hot[link])
        if self.uses_warm:
            warm_shards = self._tier_shards(Tier.WARM)
            scale = gradient_scale([s.grads for s in warm_shards], self.wire_dtype, n_groups, self.device)
            warm_payload = sync_gradients(
                warm_shards, self._warm_all_reduce, self.sync, self.wire_dtype, scale
            )
            warm = wire.ring_allreduce_bytes(n_groups, warm_payload)
            self.traffic.add(LinkClass.INTER_GROUP, Component.SYNC, warm, warm)
        for shard in self.shards.values():
            shard.apply(self.optimizer, self.lr, self.eps)
        self.traffic_total += self.traffic

    # --- inspection ------------------------------------------------------------------------------

    def traffic_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        """This iteration's bytes as ``{link: {component: {"send": b, "recv": b}}}``."""
        return self.traffic.to_dict()

    def link_bytes(self, components: tuple[Component, ...] = tuple(Component)) -> dict[str, float]:
        """max(send, recv) per link class summed over ``components`` (what the cost model reports)."""
        return {link.label: float(self.traffic.link_bytes(link, components)) for link in LinkClass}

    def shard_rows(self) -> dict[tuple[str, str], tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """``{(table, tier): (ids, weights, optimizer state)}`` this rank holds, rows in slot order."""
        return {
            (self.table_names[t], tier.label): (s.ids, s.weights.detach().cpu(), s.state.cpu())
            for (t, tier), s in self.shards.items()
        }


def _device(device: torch.device | str | None) -> torch.device:
    """``device``, or for NCCL this rank's GPU (LOCAL_RANK under torchrun, else rank modulo the visible
    GPUs; made current), else the CPU."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")
