"""A torch module that executes a FlexShard plan on torch.distributed.

Every rank holds all hot rows of every table, its share of its group's warm rows and its share of the
cluster's cold rows (plus their optimizer state, placed like the rows; :mod:`~flexshard.runtime.shards`).
A forward pass checks its input (:mod:`~flexshard.runtime.features`), reads hot rows locally
(:mod:`~flexshard.runtime.lookups`) and runs the exchange protocol
(:mod:`~flexshard.runtime.exchange_protocol`): ``ids`` (every id, each peer's block headed by the
sender's error code and split sizes), the owners' and rail peers' local dedup and gathers, ``rows``
and, for cold rows fetched once per group, ``scatter``; every table and tier in the same collectives.
Backward (through a ``torch.autograd.Function``) runs ``grads`` and ``rail_grads``, summing per row at
the rail peer and the owner. :meth:`ShardedSequenceEmbedding.step` then runs the ``sync`` phase
(:mod:`~flexshard.runtime.replicas`: one touched-mask all-reduce, the hot and warm gradients bucketed per
level) and applies row-wise SGD or row-wise Adagrad to the rows that received gradient. The stages are
exactly :func:`solvers.schedule.step_schedule` of the plan (tests/runtime/test_collective_count.py).

Gradient semantics: the gradient a row receives is the sum over all ranks of the gradient of that rank's
loss (as if the global loss were the sum of the per-rank losses; divide the loss by the world size
yourself for a mean). Every copy of a replicated row gets the same summed gradient and the same update,
so copies stay bitwise equal.

The plan file is a contract (:mod:`flexshard.contract`): a plan made for another world size, other
groups, other tables (names, rows, dim) or other data (another hotness order) is refused on every rank
with one :class:`~core.errors.PlanMismatchError`. Dedup and sync follow the plan; run other settings
with :meth:`flexshard.plan_file.PlanFile.with_overrides`.

Traffic (bytes per rank per iteration) is a :class:`core.traffic.Traffic` record: lookups counted from
the realised split sizes (:mod:`~flexshard.runtime.exchange_bytes`), sync bytes from the realised
payload, both with :mod:`solvers.wire`'s formulas (vectors as ``dim`` elements of the plan's wire
dtype, :func:`solvers.wire.vector_bytes`).

Wire precision: embeddings and gradients cross every all-to-all and the replica sync as the plan's
``settings.wire`` (:class:`~core.vocabulary.WireDtype`; ``wire_dtype``, when given, must agree with it).
Rows, optimizer state and every gradient sum stay float32: a vector is rounded when it is sent and
widened when it arrives (:mod:`~flexshard.runtime.transfer`, :mod:`~flexshard.runtime.replicas`); on
fp16 each sender scales its gradients by its own power of two and sends the exponent with them.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from core.errors import ConfigError, PlanMismatchError, agreed
from core.traffic import Traffic
from core.vocabulary import Component, FetchMode, LinkClass, SyncMode, Tier, WireDtype
from flexshard.contract import tables_mismatch, world_mismatch
from flexshard.plan_file import PlanFile
from flexshard.runtime import dcp_state
from flexshard.runtime.agreement import agreed_message
from flexshard.runtime.awaitable import Pending
from flexshard.runtime.exchange_protocol import Asked, ExchangeProtocol
from flexshard.runtime.features import check_features, features_from_kjt, to_padded
from flexshard.runtime.groups import ProcessGroups, make_process_groups
from flexshard.runtime.initializer import Initializer, seeded_initializer
from flexshard.runtime.input_dist import PendingInput, Prepared
from flexshard.runtime.lookups import TableLookup, local_lookups
from flexshard.runtime.optimizers import Hyper, canonical, row_optimizer
from flexshard.runtime.replicas import ReplicaSync
from flexshard.runtime.route import Routed
from flexshard.runtime.routing import (
    LAYOUTS,
    CompactTableRouting,
    TableRouting,
    build_compact_routing,
    build_routing,
)
from flexshard.runtime.shards import Shard, ShardBank, banked_shards


class _Lookup(torch.autograd.Function):
    """The rows of a batch past ``output_dist`` in input order, differentiable: backward runs the
    module's ``grads`` and ``rail_grads`` (``batch``: the batch's ``Routed`` and ``Asked``)."""

    @staticmethod
    def forward(ctx, anchor, module, batch):  # noqa: ARG004
        ctx.module, ctx.state = module, batch
        return batch[0].outputs()

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
    ``optimizer``: a name of :mod:`flexshard.runtime.optimizers` (``adagrad`` is ``rowwise_adagrad``),
    with ``lr``, ``eps`` and ``betas`` (Adam's; no weight decay); :attr:`optimizer_step` counts
    :meth:`step` calls (Adam's bias-correction ``t``), the same on every rank.
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
        betas: tuple[float, float] = (0.9, 0.999),
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
        self.betas = (float(betas[0]), float(betas[1]))
        self.optimizer_step = 0  # step() calls so far: Adam's t, kept identical on every rank
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
        self.optimizer = canonical(optimizer)
        self.row_optimizer = row_optimizer(optimizer)
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
        initializer = seeded_initializer(init) if isinstance(init, int) else init
        self.shards, self.banks = self._init_shards(initializer)
        plan = plan_file.plan
        several = self.world_size > 1
        group_fetch = np.array([tp.fetch is FetchMode.GROUP for tp in plan.tables])
        cold = np.array([r.cold_rows > 0 for r in self.routing])
        uses_warm = any(r.warm_rows > 0 for r in self.routing)
        uses = (uses_warm, bool((cold & ~group_fetch).any()), bool((cold & group_fetch).any()))
        # on one rank the stages are local copies (no collective), as step_schedule says
        self.remote = uses_warm or bool(cold.any())
        self.group_fetch = uses[2]
        self.protocol = ExchangeProtocol(
            self.pg, group_fetch, self.routing, self.dims, self.shards, self.device, self.wire_dtype, uses
        )
        # all-cold tables on the exact layout dedup straight into destination order: flat ones by owner,
        # group-fetched ones by the group fetch's owner key (local_lookups' unique_order)
        rail = (self.protocol.owner_key, self.protocol.key_owner)
        self._unique_order = [
            (rail if g else (None, None)) if r.layout == "exact" and r.hot_rows + r.warm_rows == 0 else None
            for r, g in zip(self.routing, group_fetch, strict=True)
        ]
        g = int(plan_file.layout.group_sizes.max())
        warm_sizes = np.zeros((len(self.routing), g), dtype=np.int64)
        for t, r in enumerate(self.routing):
            warm_sizes[t, : len(r.warm_rows_per_position)] = r.warm_rows_per_position
        self.replica_sync = ReplicaSync(
            self.pg,
            self.shards,
            len(self.dims),
            warm_sizes,
            self.sync,
            self.wire_dtype,
            hot_sync=several and any(r.hot_rows > 0 for r in self.routing),
            warm_sync=uses_warm and self.pg.num_groups > 1,
        )
        self._anchor = torch.zeros((), requires_grad=True)
        self.traffic = Traffic.zeros()  # this iteration's bytes
        self.traffic_total = Traffic.zeros()  # bytes of every completed step

    @property
    def hyper(self) -> Hyper:
        """The optimizer's hyper-parameters as set now (``lr`` may be changed between steps)."""
        return Hyper(self.lr, self.eps, *self.betas)

    # --- setup ----------------------------------------------------------------------------------

    def _option_problem(self) -> str:
        try:
            canonical(self.optimizer)
        except ConfigError as e:
            return str(e)
        if self.hyper.problem():
            return self.hyper.problem()
        if self.sync is SyncMode.DENSE and row_optimizer(self.optimizer).zero_gradient_moves:
            return (
                f"optimizer: {canonical(self.optimizer)} needs the plan's sync 'sparse' (dense sync updates "
                "every replicated row, and this optimizer moves rows without gradient); make the plan with "
                "--sync sparse, or run it with PlanFile.with_overrides(sync='sparse')"
            )
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

    def _init_shards(self, init: Initializer) -> tuple[dict[tuple[int, Tier], Shard], list[ShardBank]]:
        """This rank's rows of every table and tier, initialised by ``init`` (rows in slot order), and
        their banks by dim (the optimizer step is one update per bank, :func:`banked_shards`)."""
        parts = {}
        for t, (name, r) in enumerate(zip(self.table_names, self.routing, strict=True)):
            for tier, owner in ((Tier.HOT, -1), (Tier.WARM, self.pg.position), (Tier.COLD, self.rank)):
                ids = r.ids_of(tier, owner)
                w = init(name, ids, self.dims[t])
                if tuple(w.shape) != (ids.size, self.dims[t]):
                    raise ConfigError(
                        f"table {name!r}: initializer returned shape {tuple(w.shape)} for {ids.size} rows, "
                        f"expected {(ids.size, self.dims[t])}"
                    )
                parts[(t, tier)] = (ids, w.to(device=self.device, dtype=torch.float32))
        return banked_shards(parts, self.row_optimizer)

    # --- forward -----------------------------------------------------------------------------------

    def forward(self, features) -> dict[str, torch.Tensor]:
        """Jagged embeddings ``[sum(lengths), dim]`` per table, in input order. ``features``: per
        table ``(values, lengths)``, a TorchRec KeyedJaggedTensor (keys = table names), or a
        :class:`~flexshard.runtime.input_dist.Prepared` batch from :meth:`input_dist` (its hot rows are
        read again here, after any update since). Collective: every rank calls it (and, when training,
        backward) the same number of times."""
        fresh = isinstance(features, Prepared)
        prepared = features if fresh else self.input_dist(features).wait()
        asked = self.compute(prepared, read_hot=fresh)
        return dict(zip(self.table_names, self.output_dist(prepared.routed, asked).wait(), strict=True))

    def input_dist(self, features, group=None) -> PendingInput:
        """The weight-free part of :meth:`forward` for ``features``: the input check, dedup and local
        routing, then ``ids`` issued on ``group`` (a process group of every rank in rank order; None:
        the default group), its headers read on :meth:`PendingInput.advance` or ``wait``. Collective:
        every rank calls it, on the same group, in the same order as its other stages there."""
        if not isinstance(features, dict):
            features = features_from_kjt(features)
        num_rows = [r.num_rows for r in self.routing]
        parsed, err = check_features(features, self.table_names, num_rows, self.device)
        routed = None
        if int(err[0]) == 0:  # input_dist, local part: dedup, routing, hot rows
            hot = self._tier_shards(Tier.HOT)
            lookups = local_lookups(parsed, self.routing, self.dedup, hot, self.device, self._unique_order)
            routed = self.protocol.route(lookups)
        ids = self.protocol.input_ids(err, routed if self.remote else None, group)  # every rank's code, too
        return PendingInput(routed, ids, len(self.dims), self.remote, (self.table_names, num_rows))

    def _read_hot(self, lookups: list[TableLookup]) -> None:
        """The hot rows of ``lookups`` read from the local replica (as they are now)."""
        for t, lk in enumerate(lookups):
            if not lk.hot_index.numel():
                continue
            hot = self.shards[(t, Tier.HOT)].weights.index_select(0, lk.hot_slot)
            lk.rows.index_copy_(0, lk.hot_index, hot)

    def padded(self, jagged: torch.Tensor, lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        """[batch, max_len, dim] view of one table's jagged output (see :func:`to_padded`)."""
        return to_padded(jagged, lengths, max_len)

    def compute(self, prepared: Prepared, read_hot: bool = True) -> Asked | None:
        """``compute`` of a batch past ``input_dist``: its hot rows read from the local replica as they are
        now (``read_hot``; skip it right after ``input_dist``), the owners' and rail peers' local work
        (None when no table has remote rows). Starts this iteration's :attr:`traffic`. No collective."""
        if read_hot:
            self._read_hot(prepared.routed.lookups)
        self.traffic = Traffic.zeros()
        return self.protocol.compute(prepared.received, prepared.recv_counts) if self.remote else None

    def output_dist(self, routed: Routed, asked: Asked | None) -> Pending[tuple[torch.Tensor, ...]]:
        """``output_dist`` of a batch after :meth:`compute`: ``rows`` issued now; on wait, ``scatter`` (the
        group fetch) and the jagged rows ``[sum(lengths), dim]`` per table in input order, differentiable
        (backward runs ``grads`` and ``rail_grads``). Collective."""
        if asked is None:
            return Pending([], lambda: _Lookup.apply(self._anchor, self, (routed, None)))
        rows = self.protocol.rows(routed, asked, self.traffic)

        def finish() -> tuple[torch.Tensor, ...]:
            # named like the autograd function, whose waits experiments/profile_step.py counts as one piece
            with torch.autograd.profiler.record_function("_Lookup.output_dist"):
                distinct = rows.wait()
                if self.group_fetch:
                    self.protocol.scatter(routed, asked, distinct).wait()
            return _Lookup.apply(self._anchor, self, (routed, asked))

        return Pending([], finish)

    # --- backward ----------------------------------------------------------------------------------

    def _backward_impl(self, routed: Routed, asked: Asked | None, grads) -> None:
        grads = [g.to(device=self.device, dtype=torch.float32) for g in grads]
        if routed.joint is not None:  # every table by rail: no hot rows, the gradients in wire order
            unique_grads = routed.joint.gradient(grads)
        else:
            unique_grads = []
            for t, (lk, g) in enumerate(zip(routed.lookups, grads, strict=True)):
                gu = lk.unique_gradient(g)
                if lk.hot_index.numel():
                    self.shards[(t, Tier.HOT)].add_gradient(lk.hot_slot, gu.index_select(0, lk.hot_index))
                unique_grads.append(gu)
        if asked is None:
            return
        sums = self.protocol.grads(routed, asked, unique_grads).wait()
        if self.group_fetch:
            self.protocol.rail_grads(asked, sums).wait()
        self.protocol.bytes.backward(self.traffic)

    # --- replica sync and optimizer step ----------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002
        for bank in self.banks:
            bank.clear_gradients()

    def _tier_shards(self, tier: Tier) -> list[Shard]:
        return [self.shards[(t, tier)] for t in range(len(self.dims))]

    def step(self) -> None:
        """Synchronise replica gradients (the ``sync`` phase,
        :class:`~flexshard.runtime.replicas.ReplicaSync`), apply the optimizer to rows that received
        gradient (as iteration ``optimizer_step + 1``), zero the gradients. Collective."""
        self.replica_sync.step(self.traffic)
        self.optimizer_step += 1
        hyper = self.hyper
        for bank in self.banks:  # every table and tier of a dim at once
            bank.apply(self.row_optimizer, hyper, self.optimizer_step)
        self.traffic_total += self.traffic

    # --- inspection ------------------------------------------------------------------------------

    def traffic_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        """This iteration's bytes as ``{link: {component: {"send": b, "recv": b}}}``."""
        return self.traffic.to_dict()

    def link_bytes(self, components: tuple[Component, ...] = tuple(Component)) -> dict[str, float]:
        """max(send, recv) per link class summed over ``components`` (what the cost model reports)."""
        return {link.label: float(self.traffic.link_bytes(link, components)) for link in LinkClass}

    # --- torch.distributed.checkpoint ------------------------------------------------------------

    def dcp_state_dict(self, empty: bool = False, prefix: str = "") -> dict:
        """Every row once in the canonical layout of DTensors, with its optimizer state, keyed as TorchRec
        does (:func:`~flexshard.runtime.dcp_state.dcp_state_dict`); for ``torch.distributed.checkpoint``.
        ``empty``: a template for ``dcp.load`` (no move); ``prefix``: before every weight key. Collective.
        (``state_dict()`` stays the plain ``nn.Module`` one, not collective.)"""
        return dcp_state.dcp_state_dict(self, empty, prefix)

    def load_dcp_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        """Set every row held here from a :meth:`dcp_state_dict` filled by ``torch.distributed.checkpoint``
        (saved at any world size and plan). Collective."""
        dcp_state.load_dcp_state_dict(self, state_dict, prefix)

    def shard_rows(self) -> dict[tuple[str, str], tuple[np.ndarray, torch.Tensor, dict[str, torch.Tensor]]]:
        """``{(table, tier): (ids, weights, {state name: state})}`` this rank holds, rows in slot order."""
        return {
            (self.table_names[t], tier.label): (
                s.ids,
                s.weights.detach().cpu(),
                {n: v.cpu() for n, v in s.states.items()},
            )
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
