"""Bytes per iteration with named axes: the one traffic record of the cost model, the runtime and the
reports.

A :class:`Traffic` holds a float64 array whose last three axes are ``[link class, component,
direction]`` (:class:`~core.vocabulary.LinkClass`, :class:`~core.vocabulary.Component`,
:class:`~core.vocabulary.Direction`); a leading axis, when present, is the rank. The cost model keeps
one row per rank; a runtime rank keeps its own, without the rank axis.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from core.vocabulary import Component, Direction, LinkClass

SHAPE = (len(LinkClass), len(Component), len(Direction))


def _link(link: LinkClass | str) -> LinkClass:
    return LinkClass.parse(link) if isinstance(link, str) else LinkClass(link)


def _component(component: Component | str) -> Component:
    return Component.parse(component) if isinstance(component, str) else Component(component)


@dataclass
class Traffic:
    """Bytes per iteration, ``bytes[..., link, component, direction]`` (float64)."""

    bytes: np.ndarray

    def __post_init__(self) -> None:
        self.bytes = np.asarray(self.bytes, dtype=np.float64)
        if self.bytes.shape[-3:] != SHAPE:
            raise ValueError(
                f"traffic: expected shape [..., {', '.join(map(str, SHAPE))}], got {self.bytes.shape}"
            )

    @classmethod
    def zeros(cls, ranks: int | None = None) -> Traffic:
        """No bytes; with ``ranks``, one record per rank."""
        return cls(np.zeros(SHAPE if ranks is None else (ranks, *SHAPE)))

    @property
    def num_ranks(self) -> int | None:
        """The size of the rank axis, or None for a single rank's record."""
        return self.bytes.shape[0] if self.bytes.ndim == 4 else None

    def copy(self) -> Traffic:
        return Traffic(self.bytes.copy())

    def add(
        self, link: LinkClass, component: Component, send: float | np.ndarray, recv: float | np.ndarray
    ) -> None:
        """Add ``send`` and ``recv`` bytes (scalars, or one per rank) to one link class and component."""
        self.bytes[..., link, component, Direction.SEND] += send
        self.bytes[..., link, component, Direction.RECV] += recv

    def __iadd__(self, other: Traffic) -> Traffic:
        self.bytes += other.bytes
        return self

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes + other.bytes)

    def link_bytes(
        self, link: LinkClass | str, components: Iterable[Component] = tuple(Component)
    ) -> np.ndarray | float:
        """Bytes on one link class: ``max(send, recv)`` of the sum over ``components``, per rank (or a
        float for a single rank's record)."""
        idx = [int(_component(c)) for c in components]
        out = self.bytes[..., _link(link), idx, :].sum(axis=-2).max(axis=-1)
        return float(out) if np.ndim(out) == 0 else out

    def component_bytes(self, link: LinkClass | str, component: Component | str) -> np.ndarray | float:
        """``max(send, recv)`` of one component on one link class (per rank, or a float)."""
        out = self.bytes[..., _link(link), _component(component), :].max(axis=-1)
        return float(out) if np.ndim(out) == 0 else out

    def per_link(self) -> np.ndarray:
        """``[..., link]``: max(send, recv) of the component sum, per link class."""
        return self.bytes.sum(axis=-2).max(axis=-1)

    def to_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        """A single rank's record as ``{link: {component: {"send": b, "recv": b}}}`` (labels as keys)."""
        if self.bytes.ndim != 3:
            raise ValueError("traffic.to_dict: needs a single rank's record (no rank axis)")
        return {
            link.label: {
                comp.label: {d.label: float(self.bytes[link, comp, d]) for d in Direction}
                for comp in Component
            }
            for link in LinkClass
        }
