"""The vocabulary every FlexShard layer speaks: no torch, no networkx, numpy only.

* ``vocabulary``: the enums (:class:`Tier`, :class:`LinkClass`, :class:`Component`, :class:`Direction`,
  :class:`SyncMode`, :class:`FetchMode`) and the byte sizes of what goes on the wire;
* ``traffic``: :class:`Traffic`, bytes per iteration with named axes (rank, link class, component,
  direction), the one record the cost model, the runtime and the reports exchange;
* ``ranks``: :class:`RankLayout`, ranks partitioned into groups (NVLink domains): positions, replica
  groups, link classes between ranks; used by the probe, the cost model and the runtime;
* ``errors``: the error hierarchy. :class:`InputError` is bad input (the CLIs print its first line and
  exit 2); anything else is a bug and shows its traceback;
* ``osutil``: atomic file writes and free loopback ports;
* ``arrays``: array helpers (:func:`~core.arrays.exclusive_cumsum`: where blocks of given sizes start).

Dependencies point one way: ``flexshard -> solvers -> topology -> core``.
"""

from core.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    DataError,
    FlexShardError,
    InputError,
    OutputError,
    PlanMismatchError,
    PlannerError,
    ProbeError,
    TopologyError,
)
from core.ranks import RankLayout
from core.traffic import Traffic
from core.vocabulary import Component, Direction, FetchMode, LinkClass, SyncMode, Tier

__all__ = [
    "BatchError",
    "CheckpointError",
    "Component",
    "ConfigError",
    "DataError",
    "Direction",
    "FetchMode",
    "FlexShardError",
    "InputError",
    "LinkClass",
    "OutputError",
    "PlanMismatchError",
    "PlannerError",
    "ProbeError",
    "RankLayout",
    "SyncMode",
    "Tier",
    "TopologyError",
    "Traffic",
]
