"""A TorchRec ``EmbeddingCollection`` sharded by a FlexShard plan: TorchRec's ``ShardedEmbeddingModule``
contract on the runtime's :class:`~flexshard.runtime.ShardedSequenceEmbedding` and its exchange protocol.

=================  ====================================================================================
TorchRec stage     FlexShard stages (:mod:`flexshard.runtime.exchange_protocol`)
=================  ====================================================================================
``input_dist``     input checks, dedup, routing, hot rows; ``ids`` issued. First wait: its headers read
                   (``ids_overflow`` issued in a batch that needs it); second wait: the ids (a
                   ``KJTList`` of one :class:`FlexShardInput`, the form TorchRec's train pipelines
                   carry)
``compute``        the hot rows read again (an update may have run since ``input_dist``), the owners' and
                   rail peers' gathers and dedup (local)
``output_dist``    ``rows`` issued; on wait ``scatter`` (group fetch) and ``Dict[str, JaggedTensor]``
backward           ``grads``, ``rail_grads`` (autograd)
``fused_optimizer``  ``step()``: the replica ``sync`` and the row update
=================  ====================================================================================

Checkpoints: ``state_dict()`` gives every row once as ``Shard(0)`` DTensors of contiguous row blocks at
``<path>.embeddings.<t>.weight`` (TorchRec's keys; :mod:`flexshard.runtime.dcp_state`) and
``_load_from_state_dict`` (what ``Module.load_state_dict`` and DMP call) re-deals them by this rank's
plan; the fused optimizer's ``state_dict()`` / ``load_state_dict()`` do the same for the optimizer state
(:mod:`flexshard.torchrec.optimizer`). Each is collective (one all-to-all), as TorchRec's own sharded
state dicts are: every rank calls them, in the same order, e.g. ``dcp.save({"model": dmp.state_dict(),
"optim": dmp.fused_optimizer.state_dict()})``.

Gradients: as TorchRec's own sharded modules, a row's gradient is the mean over the ranks of the
gradient of each rank's loss while ``torchrec.distributed.comm_ops.get_gradient_division()`` (the
default; the sum when it is off), matching DDP's mean of the dense gradients.

Features: each table's features (``EmbeddingConfig.feature_names``) are looked up together, their values
concatenated (one dedup over all of them); the output has one ``JaggedTensor`` per embedding name
(``EmbeddingCollection.embedding_names_by_table``) with the feature's lengths, rows in input order, ids
as weights when the collection has ``need_indices``, as ``EmbeddingCollection.forward`` gives them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList, ShardedEmbeddingModule
from torchrec.distributed.types import Awaitable, LazyAwaitable, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from core.errors import BatchError, ConfigError
from core.vocabulary import Tier
from flexshard.plan_file import PlanFile
from flexshard.runtime import ShardedSequenceEmbedding, dcp_state, features_from_kjt, seeded_initializer
from flexshard.runtime.awaitable import Pending
from flexshard.runtime.exchange_protocol import Asked
from flexshard.runtime.initializer import Initializer
from flexshard.runtime.input_dist import PendingInput, Prepared
from flexshard.runtime.route import Routed
from flexshard.torchrec.fused_params import OptimizerSettings
from flexshard.torchrec.optimizer import FlexShardFusedOptimizer


@dataclass
class FlexShardContext(Multistreamable):
    """One batch's per-feature layout, from ``input_dist`` to ``output_dist``. Per table (collection
    order): each feature's value count, lengths and (``need_indices``) ids. ``sharding_contexts`` stays
    empty: TorchRec's pipeline helpers read it."""

    sizes: dict[str, list[int]] = field(default_factory=dict)
    lengths: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    indices: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    sharding_contexts: list = field(default_factory=list)

    def record_stream(self, stream: torch.Stream) -> None:
        for tensors in (*self.lengths.values(), *self.indices.values()):
            for t in tensors:
                t.record_stream(stream)


@dataclass
class FlexShardInput(Multistreamable):
    """A batch past ``input_dist`` (:class:`~flexshard.runtime.input_dist.Prepared`)."""

    prepared: Prepared

    def record_stream(self, stream: torch.Stream) -> None:
        for lk in self.prepared.routed.lookups:
            for t in (lk.ids, lk.tier, lk.owner, lk.slot, lk.hot_index, lk.hot_slot, lk.rows):
                if t is not None:  # tier: None for a table with only cold rows
                    t.record_stream(stream)
        for columns in self.prepared.received or []:
            for t in columns:
                t.record_stream(stream)


class _Ids(Awaitable[FlexShardInput]):
    def __init__(self, pending: PendingInput) -> None:
        super().__init__()
        self._pending = pending

    def _wait_impl(self) -> FlexShardInput:
        return FlexShardInput(self._pending.wait())


class _Meta(Awaitable[Awaitable[FlexShardInput]]):
    def __init__(self, pending: PendingInput) -> None:
        super().__init__()
        self._pending = pending

    def _wait_impl(self) -> Awaitable[FlexShardInput]:
        self._pending.advance()  # ids' headers read (the overflow issued where needed)
        return _Ids(self._pending)


class _GradientDivision(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the world size while TorchRec's gradient
    division is on (``torchrec.distributed.comm_ops.set_gradient_division``, on by default), as TorchRec's
    own sharded modules do in their output all-to-all's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, world: int) -> torch.Tensor:
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad / ctx.world if get_gradient_division() else grad), None


class _Outputs(LazyAwaitable[dict[str, JaggedTensor]]):
    def __init__(self, pending: Pending, ctx: FlexShardContext, module: FlexShardEmbeddingCollection) -> None:
        super().__init__()
        self._pending, self._ctx, self._module = pending, ctx, module

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        return self._module._jagged(self._ctx, self._pending.wait())


class FlexShardEmbeddingCollection(
    ShardedEmbeddingModule[KJTList, tuple, dict[str, JaggedTensor], FlexShardContext],
    FusedOptimizerModule,
):
    """``module`` (an ``EmbeddingCollection``) sharded by ``plan_file`` (see the module docstring).

    Rows start as the module's weights where it has real ones (each rank copies the rows it holds), else
    from ``seed`` (:func:`~flexshard.runtime.seeded_initializer`; a module on the meta device). The plan
    must be for the job's world size and groups and for exactly the collection's tables (name, rows, dim;
    in any order) with their hotness ``orders``: otherwise one :class:`~core.errors.PlanMismatchError` line
    on every rank. ``env`` must span every rank of the default process group.
    """

    def __init__(
        self,
        module: EmbeddingCollection,
        plan_file: PlanFile,
        env: ShardingEnv,
        settings: OptimizerSettings,
        orders: dict[str, np.ndarray] | None = None,
        seed: int = 0,
        device: torch.device | None = None,
        layout: str = "exact",
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(None)
        if env.world_size != dist.get_world_size():
            raise ConfigError(
                f"env: FlexShardSharder shards over the default process group ({dist.get_world_size()} "
                f"ranks), got a ShardingEnv of {env.world_size} ranks"
            )
        configs = module.embedding_configs()
        self._tables = [c.name for c in configs]
        self._features = [list(c.feature_names) for c in configs]
        self._embedding_names = module.embedding_names_by_table()
        self._need_indices = module.need_indices()
        tables = [(c.name, int(c.num_embeddings), int(c.embedding_dim)) for c in configs]
        self.embedding = ShardedSequenceEmbedding(
            plan_file.restricted_to(self._tables),
            tables,
            orders,
            init=_initializer(module, seed),
            optimizer=settings.optimizer,
            lr=settings.lr,
            eps=settings.eps,
            betas=settings.betas,
            device=device,
            layout=layout,
            timeout_s=timeout_s,
        )
        self._optim = FlexShardFusedOptimizer(self.embedding)

    # --- TorchRec's contract --------------------------------------------------------------------

    def create_context(self) -> FlexShardContext:
        return FlexShardContext()

    def input_dist(self, ctx: FlexShardContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        """Checks, dedup, routing and ``ids`` now; its headers read on the first wait (collective)."""
        if (
            callable(getattr(features, "variable_stride_per_key", None))
            and features.variable_stride_per_key()
        ):
            raise BatchError(
                "features: a KeyedJaggedTensor with a batch size per feature (VBE) is not supported"
            )
        per_key = features_from_kjt(features)
        tables = {}
        for name, feats in zip(self._tables, self._features, strict=True):
            if not all(f in per_key for f in feats):
                continue  # the table is missing: the runtime's input check fails it on every rank
            values, lengths = [per_key[f][0] for f in feats], [per_key[f][1] for f in feats]
            ctx.sizes[name] = [int(v.numel()) for v in values]
            ctx.lengths[name] = lengths
            if self._need_indices:
                ctx.indices[name] = values
            several = len(feats) > 1
            tables[name] = (torch.cat(values), torch.cat(lengths)) if several else (values[0], lengths[0])
        return KJTListSplitsAwaitable([_Meta(self.embedding.input_dist(tables))], ctx)

    def compute(self, ctx: FlexShardContext, dist_input: KJTList) -> tuple[Routed, Asked | None]:
        """The hot rows read as they are now, the owners' and rail peers' local work (no collective)."""
        prepared = dist_input[0].prepared
        return prepared.routed, self.embedding.compute(prepared)

    def output_dist(self, ctx: FlexShardContext, output: tuple[Routed, Asked | None]) -> LazyAwaitable:
        """``rows`` issued now; ``scatter`` and the outputs on wait (collective)."""
        return _Outputs(self.embedding.output_dist(*output), ctx, self)

    def _jagged(self, ctx: FlexShardContext, outs: tuple[torch.Tensor, ...]) -> dict[str, JaggedTensor]:
        result = {}
        world = self.embedding.world_size
        for t, (name, out) in enumerate(zip(self._tables, outs, strict=True)):
            out = _GradientDivision.apply(out, world)
            sizes = ctx.sizes[name]
            chunks = torch.split(out, sizes) if len(sizes) > 1 else (out,)
            for j, emb_name in enumerate(self._embedding_names[t]):
                ids = ctx.indices[name][j] if self._need_indices else None
                result[emb_name] = JaggedTensor(values=chunks[j], lengths=ctx.lengths[name][j], weights=ids)
        return result

    # --- state dict (torch.distributed.checkpoint) -----------------------------------------------

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False):
        """``{prefix + "embeddings.<t>.weight": DTensor}``, every row once in the canonical layout of
        :mod:`flexshard.runtime.dcp_state` (keys as TorchRec's ``EmbeddingCollection``), what
        ``dcp.save`` saves and ``dcp.load`` fills. Collective (one all-to-all), like TorchRec's sharded
        state dicts: every rank calls it, in the same order. ``keep_vars`` changes nothing."""
        if args:  # nn.Module's deprecated positional form: destination, prefix, keep_vars
            destination, prefix, *_ = (*args, prefix)
        out = OrderedDict() if destination is None else destination
        emb = self.embedding
        canonical = dcp_state.to_canonical(emb, frozenset({dcp_state.WEIGHT}))
        model, _state = dcp_state.as_dtensors(canonical, dcp_state.device_mesh(emb), prefix)
        out.update(model)
        return out

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Every row held here from ``state_dict[prefix + "embeddings.<t>.weight"]`` (DTensors as
        :meth:`state_dict` gave them and ``dcp.load`` filled them, saved at any world size and plan, or
        whole tensors). Collective (one all-to-all); a missing table is reported in ``missing_keys`` and
        nothing moves; a block of another shape is one agreed CheckpointError."""
        emb = self.embedding
        keys = {dcp_state.weight_key(t, prefix): t for t in self._tables}
        missing = [k for k in keys if k not in state_dict]
        missing_keys.extend(missing)
        if strict:
            head = f"{prefix}embeddings."
            unexpected_keys.extend(k for k in state_dict if k.startswith(head) and k not in keys)
        if missing:
            return
        blocks = {}
        for t, (key, table) in enumerate(keys.items()):
            v = state_dict[key]
            lo, hi = dcp_state.block_bounds(emb.routing[t].num_rows, emb.world_size, emb.rank)
            blocks[table] = {dcp_state.WEIGHT: v.to_local() if isinstance(v, DTensor) else v[lo:hi]}
        weight = frozenset({dcp_state.WEIGHT})
        dcp_state.from_canonical(emb, dcp_state.canonical_of(emb, blocks), weight)

    @property
    def fused_optimizer(self) -> FlexShardFusedOptimizer:
        return self._optim

    @property
    def unsharded_module_type(self) -> type[EmbeddingCollection]:
        return EmbeddingCollection

    # --- inspection -------------------------------------------------------------------------------

    def table_rows(self, table: str) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
        """``{tier: (ids, weights)}`` of ``table`` this rank holds (rows in slot order)."""
        t = self._tables.index(table)
        shards = self.embedding.shards
        return {tier.label: (shards[(t, tier)].ids, shards[(t, tier)].weights) for tier in Tier}


def _initializer(module: EmbeddingCollection, seed: int) -> Initializer:
    """The module's weights (each rank copies the rows it holds), or ``seed``'s rows on the meta device."""
    weights = {name: emb.weight for name, emb in module.embeddings.items()}
    if any(w.device.type == "meta" for w in weights.values()):
        return seeded_initializer(seed)

    def init(name: str, ids: np.ndarray, dim: int) -> torch.Tensor:  # noqa: ARG001
        w = weights[name].detach()
        return w.index_select(0, torch.as_tensor(ids, device=w.device)).to(torch.float32)

    return init
