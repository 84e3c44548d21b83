"""The nouns every layer shares: replication tiers, link classes, traffic components, directions,
gradient-sync and fetch modes, and the byte sizes of what goes on the wire.

The integer enums index arrays (``traffic[..., LinkClass.INTER_GROUP, Component.SYNC, Direction.SEND]``);
their ``label`` is the name used in files, reports and JSON (``"inter_group"``, ``"sync"``). The string
enums are settings whose value is the spelling on the command line and in plan files.
"""

from __future__ import annotations

from enum import Enum, IntEnum

from core.errors import ConfigError

INDEX_BYTES = 8  # one int64 row id (or split size) on the wire
MASK_BYTES_PER_ROW = 1  # uint8 "touched this step" flag all-reduced before a sparse replica sync
FLOAT32_BYTES = 4  # one float32 element of an embedding or gradient


class _Labelled(IntEnum):
    @property
    def label(self) -> str:
        """The lower-case name used in files and reports."""
        return self.name.lower()

    @classmethod
    def labels(cls) -> tuple[str, ...]:
        return tuple(member.label for member in cls)

    @classmethod
    def parse(cls, text: str):
        """The member whose label is ``text`` (ConfigError naming the choices otherwise)."""
        for member in cls:
            if member.label == text:
                return member
        raise ConfigError(f"{cls.__name__}: unknown {text!r}; choose one of {', '.join(cls.labels())}")


class Tier(_Labelled):
    """Where a row lives."""

    HOT = 0  # a copy on every GPU
    WARM = 1  # one copy per group (NVLink domain), split across the group's GPUs
    COLD = 2  # one copy in the cluster, split across all GPUs


class LinkClass(_Labelled):
    """Which links a byte crosses."""

    INTRA_GROUP = 0  # NVLink (or PCIe) inside a group
    INTER_GROUP = 1  # NICs and the fabric between groups


class Component(_Labelled):
    """What a byte carries."""

    IDS = 0  # row ids (and split sizes) sent to owners
    FORWARD = 1  # embeddings sent back to requesters
    BACKWARD = 2  # gradients sent to owners
    SYNC = 3  # replica gradient synchronisation


class Direction(_Labelled):
    SEND = 0
    RECV = 1


class _Setting(str, Enum):
    """A setting whose value is its spelling on the command line and in files (``str()`` gives it)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: str | _Setting):
        """The member spelled ``value`` (ConfigError naming the setting and the choices otherwise)."""
        try:
            return cls(value)
        except ValueError:
            setting = cls.__name__.removesuffix("Mode").lower()
            raise ConfigError(
                f"{setting}: unknown {value!r}; choose one of {', '.join(m.value for m in cls)}"
            ) from None


class SyncMode(_Setting):
    """How the gradients of replicated rows are summed after the backward pass."""

    SPARSE = "sparse"  # a touched-row mask, then only the touched rows
    DENSE = "dense"  # every replicated row


class FetchMode(_Setting):
    """How a table's cold lookups reach their owners (warm lookups never leave the group; hot are local).

    ``FLAT``: every rank sends its own (per-rank deduplicated) ids straight to the owners, in one
    all-to-all over the cluster. ``GROUP``: every rank sends each id to the GPU of its own group at the
    owner's position (its *rail peer*) over NVLink; that GPU deduplicates the ids of the whole group and
    fetches each row once per group from the owner, across the fabric between rail peers only, then
    scatters the rows back over NVLink. Gradients are summed in the group before they cross.
    """

    FLAT = "flat"
    GROUP = "group"


class WireDtype(_Setting):
    """Element type of embeddings and gradients on the wire: the lookup all-to-alls and the replica sync.
    Rows and optimizer state stay float32; received gradients are summed in float32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def element_bytes(self) -> int:
        """Bytes of one element on the wire."""
        return FLOAT32_BYTES if self is WireDtype.FP32 else 2


class SamplePlacement(_Setting):
    """Which GPU processes which sample of a global batch (:mod:`flexshard.batching`). The batch as a set
    is the same; only the assignment of its samples to GPUs changes.

    ``OFF``: each rank keeps the samples it read. ``REGROUP``: samples that share cold rows meet in one
    group, by a hash of the rows every rank computes alike (group-level dedup rises; the plan's owners are
    not used). ``OWNER``: each sample goes to the group that owns most of its cold rows' bytes (its lookups
    there stay on NVLink, and samples sharing rows meet as well). Both move a sample only when it saves more
    inter-group bytes than its ids cost to move, within exact per-rank quotas.
    """

    OFF = "off"
    REGROUP = "regroup"
    OWNER = "owner"


class Deal(_Setting):
    """How a table's cold rows are dealt to the ranks that own them (:mod:`solvers.dealing`).

    ``INTERLEAVE``: FlexShard's weighted round-robin over hotness rank (shares per rank, a start position
    per table). ``RANGES``: TorchRec's row-wise layout, contiguous ranges of ``ceil(rows / N)`` ids; only
    for tables whose rows are all cold.
    """

    INTERLEAVE = "interleave"
    RANGES = "ranges"


TIERS = Tier.labels()  # ("hot", "warm", "cold")
LINK_CLASSES = LinkClass.labels()  # ("intra_group", "inter_group")
COMPONENTS = Component.labels()  # ("ids", "forward", "backward", "sync")
DIRECTIONS = Direction.labels()  # ("send", "recv")
