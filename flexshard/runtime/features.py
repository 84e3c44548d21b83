"""The input side of a sharded lookup: features as ``{table: (values, lengths)}`` (or a TorchRec
KeyedJaggedTensor), their checks, and jagged-to-padded views.

A batch is checked on every rank before any data collective. A rank with bad input produces an error
code (four int64s: code, table, value, extra) instead of lookups; the codes travel with the split sizes
(:meth:`flexshard.runtime.exchange_protocol.ExchangeProtocol.meta`), so every rank raises the same
:class:`~core.errors.BatchError` and none is left waiting in a collective.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from core.errors import BatchError, agreed

ERROR_WORDS = 4  # int64s per rank's error code: code, table, value, extra


class InputFault(IntEnum):
    """What is wrong with a rank's batch (0: nothing)."""

    NONE = 0
    TABLES = 1  # a table missing, or an unknown one
    TYPE = 2  # values / lengths not 1-D integer tensors
    EMPTY = 3  # no samples
    NEGATIVE_LENGTH = 4
    LENGTH_SUM = 5  # lengths do not sum to the number of values
    RANGE = 6  # an id outside the table


Features = list[tuple[torch.Tensor, torch.Tensor]]  # per table (values int64[L], lengths int64[B])


def check_features(
    features: dict, table_names: list[str], num_rows: list[int], device: torch.device
) -> tuple[Features, torch.Tensor]:
    """(per table ``(values, lengths)`` as int64 on ``device``, this rank's error code). On the first
    problem the code is set and the parsed list is incomplete."""
    err = torch.zeros(ERROR_WORDS, dtype=torch.int64)

    def fault(kind: InputFault, table: int, value: int = 0, extra: int = 0) -> tuple[Features, torch.Tensor]:
        err[:] = torch.tensor([int(kind), table, value, extra])
        return parsed, err

    parsed: Features = []
    names = set(features) if isinstance(features, dict) else set()
    if names != set(table_names):
        missing = [n for n in table_names if n not in names]
        return fault(InputFault.TABLES, table_names.index(missing[0]) if missing else -1)
    typed: Features = []  # tables whose types and sizes passed, in order, before their values are read
    lows: list[torch.Tensor] = []
    first_fault: tuple[InputFault, int] | None = None  # a type or size fault, after the tables in typed
    for t, name in enumerate(table_names):
        try:
            values, lengths = features[name]
            values, lengths = torch.as_tensor(values), torch.as_tensor(lengths)
        except (TypeError, ValueError):
            first_fault = (InputFault.TYPE, t)
            break
        if (
            values.dim() != 1
            or lengths.dim() != 1
            or values.dtype.is_floating_point
            or lengths.dtype.is_floating_point
        ):
            first_fault = (InputFault.TYPE, t)
            break
        values = values.to(device=device, dtype=torch.int64)
        lengths = lengths.to(device=device, dtype=torch.int64)
        if lengths.numel() == 0:
            first_fault = (InputFault.EMPTY, t)
            break
        ends = list(torch.aminmax(values)) if values.numel() else [values.new_zeros(())] * 2
        lows.append(torch.stack([lengths.min(), lengths.sum(), *ends]))
        typed.append((values, lengths))
    # one host read for every table: shortest length, length sum, smallest and largest id
    for t, ((values, lengths), (shortest, total, low, high)) in enumerate(
        zip(typed, torch.stack(lows).tolist() if lows else [], strict=True)
    ):
        if shortest < 0:
            return fault(InputFault.NEGATIVE_LENGTH, t, shortest)
        if total != values.numel():
            return fault(InputFault.LENGTH_SUM, t, total, values.numel())
        if values.numel() and (low < 0 or high >= num_rows[t]):
            bad = (values < 0) | (values >= num_rows[t])
            return fault(InputFault.RANGE, t, int(values[bad][0]))
        parsed.append((values, lengths))
    if first_fault is not None:
        return fault(*first_fault)
    return parsed, err


def raise_input_error(codes: list, table_names: list[str], num_rows: list[int]) -> None:
    """Raise :class:`BatchError` for the first rank whose error code is set (the same on every rank)."""
    for r, e in enumerate(codes):
        code, t, value, extra = (int(x) for x in e.tolist())
        if not code:
            continue
        name = table_names[t] if 0 <= t < len(table_names) else None
        what = {
            InputFault.TABLES: f"features must have exactly the tables {table_names}"
            + (f"; table {name!r} is missing" if name else "; got extra or unknown tables"),
            InputFault.TYPE: f"table {name!r}: values and lengths must be 1-D integer tensors",
            InputFault.EMPTY: f"table {name!r}: empty batch (lengths has no entries)",
            InputFault.NEGATIVE_LENGTH: f"table {name!r}: negative length {value}",
            InputFault.LENGTH_SUM: f"table {name!r}: lengths sum to {value} but there are {extra} values",
        }.get(InputFault(code))
        if what is None:
            what = f"table {name!r}: id {value} out of range [0, {num_rows[t]})"
        raise agreed(BatchError(f"bad input on rank {r}: {what}"))


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


def features_from_kjt(kjt) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-key ``(values, lengths)`` of a TorchRec KeyedJaggedTensor (duck-typed: ``keys()``,
    ``values()``, ``lengths()``, ``length_per_key()``, ``stride()``), without importing torchrec."""
    for attr in ("keys", "values", "lengths", "length_per_key", "stride"):
        if not callable(getattr(kjt, attr, None)):
            raise BatchError(
                "features: expected a dict of (values, lengths) or a KeyedJaggedTensor, "
                f"got {type(kjt).__name__}"
            )
    keys, stride = list(kjt.keys()), int(kjt.stride())
    values = torch.split(kjt.values(), [int(x) for x in kjt.length_per_key()])
    lengths = kjt.lengths().reshape(len(keys), stride) if keys else kjt.lengths()
    return {k: (values[i], lengths[i]) for i, k in enumerate(keys)}
