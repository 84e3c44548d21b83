"""Named workloads (``--workload NAME``), loading any workload spec, and readable summaries.

A spec is, in this order: an existing ``.npz`` stats file (``save_stats``), an existing data file
or folder (``read_workload``), or a preset:

* ``default``: ``default_workload()``, the embedded production-like sequence workload;
* ``zipf:<alpha>``: the default tables with every table's Zipf exponent set to ``alpha``;
* ``synthetic:<tables>:<rows>[:<alpha>[:<seed>]]``: ``synthetic_workload`` (e.g. ``synthetic:100:1e9``);
* ``calibration``: the single Meta-calibrated table (``calibration_table``: the default ``item_id``
  distribution, 200M rows calibrated at one 64-GPU iteration).

Synthetic workloads number rows in hotness order, so they come with no hotness orders (``{}``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from core.errors import ConfigError, DataError, InputError
from solvers.types import Workload

from .locality import top_share, zipf_slope
from .parquet import ParquetColumns
from .readers import DEFAULT_DIM, read_workload
from .stats_file import fingerprint, load_stats_with_vocabulary
from .synthetic import (
    DEFAULT_BATCH_SIZE_PER_GPU,
    DEFAULT_TAIL_MASS,
    calibration_table,
    default_workload,
    synthetic_workload,
)
from .vocabulary import Vocabulary

PRESET_HELP = (
    "default",
    "zipf:<alpha>",
    "synthetic:<tables>:<rows>[:<alpha>[:<seed>]]",
    "calibration",
)


def preset_names() -> tuple[str, ...]:
    """The preset spellings ``load_workload`` accepts."""
    return PRESET_HELP


def data_root() -> Path:
    """The shared data folder: ``$FLEXSHARD_DATA`` or ``<repo>/../shared/data``."""
    env = os.environ.get("FLEXSHARD_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _number(text: str, what: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"workload: {what} in {spec!r} must be a number, got {text!r}") from None
    if not np.isfinite(value):
        raise ConfigError(f"workload: {what} in {spec!r} must be finite, got {text!r}")
    return value


def preset(spec: str) -> Workload:
    """Build a preset workload by name (see module docstring)."""
    parts = spec.split(":")
    head = parts[0].lower()
    if head == "default" and len(parts) == 1:
        return default_workload()
    if head == "calibration" and len(parts) == 1:
        table = calibration_table()
        return Workload(name="calibration", tables=(table,), batch_size_per_gpu=DEFAULT_BATCH_SIZE_PER_GPU)
    if head == "zipf" and len(parts) == 2:
        return default_workload(alpha=_number(parts[1], "alpha", spec))
    if head == "synthetic" and 3 <= len(parts) <= 5:
        tables = _number(parts[1], "the number of tables", spec)
        rows = _number(parts[2], "the number of rows", spec)
        if tables != int(tables) or rows != int(rows):
            raise ConfigError(f"workload: tables and rows in {spec!r} must be whole numbers")
        kwargs: dict = {}
        if len(parts) > 3:
            kwargs["alpha"] = _number(parts[3], "alpha", spec)
        if len(parts) > 4:
            seed = _number(parts[4], "seed", spec)
            kwargs["seed"] = int(seed)
        return synthetic_workload(int(tables), int(rows), tail_mass=DEFAULT_TAIL_MASS, **kwargs)
    raise ConfigError(
        f"workload: {spec!r} is neither an existing file or folder nor a preset; "
        f"presets: {', '.join(PRESET_HELP)}"
    )


def load_workload_with_orders(
    spec: str | Path,
    fmt: str = "auto",
    dim: int | Mapping[str, int] = DEFAULT_DIM,
    batch_size_per_gpu: int | None = None,
    max_len: int | None = None,
    num_rows: Mapping[str, int] | None = None,
    vocabulary: Vocabulary | None = None,
    columns: ParquetColumns | None = None,
) -> tuple[Workload, dict[str, np.ndarray]]:
    """Load a stats ``.npz``, a data file/folder or a preset, with hotness orders (``{}`` if none; also
    set on the workload's tables, for the row-wise baseline's id ranges).

    ``batch_size_per_gpu`` overrides the workload's (default: the file's or preset's; 512 for raw
    data). ``fmt``, ``dim``, ``max_len``, ``num_rows``, ``vocabulary`` (string ids of delimited files)
    and ``columns`` apply to raw data files only.
    """
    workload, orders, _vocab = load_workload_full(
        spec, fmt, dim, batch_size_per_gpu, max_len, num_rows, vocabulary, columns
    )
    return workload, orders


def load_workload_full(
    spec: str | Path,
    fmt: str = "auto",
    dim: int | Mapping[str, int] = DEFAULT_DIM,
    batch_size_per_gpu: int | None = None,
    max_len: int | None = None,
    num_rows: Mapping[str, int] | None = None,
    vocabulary: Vocabulary | None = None,
    columns: ParquetColumns | None = None,
) -> tuple[Workload, dict[str, np.ndarray], Vocabulary | None]:
    """:func:`load_workload_with_orders` and the vocabulary of string ids: a stats file's (frozen; None
    when its ids were integers), the one a data file's ids were mapped with, or None for a preset."""
    path = Path(spec)
    vocab = None
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".npz":
            workload, orders, vocab = load_stats_with_vocabulary(path)
        else:
            kwargs = {} if batch_size_per_gpu is None else {"batch_size_per_gpu": batch_size_per_gpu}
            vocab = vocabulary if vocabulary is not None else Vocabulary()
            workload, orders = read_workload(
                path, fmt=fmt, dim=dim, max_len=max_len, num_rows=num_rows, vocabulary=vocab,
                columns=columns, **kwargs
            )  # fmt: skip
    else:
        if str(spec).lower().endswith(".npz") or os.sep in str(spec):
            raise DataError(f"workload: {spec}: no such file")
        workload, orders = preset(str(spec)), {}
    if batch_size_per_gpu is not None and batch_size_per_gpu != workload.batch_size_per_gpu:
        workload = dataclasses.replace(workload, batch_size_per_gpu=batch_size_per_gpu)
    return workload.with_orders(orders), orders, vocab


def load_workload(
    spec: str | Path,
    fmt: str = "auto",
    dim: int | Mapping[str, int] = DEFAULT_DIM,
    batch_size_per_gpu: int | None = None,
    max_len: int | None = None,
) -> Workload:
    """``load_workload_with_orders`` without the orders."""
    return load_workload_with_orders(spec, fmt, dim, batch_size_per_gpu, max_len)[0]


def build_stats(
    inputs: Sequence[str | Path],
    fmt: str = "auto",
    dim: int | Mapping[str, int] = DEFAULT_DIM,
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
    max_len: int | None = None,
    vocabulary: Vocabulary | None = None,
) -> tuple[Workload, dict[str, np.ndarray]]:
    """What ``flexshard stats`` computes: read (and merge) data inputs into a workload + orders.

    A single input that is a preset name gives that preset (with no orders). ``vocabulary`` is filled
    with the string ids of delimited inputs (``read_workload``).
    """
    inputs = list(inputs)
    if not inputs:
        raise ConfigError("inputs: give at least one data file or folder")
    if len(inputs) == 1 and not Path(inputs[0]).exists() and not str(inputs[0]).lower().endswith(".npz"):
        try:
            workload = preset(str(inputs[0]))
        except InputError:  # any preset error: the spec is taken for a missing file
            raise DataError(f"inputs: {inputs[0]}: no such file or folder (nor a preset)") from None
        if batch_size_per_gpu != workload.batch_size_per_gpu:
            workload = dataclasses.replace(workload, batch_size_per_gpu=batch_size_per_gpu)
        return workload, {}
    return read_workload(
        inputs,
        fmt=fmt,
        dim=dim,
        batch_size_per_gpu=batch_size_per_gpu,
        max_len=max_len,
        vocabulary=vocabulary,
    )


def _si(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def describe(workload: Workload) -> str:
    """A readable per-table summary.

    Columns: rows; dim; ids per sample; share of accesses that hit the hottest 0.1% / 1% / 10% of
    the table's rows (all rows, split pro rata); Zipf-like slope (minus the log-log slope of
    probability vs rank over touched rows, log-spaced bins); untouched rows (probability 0);
    weights + optimizer state in GB.
    """
    head = (
        f"{'table':<18} {'rows':>9} {'dim':>5} {'ids/smp':>8} {'top0.1%':>8} {'top1%':>7} {'top10%':>7} "
        f"{'slope':>6} {'untouched':>10} {'GB':>8}"
    )
    lines = [
        f"workload {workload.name!r}: {len(workload.tables)} tables, {workload.num_rows:,} rows, "
        f"batch {workload.batch_size_per_gpu} per GPU, fingerprint {fingerprint(workload)[:12]}",
        head,
        "-" * len(head),
    ]
    total_gb = 0.0
    for t in workload.tables:
        untouched = int(t.hist.rows[t.hist.prob <= 0].sum())
        gb = t.num_rows * t.row_bytes / 1e9
        total_gb += gb
        lines.append(
            f"{t.name[:18]:<18} {_si(t.num_rows):>9} {t.dim:>5} {t.ids_per_sample:>8.4g} "
            f"{top_share(t.hist, 0.001):>8.3f} {top_share(t.hist, 0.01):>7.3f} "
            f"{top_share(t.hist, 0.1):>7.3f} "
            f"{zipf_slope(t.hist):>6.2f} {untouched / t.num_rows:>9.1%} {gb:>8.3g}"
        )
    lines.append(
        f"{'total':<18} {_si(workload.num_rows):>9} {'':>5} "
        f"{sum(t.ids_per_sample for t in workload.tables):>8.4g} {'':>8} {'':>7} {'':>7} {'':>6} {'':>10} "
        f"{total_gb:>8.3g}"
    )
    return "\n".join(lines)
