"""What the lookup exchanges share: all-to-alls of per-table columns, the split sizes sent before them,
and their bytes in :mod:`solvers.wire`'s terms.

A *column* is one table's part of an exchange (for the flat exchange, one table in one tier exchange):
a tensor whose rows are sorted by the peer they go to, ``counts[p, c]`` rows for peer ``p``. One
all-to-all carries every column, ordered by (peer, column); the receiver gets each column back with its
rows in peer order. Peers are the ranks of a process group, in group-rank order (this rank included: its
own block is copied, and never counted as bytes).

Vectors (embeddings forward, gradients backward) travel as the plan's :class:`core.vocabulary.WireDtype`
(:func:`exchange_vectors`): cast from float32 just before the all-to-all, back to float32 just after it,
so rows, gradient sums and optimizer state stay float32. The block a rank sends itself is cast too: every
exchanged vector is rounded the same way wherever its owner is. fp16 has a narrow range (normal numbers
from 6.1e-5 to 65504), and embedding gradients are small: gradients are multiplied by a power of two
before the cast and divided by it after (:func:`gradient_scale`, exact in float32), as mixed-precision
training scales its loss, so that they keep fp16's full precision without overflowing.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from core.traffic import Traffic
from core.vocabulary import Component, LinkClass, WireDtype
from solvers import wire

TORCH_WIRE_DTYPES = {
    WireDtype.FP32: torch.float32,
    WireDtype.BF16: torch.bfloat16,
    WireDtype.FP16: torch.float16,
}


def exchange_columns(
    columns: list[torch.Tensor],
    counts: np.ndarray,
    recv_counts: np.ndarray,
    widths: np.ndarray,
    group=None,
) -> list[torch.Tensor]:
    """Send ``counts[p, c]`` rows of ``columns[c]`` (rows of ``widths[c]`` elements, sorted by peer) to
    every peer ``p`` of ``group``, in one all-to-all (all columns of one dtype); returns per column the
    ``recv_counts[:, c]`` rows received, in peer order, shaped like the column's rows (1-D ids or slots,
    ``[rows, dim]`` vectors)."""
    peers, n_c = counts.shape
    if not n_c:
        return []
    widths = np.asarray(widths, dtype=np.int64)
    blocks = [col.split(counts[:, c].tolist()) for c, col in enumerate(columns)]
    send = torch.cat([blocks[c][p].reshape(-1) for p in range(peers) for c in range(n_c)])
    recv_sizes = recv_counts * widths[None, :]
    if peers == 1:
        recv = send
    else:
        recv = send.new_empty(int(recv_sizes.sum()))
        send_sizes = counts * widths[None, :]
        dist.all_to_all_single(
            recv, send, recv_sizes.sum(axis=1).tolist(), send_sizes.sum(axis=1).tolist(), group=group
        )
    got = recv.split(recv_sizes.reshape(-1).tolist())
    out = []
    for c, col in enumerate(columns):
        parts = torch.cat([got[p * n_c + c] for p in range(peers)])
        out.append(parts.view(-1, *col.shape[1:]))
    return out


def exchange_vectors(
    columns: list[torch.Tensor],
    counts: np.ndarray,
    recv_counts: np.ndarray,
    widths: np.ndarray,
    wire_dtype: WireDtype,
    group=None,
    scale: float = 1.0,
) -> list[torch.Tensor]:
    """:func:`exchange_columns` of float32 vectors sent as ``wire_dtype``, multiplied by ``scale`` (a power
    of two) on the wire; returns float32 columns."""
    on_wire = TORCH_WIRE_DTYPES[wire_dtype]
    if on_wire is torch.float32:
        return exchange_columns(columns, counts, recv_counts, widths, group)
    sent = [(col * scale if scale != 1.0 else col).to(on_wire) for col in columns]
    got = exchange_columns(sent, counts, recv_counts, widths, group)
    return [col.float() / scale if scale != 1.0 else col.float() for col in got]


FP16_TARGET = 2.0**14  # the largest scaled gradient sum stays below this (fp16's largest finite: 65504)


def gradient_scale(grads: list[torch.Tensor], wire_dtype: WireDtype, summands: int, device) -> float:
    """The power of two that gradients are multiplied by on an fp16 wire: the largest ``|g|`` over every
    rank (one all-reduce of one float, collective) times ``summands`` (the most gradients any sent sum
    adds up) scaled to just below ``FP16_TARGET``. 1 for float32 and bf16 (bf16 has float32's range)."""
    if wire_dtype is not WireDtype.FP16:
        return 1.0
    local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
    largest = torch.tensor([local], dtype=torch.float32, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    top = float(largest) * max(summands, 1)
    if not 0.0 < top < float("inf"):
        return 1.0
    return float(2.0 ** int(np.floor(np.log2(FP16_TARGET / top))))


def exchange_sizes(sizes: np.ndarray, device: torch.device, group=None) -> np.ndarray:
    """The split sizes before an exchange: ``sizes[p]`` (int64 per table) to every peer ``p`` of
    ``group``, in one all-to-all. Returns ``[p, ...]``: what each peer sent this rank."""
    peers = sizes.shape[0]
    if peers == 1:
        return sizes.copy()
    width = int(np.prod(sizes.shape[1:]))
    send = torch.from_numpy(np.ascontiguousarray(sizes.reshape(-1), dtype=np.int64)).to(device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, [width] * peers, [width] * peers, group=group)
    return recv.cpu().numpy().reshape(sizes.shape)


def add_lookup_bytes(
    out: Traffic,
    link: LinkClass,
    asked: np.ndarray,
    served: np.ndarray,
    vector_bytes: np.ndarray,
    peers: int,
) -> None:
    """Add to ``out`` the bytes of one exchange on one link class: :func:`solvers.wire.lookup_messages`
    of the lookups asked of and served to the peers over that link (per table, summed), and the split
    sizes sent to those ``peers`` (:func:`solvers.wire.split_bytes`, one per table)."""
    for (component, direction), nbytes in wire.lookup_messages(asked, served, vector_bytes).items():
        out.bytes[link, component, direction] += float(np.sum(nbytes))
    split = wire.split_bytes(peers, int(np.size(asked)))
    out.add(link, Component.IDS, split, split)


def count_forward(batch: Traffic, traffic: Traffic) -> Traffic:
    """Add the ids and forward bytes of ``batch`` to ``traffic``; return its backward bytes, to be added
    when the gradients travel."""
    for component in (Component.IDS, Component.FORWARD):
        traffic.bytes[:, component, :] += batch.bytes[:, component, :]
    backward = Traffic.zeros()
    backward.bytes[:, Component.BACKWARD, :] = batch.bytes[:, Component.BACKWARD, :]
    return backward
