"""All-to-alls of per-table columns and the wire dtype of the vectors they carry (the exchange protocol's
and the sync's transport; also the sample placement's).

A *column* is one table's part of an exchange (e.g. one table's warm slots):
a tensor whose rows are sorted by the peer they go to, ``counts[p, c]`` rows for peer ``p``. One
all-to-all carries every column, ordered by (peer, column); the receiver gets each column back with its
rows in peer order. Peers are the ranks of a process group, in group-rank order (this rank included: its
own block is copied, and never counted as bytes).

Vectors (embeddings forward, gradients backward) travel as the plan's :class:`core.vocabulary.WireDtype`
(:func:`exchange_vectors`): cast from float32 just before the all-to-all, back to float32 just after it,
so rows, gradient sums and optimizer state stay float32. The block a rank sends itself is cast too: every
exchanged vector is rounded the same way wherever its owner is. fp16 has a narrow range (normal numbers
from 6.1e-5 to 65504), and embedding gradients are small: gradients are multiplied by a power of two
before the cast and divided by it after (exact in float32), as mixed-precision training scales its loss,
so that they keep fp16's full precision without overflowing. Each sender picks its own power of two from
its own largest gradient (:func:`gradient_exponent`) and sends the exponent as one element before each
peer's block; receivers divide each sender's rows by its power of two before summing in float32. No
collective is spent on the scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from core.arrays import exclusive_cumsum
from core.vocabulary import WireDtype
from flexshard.runtime.awaitable import Pending, all_to_all, ready
from flexshard.runtime.column_joins import join_columns, joins_columns
from flexshard.runtime.device_rules import gpu_paths
from flexshard.runtime.indexing import STAGED_INDEX_OPS, block_rows

TORCH_WIRE_DTYPES = {
    WireDtype.FP32: torch.float32,
    WireDtype.BF16: torch.bfloat16,
    WireDtype.FP16: torch.float16,
}


def count_per_peer(dest: torch.Tensor, peers: int) -> torch.Tensor:
    """int64[peers]: how many entries of ``dest`` (int64, each in ``[0, peers)``) name each peer; what
    ``torch.bincount(dest, minlength=peers)`` gives, without its read of the largest value back to the
    host (on CUDA a synchronisation per call)."""
    counts = torch.zeros(peers, dtype=torch.int64, device=dest.device)
    return counts.index_add_(0, dest, torch.ones_like(dest))


def exchange_columns_async(
    name: str,
    columns: list[torch.Tensor],
    counts: np.ndarray,
    recv_counts: np.ndarray,
    widths: np.ndarray,
    group=None,
    header: torch.Tensor | None = None,
) -> Pending[tuple[list[torch.Tensor], torch.Tensor | None]]:
    """Send ``counts[p, c]`` rows of ``columns[c]`` (rows of ``widths[c]`` elements, sorted by peer) to
    every peer ``p`` of ``group``, in one all-to-all issued as step stage ``name`` (all columns of one
    dtype; a group of one rank: a local copy, no collective). ``header``: elements put before every
    peer's block (the sender's gradient exponent). The result: per column the ``recv_counts[:, c]`` rows
    received, in peer order, shaped like the column's rows (1-D ids or slots, ``[rows, dim]`` vectors),
    and the headers received ``[peers, len(header)]`` (None without a header)."""
    peers, n_c = counts.shape
    hw = 0 if header is None else int(header.numel())
    if not n_c:
        return ready(([], None))
    widths = np.asarray(widths, dtype=np.int64)
    # columns with no rows to or from any peer take no part (no split, no copy); they come back empty
    used = np.flatnonzero(counts.any(axis=0) | recv_counts.any(axis=0)).tolist()
    counts, recv_counts, widths = counts[:, used], recv_counts[:, used], widths[used]
    recv_sizes = recv_counts * widths[None, :]
    per_peer_recv = (recv_sizes.sum(axis=1) + hw).tolist()
    if len(used) > 1 and not hw and peers > 1 and all(columns[c].dim() == 1 for c in used):
        return _exchange_flat_columns(name, columns, used, counts, recv_counts, group)
    if len(used) == 1 and not hw and peers > 1:  # one column: already in peer order
        send = columns[used[0]].reshape(-1)
    else:
        # each column flat, cut into its peers' blocks; the blocks interleaved (peer, column)
        blocks = [
            columns[c].reshape(-1).split((counts[:, i] * widths[i]).tolist()) for i, c in enumerate(used)
        ]
        lead = [header] if header is not None else []
        by_peer = zip(*blocks, strict=True) if blocks else [()] * peers
        parts = [b for by_column in by_peer for b in (*lead, *by_column)]
        send = torch.cat(parts) if parts else columns[0].new_empty(0)
    if peers == 1:
        recv, works = send, []
    else:
        recv = send.new_empty(int(sum(per_peer_recv)))
        send_sizes = (counts * widths[None, :]).sum(axis=1) + hw
        works = [all_to_all(name, recv, send, per_peer_recv, send_sizes.tolist(), group)]

    def finish() -> tuple[list[torch.Tensor], torch.Tensor | None]:
        out = list(columns)  # a column outside ``used`` has no rows: it is its own (empty) result
        if len(used) == 1 and not hw and peers > 1:
            out[used[0]] = recv.view(-1, *columns[used[0]].shape[1:])
            return out, None
        # per peer: its header (a column of width hw, none without a header), then its blocks
        sizes = np.concatenate([np.full((peers, 1 if hw else 0), hw), recv_sizes], axis=1)
        got = recv.split(sizes.reshape(-1).tolist())
        stride = sizes.shape[1]
        headers = torch.stack(got[::stride]) if hw else None
        first = stride - len(used)
        for i, c in enumerate(used):
            out[c] = torch.cat(got[first + i :: stride]).view(-1, *columns[c].shape[1:])
        return out, headers

    return Pending(works, finish)


def _exchange_flat_columns(
    name: str,
    columns: list[torch.Tensor],
    used: list[int],
    counts: np.ndarray,
    recv_counts: np.ndarray,
    group,
) -> Pending[tuple[list[torch.Tensor], None]]:
    """:func:`exchange_columns_async` of several 1-D columns (``used``; ``counts[p, i]``,
    ``recv_counts[p, i]`` elements of column ``used[i]`` to and from peer p): the columns joined, put in
    (peer, column) order by one gather, and the receive buffer put back in (column, peer) order by
    another, each column a view of it: a fixed number of ops, none per peer or column."""
    device = columns[used[0]].device
    to_send, received = transposed_blocks([counts.T, recv_counts], device)
    send = torch.cat([columns[c] for c in used]).index_select(0, to_send)
    recv = send.new_empty(int(recv_counts.sum()))
    sizes = [recv_counts.sum(axis=1).tolist(), counts.sum(axis=1).tolist()]
    work = all_to_all(name, recv, send, *sizes, group)

    def finish() -> tuple[list[torch.Tensor], None]:
        by_column = recv.index_select(0, received)
        out = list(columns)  # a column outside ``used`` has no rows: it is its own (empty) result
        for c, got in zip(used, by_column.split(recv_counts.sum(axis=0).tolist()), strict=True):
            out[c] = got
        return out, None

    return Pending([work], finish)


def transposed_blocks(layouts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Per layout ``sizes`` (a buffer of blocks in (a, b) order, ``sizes[a, b]`` elements each), int64:
    the position of each of its elements in (b, a) block order (``buffer.index_select(0, it)`` is the
    buffer with its blocks transposed). Every layout's in one host copy and a fixed number of ops."""
    lengths, firsts, totals = [], [], []
    for sizes in layouts:
        sizes = np.asarray(sizes, dtype=np.int64)
        start = exclusive_cumsum(sizes)
        lengths.append(sizes.T.reshape(-1))
        firsts.append(start.T.reshape(-1))
        totals.append(int(sizes.sum()))
    # blocks of every layout in one index: each block's shift from its place there holds within its layout
    return list(block_rows(np.concatenate(lengths), np.concatenate(firsts), device).split(totals))


def exchange_columns(
    columns: list[torch.Tensor],
    counts: np.ndarray,
    recv_counts: np.ndarray,
    widths: np.ndarray,
    group=None,
) -> list[torch.Tensor]:
    """:func:`exchange_columns_async`, waited for (outside a step)."""
    return exchange_columns_async("", columns, counts, recv_counts, widths, group).wait()[0]


FP16_TARGET = 2.0**14  # a sender's largest scaled gradient stays below this (fp16's largest finite: 65504)
EXPONENT_RANGE = 100  # |exponent| of a gradient scale (exact as an fp16 integer)


def gradient_exponent(columns: list[torch.Tensor]) -> int:
    """The exponent ``e`` of the power of two a sender multiplies its gradients by on an fp16 wire: its
    own largest ``|g|`` over ``columns`` times ``2^e`` just below ``FP16_TARGET`` (0 when it sends only
    zeros). No collective: the exponent travels with the message (:func:`exchange_vectors`)."""
    top = max((float(c.abs().max()) for c in columns if c.numel()), default=0.0)
    if not 0.0 < top < float("inf"):
        return 0
    e = int(np.floor(np.log2(FP16_TARGET / top)))
    return int(np.clip(e, -EXPONENT_RANGE, EXPONENT_RANGE))


def on_wire(x: torch.Tensor, wire_dtype: WireDtype, exponent: int = 0) -> torch.Tensor:
    """Float32 ``x`` as sent: times ``2^exponent``, cast to ``wire_dtype``."""
    scaled = x * 2.0**exponent if exponent else x
    return scaled.to(TORCH_WIRE_DTYPES[wire_dtype])


def off_wire(x: torch.Tensor, exponent: int | torch.Tensor = 0) -> torch.Tensor:
    """Wire vectors back to float32, divided by ``2^exponent`` (a scalar, or one per row)."""
    out = x.float()
    if isinstance(exponent, torch.Tensor):
        return out * torch.pow(2.0, -exponent.float()).reshape(-1, *([1] * (out.dim() - 1)))
    return out * 2.0**-exponent if exponent else out


def round_like_wire(x: torch.Tensor, wire_dtype: WireDtype, scaled: bool = False) -> torch.Tensor:
    """``x`` rounded as it would be by the wire (a block a rank keeps for itself, rounded like the rest)."""
    if wire_dtype is WireDtype.FP32:
        return x
    e = gradient_exponent([x]) if scaled and wire_dtype is WireDtype.FP16 else 0
    return off_wire(on_wire(x, wire_dtype, e), e)


def exchange_vectors(
    name: str,
    columns: list[torch.Tensor],
    counts: np.ndarray,
    recv_counts: np.ndarray,
    widths: np.ndarray,
    wire_dtype: WireDtype,
    group=None,
    scaled: bool = False,
) -> Pending[list[torch.Tensor]]:
    """:func:`exchange_columns_async` of float32 vectors sent as ``wire_dtype``; returns float32 columns.
    ``scaled`` (gradients on an fp16 wire): the sender multiplies by ``2^e`` of its own
    :func:`gradient_exponent` and sends ``e`` as one extra element before each peer's block; the
    receiver divides each sender's rows by that sender's ``2^e`` (exact: powers of two)."""
    if TORCH_WIRE_DTYPES[wire_dtype] is torch.float32:
        pending = exchange_columns_async(name, columns, counts, recv_counts, widths, group)
        return Pending([pending], lambda: pending.wait()[0])
    use_scale = scaled and wire_dtype is WireDtype.FP16
    e = gradient_exponent(columns) if use_scale else 0
    sent = [on_wire(col, wire_dtype, e) for col in columns]
    header = None
    if use_scale:
        device = columns[0].device if columns else None
        header = torch.full((1,), float(e), dtype=TORCH_WIRE_DTYPES[wire_dtype], device=device)
    pending = exchange_columns_async(name, sent, counts, recv_counts, widths, group, header)

    def finish() -> list[torch.Tensor]:
        got, headers = pending.wait()
        if headers is None:
            return [off_wire(col) for col in got]
        exps = headers[:, 0].float()
        return [
            off_wire(col, exps.repeat_interleave(torch.as_tensor(recv_counts[:, c], device=exps.device)))
            for c, col in enumerate(got)
        ]

    return Pending([pending], finish)


def exchange_gathered_async(
    name: str,
    sources: list[torch.Tensor],
    indices: list[torch.Tensor | None],
    counts: np.ndarray,
    recv_counts: np.ndarray,
    group=None,
    with_buffer: bool = False,
    joined_in: Sequence[int] | None = None,
    into: torch.Tensor | None = None,
) -> Pending[list[list[torch.Tensor]]]:
    """:func:`exchange_columns_async` of float32 rows (an fp32 wire) whose column ``c`` is
    ``sources[c].index_select(0, indices[c])`` (``sources[c]`` itself where ``indices[c]`` is None),
    gathered straight into the send buffer (no column, no concatenation), returned as per-peer views of
    the receive buffer (no concatenation either): per column a list over peers of
    ``[recv_counts[p, c], dim_c]`` rows. The same rows in the same order as
    :func:`exchange_columns_async` of the gathered columns; two copies of every row fewer.

    The block a rank sends itself never enters the collective: it is gathered once (a view of the
    source, not a copy, for a column without an index: read it, do not write it) and given back as
    its own view. ``with_buffer``: waits to ``(views, buffer, first)``, the flat float32 buffer every
    view lies in (the peers' blocks in (peer, column) order as received, then this rank's own, gathered
    there) and ``first[p, c]``, the element of the buffer where block ``(p, c)`` starts. ``joined_in`` (a
    peer order; not with ``with_buffer``): where :func:`~flexshard.runtime.column_joins.joins_columns`
    finds it fewer ops (a GPU), waits instead to one tensor per column, its peers' blocks in that order
    (:func:`~flexshard.runtime.column_joins.join_columns`; this rank's own gathered into the buffer's
    tail first). ``into`` (with ``with_buffer``): that flat float32 buffer, ``recv_counts``' rows in all,
    given (a view into a larger allocation) rather than allocated."""
    peers, n_c = counts.shape
    if not n_c:
        return ready(([], torch.zeros(0), np.zeros((peers, 0), np.int64)) if with_buffer else [])
    me = _group_rank(group, peers)
    dims = np.array([int(s.shape[1]) for s in sources], dtype=np.int64)
    wire_send = counts * dims[None, :]  # elements per (peer, column) through the collective
    wire_recv = recv_counts * dims[None, :]
    own_size = int(wire_recv[me].sum())
    wire_send[me], wire_recv[me] = 0, 0
    device = sources[0].device
    # one dim for every column: both buffers seen once as rows, so that no block needs a view of its own
    one_dim = bool((dims == dims[0]).all())
    join = joined_in is not None and not with_buffer and one_dim and joins_columns(device, recv_counts, me)
    tail_own = with_buffer or join  # this rank's own blocks gathered into the buffer's tail
    send = torch.empty(int(wire_send.sum()), dtype=torch.float32, device=device)
    received = int(wire_recv.sum())
    size = received + (own_size if tail_own else 0)
    if into is not None and not (with_buffer and into.dtype == torch.float32 and into.numel() == size):
        raise ValueError(f"into: {into.numel()} {into.dtype} elements given, {size} float32 wanted")
    buffer = torch.empty(size, dtype=torch.float32, device=device) if into is None else into
    send_rows = send.view(-1, int(dims[0])) if one_dim else send
    buffer_rows = buffer.view(-1, int(dims[0])) if one_dim else buffer
    start = exclusive_cumsum(counts, axis=0)  # each column's first row for each peer
    own: list[torch.Tensor] = [s[:0] for s in sources]
    first = exclusive_cumsum(wire_recv)
    send_first = exclusive_cumsum(wire_send)  # where block (p, c) starts in ``send``
    # one gather per column, then one into wire order, where a GPU issues fewer ops that way
    if one_dim and staged_gathers(device, counts, me, tail_own):
        tail = buffer_rows[received // int(dims[0]) :] if tail_own else None
        own = _gather_staged(sources, indices, counts, start, me, send_rows, tail, received, first)
    else:
        own_off = received
        for c in range(n_c):
            if not counts[:, c].any():
                continue
            d = int(dims[c])
            # the column's ids cut into its peers' blocks at once (one op, not one slice per block)
            ids = None if indices[c] is None else indices[c].split(counts[:, c].tolist())
            for p in range(peers):
                n, lo = int(counts[p, c]), int(start[p, c])
                if not n:
                    continue
                if p == me and not tail_own:
                    own[c] = sources[c][lo : lo + n] if ids is None else sources[c].index_select(0, ids[p])
                    continue
                at = own_off if p == me else int(send_first[p, c])
                if one_dim:
                    out = (buffer_rows if p == me else send_rows)[at // d : at // d + n]
                else:
                    out = (buffer if p == me else send)[at : at + n * d].view(n, -1)
                if ids is None:
                    out.copy_(sources[c][lo : lo + n])
                else:
                    torch.index_select(sources[c], 0, ids[p], out=out)
                if p == me:
                    own[c], first[p, c] = out, at
                    own_off += n * d
    works = []
    if peers > 1:
        per_peer_recv = wire_recv.sum(axis=1).tolist()
        recv = buffer[:received]
        works = [all_to_all(name, recv, send, per_peer_recv, wire_send.sum(axis=1).tolist(), group)]

    def finish() -> list[list[torch.Tensor]]:
        if join:  # one tensor per column, in two copies
            head = received // int(dims[0])
            return join_columns(buffer_rows[:head], buffer_rows[head:], recv_counts, me, joined_in)
        if one_dim:  # blocks of rows, cut from the rows at once
            rows = (wire_recv.reshape(-1) // int(dims[0])).tolist()  # received rows per block, none from me
            got = buffer_rows[: received // int(dims[0])].split(rows)
        else:
            got = [
                b.view(-1, int(dims[i % n_c]))
                for i, b in enumerate(buffer[:received].split(wire_recv.reshape(-1).tolist()))
            ]
        views = [[own[c] if p == me else got[p * n_c + c] for p in range(peers)] for c in range(n_c)]
        return (views, buffer, first) if with_buffer else views

    return Pending(works, finish)


def staged_gathers(device: torch.device, counts: np.ndarray, me: int, with_buffer: bool) -> bool:
    """Whether :func:`exchange_gathered_async` gathers a one-dim send buffer in two passes (one gather
    per column, then one into wire order: :func:`_gather_staged`) rather than one gather per (peer,
    column) block (``counts[p, c]`` rows to peer p of column c; ``me`` this rank). On a GPU, where an op
    costs tens of microseconds of host time and a second copy of the rows microseconds of memory
    bandwidth, where that is fewer ops: one per non-empty column and :data:`STAGED_INDEX_OPS` per
    wire-order index (the other peers' blocks; this rank's own too with ``with_buffer``) against one per
    non-empty block; then a stage's ops no longer grow with its peers. Not on the CPU, where the
    second copy costs more than the ops it saves (:func:`~flexshard.runtime.device_rules.gpu_paths`)."""
    if not gpu_paths(device):
        return False
    indexes = 1 + (with_buffer and bool(counts[me].any()))
    staged = int(np.count_nonzero(counts.any(axis=0))) + STAGED_INDEX_OPS * indexes
    return staged < int(np.count_nonzero(counts))


def _gather_staged(
    sources: list[torch.Tensor],
    indices: list[torch.Tensor | None],
    counts: np.ndarray,
    start: np.ndarray,
    me: int,
    send_rows: torch.Tensor,
    tail: torch.Tensor | None,
    received: int,
    first: np.ndarray,
) -> list[torch.Tensor]:
    """:func:`exchange_gathered_async`'s gather of one-dim columns in two passes: every column's rows
    for all its peers gathered at once into a staging buffer in (column, peer) order, then the other
    peers' blocks put into ``send_rows`` in (peer, column) order by one ``index_select``. This rank's
    own blocks: views of the staging buffer, or, with ``tail`` (the receive buffer's rows after the
    ``received`` elements), gathered there in column order and ``first[me, c]`` set to each one's
    element. The same rows in the same places as the per-block gather. Returns the own blocks."""
    peers, n_c = counts.shape
    dim = int(send_rows.shape[1])
    device = send_rows.device
    per_column = counts.sum(axis=0)
    column_start = exclusive_cumsum(per_column)
    stage = torch.empty(int(per_column.sum()), dim, dtype=torch.float32, device=device)
    for c in range(n_c):
        n, lo = int(per_column[c]), int(column_start[c])
        if not n:
            continue
        if indices[c] is None:  # its rows in peer order are the source's first rows
            stage[lo : lo + n].copy_(sources[c][:n])
        else:
            torch.index_select(sources[c], 0, indices[c], out=stage[lo : lo + n])
    at = column_start[None, :] + start  # [peer, column]: each block's first row in the staging buffer
    others = np.arange(peers) != me
    if send_rows.shape[0]:
        wire = block_rows(counts[others].reshape(-1), at[others].reshape(-1), device)
        torch.index_select(stage, 0, wire, out=send_rows)
    own_n = counts[me]
    if tail is None:
        return [stage[int(a) : int(a) + int(n)] for a, n in zip(at[me], own_n, strict=True)]
    if own_n.any():
        torch.index_select(stage, 0, block_rows(own_n, at[me], device), out=tail)
    tail_start = exclusive_cumsum(own_n)
    for c in np.flatnonzero(own_n):
        first[me, c] = received + int(tail_start[c]) * dim
    return [tail[int(a) : int(a) + int(n)] for a, n in zip(tail_start, own_n, strict=True)]


def _group_rank(group, peers: int) -> int:
    """This rank's place among the ``peers`` ranks of ``group`` (None: the default group)."""
    if peers == 1:
        return 0
    return int(dist.get_rank(group) if group is not None else dist.get_rank())


def joined_blocks(views: list[torch.Tensor]) -> torch.Tensor:
    """Per-peer blocks of rows as one tensor in peer order (no copy when at most one is not empty)."""
    full = [v for v in views if v.shape[0]]
    return full[0] if len(full) == 1 else torch.cat(views)


def rows_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)``; an empty view of ``x`` (no op) for an empty ``index``."""
    return x.index_select(0, index) if index.numel() else x[:0]


def copy_blocks(rows: torch.Tensor, index: torch.Tensor, views: list[torch.Tensor]) -> None:
    """``rows.index_copy_(0, index, torch.cat(views))`` without joining: one copy per peer's block."""
    _per_block(rows.index_copy_, index, views)


def add_blocks(total: torch.Tensor, index: torch.Tensor, got: torch.Tensor | list[torch.Tensor]) -> None:
    """``total.index_add_(0, index, joined_blocks(got))`` without joining: one add per peer's block, in peer
    order (each row's terms added in the same order, so the same float sums bit for bit)."""
    if isinstance(got, torch.Tensor):  # one block (e.g. a column's blocks joined): one add
        total.index_add_(0, index if index.shape[0] == got.shape[0] else index[: got.shape[0]], got)
        return
    _per_block(total.index_add_, index, got)


def _per_block(op: Callable[..., object], index: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    """``op(0, index[rows of block], block)`` for each non-empty block, ``index`` read in block order
    (cut into the blocks' parts at once)."""
    sizes = [int(block.shape[0]) for block in blocks]
    total = sum(sizes)
    parts = (index if total == index.shape[0] else index[:total]).split(sizes)
    for part, block, n in zip(parts, blocks, sizes, strict=True):
        if n:
            op(0, part, block)
