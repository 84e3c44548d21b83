"""A torch module that executes a FlexShard plan on torch.distributed.

Every rank holds all hot rows of every table, its share of its group's warm rows and its share of the
cluster's cold rows (plus their optimizer state, placed like the rows). A forward pass:

1. checks its input, optionally deduplicates each table's ids on this rank (``torch.unique``),
   gathers hot rows locally and sorts the remote (warm and cold) lookups by owner rank;
2. exchanges, in one ``all_to_all_single`` on the global group before any data collective, every
   rank's error code (4 int64s to every rank, as an all-gather would) and the split sizes (one int64
   per table per tier exchange: warm to the ranks of this group, cold to every rank), so bad input
   on one rank raises ``ValueError`` on every rank;
3. sends the slots of warm lookups to their owner in the group and of cold lookups to their owner in
   the cluster (one ``all_to_all_single`` on the global group, all tables and both tiers together;
   a warm block goes only to ranks of this group), then gets the embeddings back the same way;
4. puts the rows back in input order.

Backward (through a ``torch.autograd.Function``) sends the output gradients back along the same
routes (one ``all_to_all_single``) and sums them per row at the owner. ``step()`` then synchronises
replicas (hot gradients all-reduced over all ranks, warm shard gradients over the replica group) and
applies row-wise SGD or row-wise Adagrad to the rows that received gradient.

Gradient semantics: the gradient a row receives is the sum over all ranks of the gradient of that
rank's loss (as if the global loss were the sum of the per-rank losses; divide the loss by the world
size yourself for a mean). Every copy of a replicated row gets the same summed gradient and the same
update, so copies stay bitwise equal.

Traffic (bytes, per rank, per iteration) is kept in an array ``[2 link classes, 4 components,
2 directions]`` in the convention of ``solvers.cost_model`` (``LINK_CLASSES``, ``COMPONENTS``,
send/recv): lookups are counted per peer from the realised split sizes (self excluded; a peer in the
same group is intra-group), split sizes as one int64 per table per peer per tier exchange, vectors as
``dim * 4`` bytes (float32 on the wire). Sync bytes are not measured (they depend on the
collective's algorithm): they are the cost model's hierarchical / ring all-reduce bytes of the
realised payload (touched rows x vector bytes + one mask byte per replicated row for sparse sync,
every row for dense sync).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from flexshard.plan_file import PlanFile
from flexshard.runtime.groups import ProcessGroups, make_process_groups
from flexshard.runtime.routing import (
    COLD,
    HOT,
    LAYOUTS,
    WARM,
    CompactTableRouting,
    TableRouting,
    build_compact_routing,
    build_routing,
)
from solvers.types import COMPONENTS, INDEX_BYTES, LINK_CLASSES, MASK_BYTES_PER_ROW

INTRA, INTER = 0, 1
IDS, FWD, BWD, SYNC = range(4)
SEND, RECV = 0, 1
WIRE_ELEMENT_BYTES = 4  # float32 embeddings and gradients on the wire
OPTIMIZERS = ("sgd", "adagrad")

# error codes agreed before any data collective
_E_TABLES, _E_TYPE, _E_EMPTY, _E_NEG_LEN, _E_LEN_SUM, _E_RANGE = range(1, 7)

Initializer = Callable[[str, np.ndarray, int], torch.Tensor]  # (table, row ids int64[n], dim) -> [n, dim]
_INIT_CHUNK_VALUES = 1 << 22  # values per chunk of the seeded initializer: 32 MiB of uint64 scratch


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array, in place (wrapping arithmetic)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def seeded_initializer(seed: int, scale: float = 0.1) -> Initializer:
    """Row initializer: element ``(id, j)`` of table ``name`` is ``U(-scale, scale)`` from a counter-based
    hash of ``(seed, name, id * dim + j)``. Any process asking for any rows gets the same values, so
    each rank builds only the rows it holds (and a test's reference the whole table) with no full
    table anywhere. Vectorised in chunks of ``_INIT_CHUNK_VALUES`` values."""

    def init(name: str, ids: np.ndarray, dim: int) -> torch.Tensor:
        key = np.uint64(
            int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little")
        )
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.size, dim), dtype=np.float32)
        cols = np.arange(dim, dtype=np.uint64)
        step = max(1, _INIT_CHUNK_VALUES // dim)
        for start in range(0, ids.size, step):  # one pass per chunk of rows
            x = ids[start : start + step].astype(np.uint64)[:, None] * np.uint64(dim) + cols
            x *= np.uint64(0x9E3779B97F4A7C15)
            x ^= key
            u = (_mix64(x) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1)
            out[start : start + step] = (u * 2 - 1) * scale
        return torch.from_numpy(out)

    return init


def to_padded(jagged: torch.Tensor, lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """[batch, max_len, dim] view of jagged rows ``[sum(lengths), dim]`` (zeros past each sequence;
    differentiable). Sequences longer than ``max_len`` are cut."""
    lengths = lengths.to(device=jagged.device, dtype=torch.int64)
    batch = lengths.numel()
    longest = int(lengths.max()) if batch else 0
    width = longest if max_len is None else int(max_len)
    seg = torch.repeat_interleave(torch.arange(batch, device=jagged.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(jagged.shape[0], device=jagged.device) - starts[seg]
    keep = pos < width
    out = jagged.new_zeros(batch, width, jagged.shape[1])
    return out.index_put((seg[keep], pos[keep]), jagged[keep])


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, module, features):  # noqa: ARG004
        outs, state = module._forward_impl(features)
        ctx.module, ctx.state = module, state
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.module._backward_impl(ctx.state, grads)
        ctx.state = None
        return None, None, None


def features_from_kjt(kjt) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-key ``(values, lengths)`` of a TorchRec KeyedJaggedTensor (duck-typed: ``keys()``,
    ``values()``, ``lengths()``, ``length_per_key()``, ``stride()``), without importing torchrec."""
    for attr in ("keys", "values", "lengths", "length_per_key", "stride"):
        if not callable(getattr(kjt, attr, None)):
            raise ValueError(
                "features: expected a dict of (values, lengths) or a KeyedJaggedTensor, "
                f"got {type(kjt).__name__}"
            )
    keys, stride = list(kjt.keys()), int(kjt.stride())
    values = torch.split(kjt.values(), [int(x) for x in kjt.length_per_key()])
    lengths = kjt.lengths().reshape(len(keys), stride) if keys else kjt.lengths()
    return {k: (values[i], lengths[i]) for i, k in enumerate(keys)}


class ShardedSequenceEmbedding(torch.nn.Module):
    """Sequence embedding tables sharded by a plan (see the module docstring).

    ``tables``: ``(name, num_rows, dim)`` in the plan's table order. ``orders``: per table a hotness
    order (touched ids hottest first, completed by :func:`complete_order`); missing tables use the
    identity. ``init``: a row initializer ``(name, ids int64[n], dim) -> float32[n, dim]`` that gives
    the same row for the same id on every rank, or a seed for :func:`seeded_initializer`. Each rank
    initialises only the rows it holds. ``layout``: ``"exact"`` (per-row routing arrays, cold rows
    dealt in hotness order as the cost model prices them) or ``"compact"`` (only replicated rows
    listed, cold rows dealt by id; for tables too large for 9 bytes per row on every rank), see
    :mod:`flexshard.runtime.routing`.
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
        dedup: bool | None = None,
        sync: str | None = None,
        period: int | None = None,
        device: torch.device | str | None = None,
        layout: str = "exact",
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("ShardedSequenceEmbedding: torch.distributed is not initialised")
        if device is None:
            if dist.get_backend() == "nccl":  # LOCAL_RANK (torchrun) or rank modulo the visible GPUs
                local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
                device = torch.device("cuda", local)
                torch.cuda.set_device(device)
            else:
                device = torch.device("cpu")
        self.device = torch.device(device)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.optimizer, self.lr, self.eps = optimizer, float(lr), float(eps)
        self.dedup = plan_file.plan.dedup if dedup is None else bool(dedup)
        self.sync = plan_file.plan.sync if sync is None else sync
        self.table_names = [str(t[0]) for t in tables]
        self.dims = [int(t[2]) for t in tables]
        self.layout = layout
        self._agree(self._check_setup(plan_file, tables, orders), "setup")

        self.pg: ProcessGroups = make_process_groups(plan_file.groups)
        build = build_compact_routing if layout == "compact" else build_routing
        self.routing: list[TableRouting | CompactTableRouting] = [
            build(tp, plan_file.groups, (orders or {}).get(name), period or plan_file.owner_pattern_period)
            for tp, name in zip(plan_file.plan.tables, self.table_names, strict=True)
        ]
        init_fn = seeded_initializer(init) if isinstance(init, int) else init
        self.uses_warm = any(r.warm_rows > 0 for r in self.routing)
        self.uses_cold = any(r.cold_rows > 0 for r in self.routing)
        dev = self.device
        self._ids: dict[tuple[int, int], np.ndarray] = {}
        self.weights: dict[tuple[int, int], torch.Tensor] = {}
        self.opt_state: dict[tuple[int, int], torch.Tensor] = {}
        pos, rank = self.pg.position, self.rank
        for t, (name, r) in enumerate(zip(self.table_names, self.routing, strict=True)):
            for tier, owner in ((HOT, -1), (WARM, pos), (COLD, rank)):
                ids = r.ids_of(tier, owner)
                self._ids[(t, tier)] = ids
                w = init_fn(name, ids, self.dims[t])
                if tuple(w.shape) != (ids.size, self.dims[t]):
                    raise ValueError(
                        f"table {name!r}: initializer returned shape {tuple(w.shape)} for {ids.size} rows, "
                        f"expected {(ids.size, self.dims[t])}"
                    )
                w = w.to(device=dev, dtype=torch.float32).contiguous()
                self.weights[(t, tier)] = w
                self.opt_state[(t, tier)] = torch.zeros(w.shape[0], device=dev)
        # warm owner (a group position) -> its global rank; tier exchanges, and which ranks each reaches
        self._warm_rank = torch.as_tensor(
            list(plan_file.groups[self.pg.group]), dtype=torch.int64, device=dev
        )
        self._tiers = ([WARM] if self.uses_warm else []) + ([COLD] if self.uses_cold else [])
        in_group = self.pg.group_of_rank == self.pg.group
        self._active = (
            np.stack(
                [in_group if tier == WARM else np.ones(self.world_size, dtype=bool) for tier in self._tiers]
                + [np.zeros(self.world_size, dtype=bool)]
            )
            .T[:, : len(self._tiers)]
            .copy()
        )
        self._dims_np = np.asarray(self.dims, dtype=np.int64)
        self._anchor = torch.zeros((), requires_grad=True)
        self.traffic = np.zeros((2, 4, 2))
        self.traffic_total = np.zeros((2, 4, 2))
        self.zero_grad()

    # --- setup and input checks ------------------------------------------------------------------

    def _check_setup(self, plan_file: PlanFile, tables, orders) -> str:
        if plan_file.world_size != self.world_size:
            return f"plan is for world size {plan_file.world_size}, this job has {self.world_size} ranks"
        flat = sorted(r for g in plan_file.groups for r in g)
        if flat != list(range(self.world_size)):
            return f"plan groups {plan_file.groups} do not partition ranks 0..{self.world_size - 1}"
        names = [tp.name for tp in plan_file.plan.tables]
        if names != self.table_names:
            return f"plan tables {names} differ from the model's tables {self.table_names}"
        for tp, (name, num_rows, dim) in zip(plan_file.plan.tables, tables, strict=True):
            rows = tp.hot_rows + tp.warm_rows + tp.cold_rows
            if rows != int(num_rows):
                return f"table {name!r}: plan covers {rows} rows, the model has num_rows={num_rows}"
            if int(dim) <= 0:
                return f"table {name!r}: dim must be positive, got {dim}"
            if tp.warm_rows > 0 and len({len(g) for g in plan_file.groups}) != 1:
                return f"table {name!r}: warm rows need groups of equal size, got {plan_file.groups}"
        if self.optimizer not in OPTIMIZERS:
            return f"optimizer: must be one of {OPTIMIZERS}, got {self.optimizer!r}"
        if self.layout not in LAYOUTS:
            return f"layout: must be one of {LAYOUTS}, got {self.layout!r}"
        if self.sync not in ("sparse", "dense"):
            return f"sync: must be 'sparse' or 'dense', got {self.sync!r}"
        unknown = [name for name in (orders or {}) if name not in self.table_names]
        if unknown:
            return f"orders: unknown table {unknown[0]!r}"
        return ""

    def _agree(self, message: str, what: str) -> None:
        """Raise on every rank when any rank's ``message`` is non-empty (one all_gather of a flag)."""
        flag = torch.tensor([1 if message else 0], dtype=torch.int64, device=self.device)
        flags = [torch.zeros_like(flag) for _ in range(self.world_size)]
        dist.all_gather(flags, flag)
        bad = [r for r, f in enumerate(flags) if int(f.item())]
        if message:
            raise ValueError(f"rank {self.rank}: {message}")
        if bad:
            raise ValueError(f"{what} failed on rank(s) {bad} (see their error)")

    def _check_features(self, features) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        err = torch.zeros(4, dtype=torch.int64)  # code, table, value, extra
        parsed = []
        names = set(features) if isinstance(features, dict) else set()
        if names != set(self.table_names):
            missing = [n for n in self.table_names if n not in names]
            err[:] = torch.tensor([_E_TABLES, self.table_names.index(missing[0]) if missing else -1, 0, 0])
            return parsed, err
        for t, name in enumerate(self.table_names):
            entry = features[name]
            try:
                values, lengths = entry
                values = torch.as_tensor(values)
                lengths = torch.as_tensor(lengths)
            except (TypeError, ValueError):
                err[:] = torch.tensor([_E_TYPE, t, 0, 0])
                return parsed, err
            if (
                values.dim() != 1
                or lengths.dim() != 1
                or values.dtype.is_floating_point
                or lengths.dtype.is_floating_point
            ):
                err[:] = torch.tensor([_E_TYPE, t, 0, 0])
                return parsed, err
            values = values.to(device=self.device, dtype=torch.int64)
            lengths = lengths.to(device=self.device, dtype=torch.int64)
            if lengths.numel() == 0:
                err[:] = torch.tensor([_E_EMPTY, t, 0, 0])
                return parsed, err
            if bool((lengths < 0).any()):
                err[:] = torch.tensor([_E_NEG_LEN, t, int(lengths.min()), 0])
                return parsed, err
            total = int(lengths.sum())
            if total != values.numel():
                err[:] = torch.tensor([_E_LEN_SUM, t, total, values.numel()])
                return parsed, err
            if values.numel():
                bad = (values < 0) | (values >= self.routing[t].num_rows)
                if bool(bad.any()):
                    err[:] = torch.tensor([_E_RANGE, t, int(values[bad][0]), 0])
                    return parsed, err
            parsed.append((values, lengths))
        return parsed, err

    def _raise_input_error(self, gathered: list[torch.Tensor]) -> None:
        for r, e in enumerate(gathered):
            code, t, value, extra = (int(x) for x in e.tolist())
            if not code:
                continue
            name = self.table_names[t] if 0 <= t < len(self.table_names) else None
            if code == _E_TABLES:
                what = f"features must have exactly the tables {self.table_names}" + (
                    f"; table {name!r} is missing" if name else "; got extra or unknown tables"
                )
            elif code == _E_TYPE:
                what = f"table {name!r}: values and lengths must be 1-D integer tensors"
            elif code == _E_EMPTY:
                what = f"table {name!r}: empty batch (lengths has no entries)"
            elif code == _E_NEG_LEN:
                what = f"table {name!r}: negative length {value}"
            elif code == _E_LEN_SUM:
                what = f"table {name!r}: lengths sum to {value} but there are {extra} values"
            else:
                num_rows = self.routing[t].num_rows
                what = f"table {name!r}: id {value} out of range [0, {num_rows})"
            raise ValueError(f"bad input on rank {r}: {what}")

    # --- forward -----------------------------------------------------------------------------------

    def forward(self, features) -> dict[str, torch.Tensor]:
        """Jagged embeddings ``[sum(lengths), dim]`` per table, in input order. ``features``: per
        table ``(values, lengths)``, or a TorchRec KeyedJaggedTensor (keys = table names). Collective:
        every rank calls it (and, when training, backward) the same number of times."""
        if not isinstance(features, dict):
            features = features_from_kjt(features)
        parsed, err = self._check_features(features)
        prep = self._prepare(parsed) if int(err[0]) == 0 else None
        n_k = len(self._tiers)
        counts = (
            prep["counts"] if prep is not None else np.zeros((self.world_size, len(self.dims), n_k), np.int64)
        )
        recv_counts, gathered = self._exchange_meta(err, counts)
        if any(int(e[0]) for e in gathered):
            self._raise_input_error(gathered)
        self.traffic = np.zeros((2, 4, 2))
        outs = _Lookup.apply(self._anchor, self, (prep, recv_counts))
        return dict(zip(self.table_names, outs, strict=True))

    def padded(self, jagged: torch.Tensor, lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        """[batch, max_len, dim] view of one table's jagged output (see :func:`to_padded`)."""
        return to_padded(jagged, lengths, max_len)

    def _prepare(self, parsed) -> dict:
        """Local part of a forward (no collective): dedup, hot rows, and the remote requests of every
        table sorted by (owner rank, tier); ``counts[p, t, k]``: requests of table ``t`` to rank ``p``
        for tier ``self._tiers[k]``."""
        n_k, world = len(self._tiers), self.world_size
        tables, uniq_rows, sorted_req, sorted_slots, cnt = [], [], [], [], []
        for t, (values, _lengths) in enumerate(parsed):
            if self.dedup:
                uniq, inv = torch.unique(values, return_inverse=True)
            else:
                uniq, inv = values, None
            tier, owner, slot = self.routing[t].lookup(uniq)
            emb = torch.empty(uniq.numel(), self.dims[t], device=self.device)
            hot_idx = torch.nonzero(tier == HOT).flatten()
            hot_slot = slot.index_select(0, hot_idx)
            emb.index_copy_(0, hot_idx, self.weights[(t, HOT)].index_select(0, hot_slot))
            if n_k:
                idx_parts, key_parts, slot_parts = [], [], []
                for k, tr in enumerate(self._tiers):
                    sel = torch.nonzero(tier == tr).flatten()
                    dest = owner.index_select(0, sel)
                    if tr == WARM:
                        dest = self._warm_rank.index_select(0, dest)
                    idx_parts.append(sel)
                    key_parts.append(dest * n_k + k)
                    slot_parts.append(slot.index_select(0, sel))
                key = torch.cat(key_parts)
                order = torch.argsort(key, stable=True)
                sorted_req.append(torch.cat(idx_parts).index_select(0, order))
                sorted_slots.append(torch.cat(slot_parts).index_select(0, order))
                cnt.append(torch.bincount(key, minlength=world * n_k))
            uniq_rows.append(emb)
            tables.append({"inv": inv, "n_uniq": uniq.numel(), "hot": (hot_idx, hot_slot)})
        if n_k:
            counts = torch.stack(cnt).cpu().numpy().reshape(len(parsed), world, n_k).transpose(1, 0, 2)
            counts = np.ascontiguousarray(counts, dtype=np.int64)
        else:
            counts = np.zeros((world, len(parsed), 0), np.int64)
        return {
            "tables": tables,
            "uniq_rows": uniq_rows,
            "sorted_req": sorted_req,
            "sorted_slots": sorted_slots,
            "counts": counts,
        }

    def _exchange_meta(self, err: torch.Tensor, counts: np.ndarray) -> tuple[np.ndarray, list[torch.Tensor]]:
        """One all-to-all on the global group carrying every rank's error code (4 int64s to every
        rank, as an all-gather would) and its split sizes (one int64 per table per tier exchange, to
        the ranks of that exchange: the group for warm, everyone for cold). Returns the received
        counts ``[p, t, k]`` and every rank's error code."""
        world, n_t, _n_k = counts.shape
        active = self._active
        err_np = err.cpu().numpy().astype(np.int64)
        sizes = [4 + n_t * int(active[p].sum()) for p in range(world)]
        send = np.concatenate(
            [np.concatenate([err_np, counts[p][:, active[p]].reshape(-1)]) for p in range(world)]
        )
        send_t = torch.from_numpy(send).to(self.device)
        recv_t = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(recv_t, send_t, sizes, sizes)
        recv = recv_t.cpu().numpy()
        recv_counts = np.zeros_like(counts)
        gathered, off = [], 0
        for p in range(world):
            gathered.append(torch.from_numpy(recv[off : off + 4].copy()))
            m = sizes[p] - 4
            recv_counts[p][:, active[p]] = recv[off + 4 : off + 4 + m].reshape(n_t, -1)
            off += sizes[p]
        return recv_counts, gathered

    def _forward_impl(self, features):
        prep, rc = features
        state = {"tables": prep["tables"]}
        uniq_rows = prep["uniq_rows"]
        if self._tiers:
            state["ex"] = self._exchange(prep, rc, uniq_rows)
        outs = []
        for t, emb in enumerate(uniq_rows):
            inv = state["tables"][t]["inv"]
            outs.append(emb.index_select(0, inv) if inv is not None else emb)
        return outs, state

    def _link(self, peer: int) -> int:
        return INTRA if self.pg.group_of_rank[peer] == self.pg.group else INTER

    def _exchange(self, prep, rc, uniq_rows) -> dict:
        """Warm and cold lookups of all tables together on the global group: slots, then embeddings
        (a warm block goes only to ranks of this group). Blocks to / from each rank are ordered by
        table, then tier."""
        c = prep["counts"]
        world, n_t, n_k = c.shape
        dev, dims, tiers = self.device, self._dims_np, self._tiers
        slot_blocks = [s.split(c[:, t, :].reshape(-1).tolist()) for t, s in enumerate(prep["sorted_slots"])]
        send_slots = torch.cat(
            [slot_blocks[t][p * n_k + k] for p in range(world) for t in range(n_t) for k in range(n_k)]
        )
        recv_slots = torch.empty(int(rc.sum()), dtype=torch.int64, device=dev)
        dist.all_to_all_single(
            recv_slots, send_slots, rc.sum(axis=(1, 2)).tolist(), c.sum(axis=(1, 2)).tolist()
        )
        # owner side: per (table, tier) the slots asked by every rank, in rank order
        blocks = recv_slots.split(rc.reshape(-1).tolist())
        owner_slots, row_blocks = {}, {}
        for t in range(n_t):
            for k in range(n_k):
                sl = torch.cat([blocks[(p * n_t + t) * n_k + k] for p in range(world)])
                owner_slots[(t, k)] = sl
                rows = self.weights[(t, tiers[k])].index_select(0, sl)
                row_blocks[(t, k)] = rows.split(rc[:, t, k].tolist())
        send_f = torch.cat(
            [row_blocks[(t, k)][p].reshape(-1) for p in range(world) for t in range(n_t) for k in range(n_k)]
        )
        owner_floats = (rc * dims[None, :, None]).sum(axis=(1, 2))  # floats sent to each requester
        req_floats = (c * dims[None, :, None]).sum(axis=(1, 2))  # floats received from each owner
        recv_f = torch.empty(int(req_floats.sum()), device=dev)
        dist.all_to_all_single(recv_f, send_f, req_floats.tolist(), owner_floats.tolist())
        fblocks = recv_f.split((c * dims[None, :, None]).reshape(-1).tolist())
        for t in range(n_t):
            rows = torch.cat(
                [
                    fblocks[(p * n_t + t) * n_k + k].view(-1, self.dims[t])
                    for p in range(world)
                    for k in range(n_k)
                ]
            )
            uniq_rows[t].index_copy_(0, prep["sorted_req"][t], rows)
        # traffic, per peer and tier exchange (self excluded; warm: peers of this group only)
        split = n_t * INDEX_BYTES
        for k in range(n_k):
            for p in range(world):
                if p == self.rank or not self._active[p, k]:
                    continue
                li = self._link(p)
                self.traffic[li, IDS, SEND] += c[p, :, k].sum() * INDEX_BYTES + split
                self.traffic[li, IDS, RECV] += rc[p, :, k].sum() * INDEX_BYTES + split
                self.traffic[li, FWD, SEND] += (rc[p, :, k] * dims).sum() * WIRE_ELEMENT_BYTES
                self.traffic[li, FWD, RECV] += (c[p, :, k] * dims).sum() * WIRE_ELEMENT_BYTES
        return {
            "counts": c,
            "recv_counts": rc,
            "sorted_req": prep["sorted_req"],
            "owner_slots": owner_slots,
            "owner_floats": owner_floats,
            "req_floats": req_floats,
        }

    # --- backward ----------------------------------------------------------------------------------

    def _backward_impl(self, state, grads) -> None:
        uniq_grads = []
        for t, g in enumerate(grads):
            st = state["tables"][t]
            g = g.to(device=self.device, dtype=torch.float32)
            if st["inv"] is not None:
                gu = torch.zeros(st["n_uniq"], self.dims[t], device=self.device)
                gu.index_add_(0, st["inv"], g)
            else:
                gu = g
            hot_idx, hot_slot = st["hot"]
            self.grads[(t, HOT)].index_add_(0, hot_slot, gu.index_select(0, hot_idx))
            self.touched[(t, HOT)].index_fill_(0, hot_slot, 1)
            uniq_grads.append(gu)
        if "ex" in state:
            self._exchange_grads(state["ex"], uniq_grads)

    def _exchange_grads(self, ex, uniq_grads) -> None:
        c, rc = ex["counts"], ex["recv_counts"]
        world, n_t, n_k = c.shape
        dims, tiers = self._dims_np, self._tiers
        gblocks = [
            uniq_grads[t].index_select(0, ex["sorted_req"][t]).split(c[:, t, :].reshape(-1).tolist())
            for t in range(n_t)
        ]
        send_f = torch.cat(
            [
                gblocks[t][p * n_k + k].reshape(-1)
                for p in range(world)
                for t in range(n_t)
                for k in range(n_k)
            ]
        )
        recv_f = torch.empty(int(ex["owner_floats"].sum()), device=self.device)
        dist.all_to_all_single(recv_f, send_f, ex["owner_floats"].tolist(), ex["req_floats"].tolist())
        got = recv_f.split((rc * dims[None, :, None]).reshape(-1).tolist())
        for t in range(n_t):
            for k in range(n_k):
                slots = ex["owner_slots"][(t, k)]
                if slots.numel():
                    g = torch.cat([got[(p * n_t + t) * n_k + k].view(-1, self.dims[t]) for p in range(world)])
                    self.grads[(t, tiers[k])].index_add_(0, slots, g)
                    self.touched[(t, tiers[k])].index_fill_(0, slots, 1)
        for k in range(n_k):
            for p in range(world):
                if p == self.rank or not self._active[p, k]:
                    continue
                li = self._link(p)
                self.traffic[li, BWD, SEND] += (c[p, :, k] * dims).sum() * WIRE_ELEMENT_BYTES
                self.traffic[li, BWD, RECV] += (rc[p, :, k] * dims).sum() * WIRE_ELEMENT_BYTES

    # --- replica sync and optimizer step ----------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002
        self.grads = {k: torch.zeros_like(w) for k, w in self.weights.items()}
        self.touched = {
            k: torch.zeros(w.shape[0], dtype=torch.uint8, device=self.device) for k, w in self.weights.items()
        }

    def _sync(self, tier: int, group, group_size: int) -> float:
        """All-reduce (sum) the gradients of ``tier``'s replicated rows over ``group``; returns the
        payload bytes of one replica in the cost model's convention."""
        keys = [(t, tier) for t in range(len(self.dims)) if self.weights[(t, tier)].shape[0] > 0]
        if not keys:
            return 0.0
        rows = sum(self.weights[k].shape[0] for k in keys)
        if self.sync == "dense":
            flat = torch.cat([self.grads[k].reshape(-1) for k in keys])
            if group_size > 1:
                dist.all_reduce(flat, group=group)
            for k, part in zip(keys, flat.split([self.grads[k].numel() for k in keys]), strict=True):
                self.grads[k].copy_(part.view_as(self.grads[k]))
            # no touched mask on the wire (as in the cost model): every replicated row is updated; a
            # row without gradient is left unchanged by SGD and by row-wise Adagrad (g = 0).
            for k in keys:
                self.touched[k].fill_(1)
            return float(sum(self.grads[k].numel() for k in keys) * WIRE_ELEMENT_BYTES)
        mask = torch.cat([self.touched[k] for k in keys])
        if group_size > 1:
            dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
        parts = mask.split([self.touched[k].numel() for k in keys])
        rows_of = []
        for k, part in zip(keys, parts, strict=True):
            self.touched[k].copy_(part)
            rows_of.append(torch.nonzero(part).flatten())
        flat = torch.cat(
            [self.grads[k].index_select(0, r).reshape(-1) for k, r in zip(keys, rows_of, strict=True)]
        )
        if group_size > 1:
            dist.all_reduce(flat, group=group)
        sizes = [r.numel() * self.dims[k[0]] for k, r in zip(keys, rows_of, strict=True)]
        for k, r, part in zip(keys, rows_of, flat.split(sizes), strict=True):
            self.grads[k].index_copy_(0, r, part.view(-1, self.dims[k[0]]))
        return float(flat.numel() * WIRE_ELEMENT_BYTES + rows * MASK_BYTES_PER_ROW)

    def step(self) -> None:
        """Synchronise replica gradients, apply the optimizer to rows that received gradient, zero the
        gradients. Collective."""
        g_size = len(self.pg.intra_ranks)
        n_groups = self.pg.num_groups
        hot_payload = self._sync(HOT, dist.group.WORLD, self.world_size)
        # hierarchical all-reduce bytes (cost model convention), each direction
        self.traffic[INTRA, SYNC, :] += 2.0 * (g_size - 1) / g_size * hot_payload
        self.traffic[INTER, SYNC, :] += 2.0 * (n_groups - 1) / n_groups * hot_payload / g_size
        if self.uses_warm:
            warm_payload = self._sync(WARM, self.pg.replica, len(self.pg.replica_ranks))
            self.traffic[INTER, SYNC, :] += 2.0 * (n_groups - 1) / n_groups * warm_payload
        for key, w in self.weights.items():
            rows = torch.nonzero(self.touched[key]).flatten()
            if rows.numel() == 0:
                continue
            g = self.grads[key].index_select(0, rows)
            if self.optimizer == "sgd":
                w.index_copy_(0, rows, w.index_select(0, rows) - self.lr * g)
            else:
                s = self.opt_state[key]
                s_rows = s.index_select(0, rows) + g.pow(2).mean(dim=1)
                s.index_copy_(0, rows, s_rows)
                w.index_copy_(
                    0, rows, w.index_select(0, rows) - self.lr * g / (s_rows.sqrt().unsqueeze(1) + self.eps)
                )
            # gradients are non-zero only on touched rows: clear just those
            self.grads[key].index_fill_(0, rows, 0.0)
        self.traffic_total += self.traffic
        for t in self.touched.values():
            t.zero_()

    # --- inspection ------------------------------------------------------------------------------

    def traffic_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        """This iteration's bytes as ``{link: {component: {"send": b, "recv": b}}}``."""
        return {
            link: {
                comp: {"send": float(self.traffic[li, ci, SEND]), "recv": float(self.traffic[li, ci, RECV])}
                for ci, comp in enumerate(COMPONENTS)
            }
            for li, link in enumerate(LINK_CLASSES)
        }

    def link_bytes(self, components: tuple[str, ...] = COMPONENTS) -> dict[str, float]:
        """max(send, recv) per link class summed over ``components`` (what the cost model reports)."""
        ci = [COMPONENTS.index(c) for c in components]
        per = self.traffic[:, ci, :].sum(axis=1).max(axis=1)
        return {link: float(per[li]) for li, link in enumerate(LINK_CLASSES)}

    def shard_rows(self) -> dict[tuple[str, str], tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """``{(table, tier): (ids, weights, optimizer state)}`` this rank holds, rows in slot order."""
        names = ("hot", "warm", "cold")
        return {
            (self.table_names[t], names[tier]): (
                self._ids[(t, tier)],
                w.detach().cpu(),
                self.opt_state[(t, tier)].cpu(),
            )
            for (t, tier), w in self.weights.items()
        }
