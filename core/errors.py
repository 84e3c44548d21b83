"""FlexShard's errors, classified by who can fix them.

:class:`InputError` and its subclasses are bad input: a flag, a file, a value, a plan that does not fit
the run. Their message is one line that names the field and the value, and says what to try. The
command-line tools catch :class:`InputError`, print that line and exit with status 2. Every other
exception is a bug in FlexShard (or its environment) and keeps its traceback.

:class:`InputError` derives from :class:`ValueError`, so code written against the standard library's
conventions (``except ValueError``) still sees bad input as a bad value.
"""

from __future__ import annotations


class FlexShardError(Exception):
    """Base of every error FlexShard raises on purpose."""


class CollectiveError(FlexShardError):
    """A collective failed: another rank stopped, died, or did not arrive within the timeout."""


class InputError(FlexShardError, ValueError):
    """Bad input. The message is one line naming the field and the value, and what to try."""


class ConfigError(InputError):
    """A flag or argument value that is out of range or contradicts another."""


class DataError(InputError):
    """An input file whose content is malformed: interaction data, a stats file, a plan file."""


class OutputError(InputError):
    """An output path that cannot be written (a missing folder, no permission, a full disk)."""


class TopologyError(InputError):
    """A topology (graph, JSON file or preset) that cannot be used."""


class ProbeError(TopologyError):
    """A probe that cannot run or cannot finish (a missing rank, a timeout)."""


class PlannerError(InputError):
    """A planning request that cannot be met: an infeasible budget, an inconsistent workload or plan."""


class PlanMismatchError(InputError):
    """A valid plan used for a run it was not made for: other data, world, groups, tables or settings."""


class CheckpointError(InputError):
    """A checkpoint that cannot be saved or loaded here."""


class BatchError(InputError):
    """A batch of ids that a sharded module cannot look up (raised on every rank alike)."""


def agreed(err: FlexShardError) -> FlexShardError:
    """``err``, marked as raised with the same message on every rank of a job (after an agreement, or
    from the same input everywhere), so that one rank reports it for all."""
    err.agreed = True  # type: ignore[attr-defined]
    return err


def is_agreed(err: BaseException) -> bool:
    """Whether ``err`` was marked by :func:`agreed`."""
    return bool(getattr(err, "agreed", False))
