"""Collectives and bytes of one rank, counted by wrapping the ``torch.distributed`` collectives.

``with recording(group_size) as rec: ...`` counts every collective this process issues inside the block
(``rec.counts``: kind -> calls) and the bytes it sends to each peer, self excluded, per link class
(``rec.bytes_sent[LinkClass]``, B; ``rec.bytes_received`` likewise), peers classified by the
emulated groups of ``group_size`` consecutive ranks. Any library that calls the collectives through the
``torch.distributed`` module (FlexShard's runtime, TorchRec) is seen.

Bytes: all-to-all and gather bytes per peer are exact (from the split sizes). An all-reduce's per-peer
traffic depends on the backend's algorithm, so it is COMPUTED from its payload ``P`` with the cost
model's hierarchical all-reduce (``2 (g-1)/g P`` intra-group, ``2 (G-1)/G P / g`` inter-group; FlexShard's
own counter uses the same convention); a reduce-scatter counts as half an all-reduce. Barriers count as
collectives and carry no bytes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.vocabulary import LinkClass

HOOKED = (
    "all_to_all_single",
    "all_to_all",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
)
INTRA, INTER = int(LinkClass.INTRA_GROUP), int(LinkClass.INTER_GROUP)

_active: list[Recording] = []  # the recordings open in this process (innermost last)
_originals: dict[str, Callable[..., Any]] = {}


class Recording:
    """What one rank issued inside a :func:`recording` block."""

    def __init__(self, group_size: int) -> None:
        if group_size <= 0:
            raise ValueError(f"group_size: must be positive, got {group_size}")
        self.group_size = group_size
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.counts: dict[str, int] = {}
        self.bytes_sent = np.zeros(len(LinkClass))
        self.bytes_received = np.zeros(len(LinkClass))
        self.unrecorded: dict[str, str] = {}  # kind -> why its bytes could not be read

    @property
    def collectives(self) -> int:
        """Collectives issued, all kinds."""
        return sum(self.counts.values())

    def link(self, peer: int) -> int:
        """``LinkClass`` index of the link to ``peer``."""
        return INTRA if peer // self.group_size == self.rank // self.group_size else INTER

    def _add(self, peer: int, sent: float, got: float) -> None:
        if peer != self.rank:
            li = self.link(peer)
            self.bytes_sent[li] += sent
            self.bytes_received[li] += got

    def add_bytes(self, kind: str, a: dict[str, Any]) -> None:
        """Add the bytes of one call of ``kind`` with bound arguments ``a``."""
        group = a.get("group")
        ranks = list(range(self.world)) if group is None else list(dist.get_process_group_ranks(group))
        n = len(ranks)
        if kind == "all_to_all_single":
            inp, out = a["input"], a["output"]
            rows_i, per_i = _row_bytes(inp)
            rows_o, per_o = _row_bytes(out)
            ins = a.get("input_split_sizes") or [rows_i // n] * n
            outs = a.get("output_split_sizes") or [rows_o // n] * n
            for i, peer in enumerate(ranks):
                self._add(peer, int(ins[i]) * per_i, int(outs[i]) * per_o)
        elif kind == "all_to_all":
            for i, peer in enumerate(ranks):
                t_in, t_out = a["input_tensor_list"][i], a["output_tensor_list"][i]
                self._add(peer, _nbytes(t_in), _nbytes(t_out))
        elif kind in ("all_gather", "all_gather_into_tensor"):
            b = _nbytes(a["tensor"] if kind == "all_gather" else a["input_tensor"])
            for peer in ranks:
                self._add(peer, b, b)
        elif kind == "broadcast":
            b = _nbytes(a["tensor"])
            src = a["src"] if a.get("src") is not None else ranks[a.get("group_src") or 0]
            for peer in ranks:
                self._add(peer, b if self.rank == src else 0, b if peer == src else 0)
        elif kind == "all_reduce":
            self._hierarchical(ranks, _nbytes(a["tensor"]))
        elif kind in ("reduce_scatter", "reduce_scatter_tensor"):
            t = a.get("input") if kind == "reduce_scatter_tensor" else None
            payload = _nbytes(t) if t is not None else sum(_nbytes(x) for x in a["input_list"])
            self._hierarchical(ranks, payload / 2.0)

    def _hierarchical(self, ranks: list[int], payload: float) -> None:
        if len(ranks) < 2:
            return
        groups, members = np.unique(np.asarray(ranks) // self.group_size, return_counts=True)
        g = int(members[groups == self.rank // self.group_size][0])
        G = groups.size
        intra = 2.0 * (g - 1) / g * payload
        inter = 2.0 * (G - 1) / G * payload / g
        self.bytes_sent += (intra, inter)
        self.bytes_received += (intra, inter)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_bytes(t: torch.Tensor) -> tuple[int, int]:
    """Rows (first dimension) and bytes per row of ``t``."""
    rows = t.shape[0] if t.dim() else 1
    return rows, (t.numel() // rows if rows else 0) * t.element_size()


def _wrap(kind: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(orig)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _active:
            rec = _active[-1]
            rec.counts[kind] = rec.counts.get(kind, 0) + 1
            try:
                rec.add_bytes(kind, sig.bind(*args, **kwargs).arguments)
            except Exception as e:  # never let accounting break the job
                rec.unrecorded[kind] = f"{type(e).__name__}: {e}"
        return orig(*args, **kwargs)

    wrapped.__name__ = kind
    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def install() -> None:
    """Wrap the collectives of ``torch.distributed`` (once per process; idle outside a recording)."""
    for kind in HOOKED:
        if kind not in _originals:
            _originals[kind] = getattr(dist, kind)
            setattr(dist, kind, _wrap(kind, _originals[kind]))


@contextlib.contextmanager
def recording(group_size: int) -> Iterator[Recording]:
    """Count this rank's collectives and bytes inside the block (see the module docstring); the process
    group must be initialised."""
    install()
    rec = Recording(group_size)
    _active.append(rec)
    try:
        yield rec
    finally:
        _active.remove(rec)
