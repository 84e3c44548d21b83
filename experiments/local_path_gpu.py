"""The runtime's local path on one device, against plain ``F.embedding`` + ``index_add_`` (issue 23, item 6).

On the bench's default tables (three 64-dim tables, 50-100 ids per sample, Zipf head plus a uniform
tail; :mod:`flexshard.bench.data`), with ``--rows-scale`` times their rows (default 100 on a GPU: 10^7,
5x10^6 and 10^6 rows, 4.1 GB of rows, so that the rows do not sit in the card's L2 cache as the default
41 MB would), at each batch per rank of ``--batches``, one process times:

* ``plain``: per table ``torch.nn.functional.embedding(ids, W)`` forward, then ``W.index_add_(0, ids,
  g, alpha=-lr)`` with the loss ``0.5 sum(v^2)``'s gradient ``g = v``: plain SGD with no dedup, the least
  a sequence-embedding step can do.
* ``step``: the runtime's whole step on a world of one rank (:class:`~flexshard.runtime.
  ShardedSequenceEmbedding` on the row-wise plan of one rank, with dedup; NCCL on a GPU, so no
  collective moves a byte): forward, the same loss's backward, row-wise Adagrad, as ``flexshard bench``
  times a step. Its pieces are what the issue calls the local path: dedup, routing, gather, scatter-add
  and the optimizer.
* the pieces one by one, as :func:`flexshard.local_rates.time_pieces` times them for the time model
  (``dedup``, ``route``, ``gather``, ``scatter_add``, ``update``, ``output``, ``pack``), on the same
  rows.

Each is reported as lookups per second and as memory bytes per second: the least bytes the work must
read and write in device memory (:data:`BYTES`; ids int64, rows float32; a sort's passes are not
counted, so dedup and route show how far a sort is from a copy) over its time, also as a fraction of
the card's bandwidth. The card's bandwidth is given twice: its peak from NVML (memory clock x bus
width x 2, double data rate) and a device-to-device copy measured here (bytes read plus written).
Times are means over repeats that span ``--min-s`` seconds after a warm-up run, each run ended by
``torch.cuda.synchronize``; the step is the mean of at least ``--steps`` steps.

``--host-batch B`` also times the runtime step at batch ``B`` (2: the values cost nothing) and counts the
aten ops it dispatches: the host's seconds per op on this machine, from which the GPU presets' host terms
are set (:data:`solvers.time_types.H100_RUNTIME_RATES`; the op counts are the runtime's, the same on every
device).

Run on a GPU machine: ``PYTHONPATH=. python3 experiments/local_path_gpu.py --out local_path.json``
(about a minute on one H100). On a machine without CUDA it runs on the CPU (``--rows-scale 1``), to
check the script, and its figures say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.functional import embedding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexshard.bench.data import DEFAULT_TABLES, default_data  # noqa: E402
from flexshard.bench.plans import h100_view  # noqa: E402
from flexshard.bench.systems import RuntimeSystem  # noqa: E402
from flexshard.local_rates import PIECES, mean_s, time_pieces  # noqa: E402
from flexshard.plan_file import to_dict  # noqa: E402
from flexshard.runtime.op_count import OpCount  # noqa: E402
from solvers.planner import budget_bytes, make_plan  # noqa: E402

ID_B, VALUE_B = 8, 4  # bytes of an id (int64) and of a row value (float32)
LR = 0.01

# The least device-memory bytes of each piece: n lookups, u distinct rows, d values per row.
BYTES = {
    # ids in, the inverse out, the distinct ids out
    "dedup": lambda n, u, d: ID_B * (2 * n + u),
    # ids in; the owner, the sorted owners and their order out
    "route": lambda n, u, d: ID_B * 4 * n,
    # ids in; each lookup's row read and written out
    "gather": lambda n, u, d: n * (ID_B + 2 * VALUE_B * d),
    # ids and gradients in; each lookup's row read and written back
    "scatter_add": lambda n, u, d: n * (ID_B + 3 * VALUE_B * d),
    # distinct ids, gradients, rows and state in; rows and state out
    "update": lambda n, u, d: u * (ID_B + 3 * VALUE_B * d + 2 * VALUE_B),
    # values in, gradients out
    "output": lambda n, u, d: 2 * n * VALUE_B * d,
    # values copied in and out of one buffer, read and written each time
    "pack": lambda n, u, d: 4 * n * VALUE_B * d,
    # F.embedding (ids in, rows read, values out) and index_add_ (ids, gradients, rows read and written)
    "plain": lambda n, u, d: n * (2 * ID_B + 5 * VALUE_B * d),
}


def card_bandwidth(device: torch.device) -> dict[str, float | str | None]:
    """The device's name, its peak memory bandwidth from NVML (B/s; None where NVML cannot say) and a
    device-to-device copy's measured bandwidth (bytes read plus written per second)."""
    out: dict[str, float | str | None] = {"name": "cpu", "peak_Bps": None}
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            clock_hz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM) * 1e6
            bus_bytes = pynvml.nvmlDeviceGetMemoryBusWidth(h) / 8
            out["peak_Bps"] = 2 * clock_hz * bus_bytes
        except Exception as e:  # NVML missing or refusing: the measured copy still says
            out["peak_note"] = f"NVML: {type(e).__name__}: {e}"
    nbytes = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    out["copy_Bps"] = 2 * nbytes / mean_s(lambda: dst.copy_(src), 0.2, sync)
    return out


def plain_step(weights: list[torch.Tensor], ids: list[torch.Tensor]) -> None:
    """Plain SGD on every table: ``F.embedding`` forward, ``index_add_`` of ``g = v`` (the loss
    ``0.5 sum(v^2)``'s gradient) with ``alpha=-lr``."""
    for w, i in zip(weights, ids, strict=True):
        v = embedding(i, w)
        w.index_add_(0, i, v, alpha=-LR)


def one_rank_group(device: torch.device) -> None:
    """A process group of this process alone: NCCL on a GPU, else gloo."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def runtime_system(data, tmp: Path) -> RuntimeSystem:
    """The runtime on the row-wise plan (dedup on) of a world of one rank, row-wise Adagrad."""
    w, view = data.workload, h100_view(1, 1)
    planned = make_plan("row_wise", w, view, budget_bytes(w, view, 1.0), dedup=True)
    path = tmp / "plan.json"
    path.write_text(json.dumps(to_dict(planned.plan, w, view, planned.report, "local-path", data.orders)))
    return RuntimeSystem("row_wise", str(path), data.tables, data.orders, 0, LR)


def step_s(system: RuntimeSystem, batch, sync, steps: int) -> float:
    """Mean seconds of the runtime's step over ``steps`` steps after three warm-up steps."""
    for _ in range(3):
        system.step(batch)
    if sync:
        sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        system.step(batch)
    if sync:
        sync()
    return (time.perf_counter() - t0) / steps


def profile(system: RuntimeSystem, batch, device: torch.device, steps: int = 5) -> str:
    """The runtime step's operators over ``steps`` steps (torch.profiler), most device time first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            system.step(batch)
        if on_gpu:
            torch.cuda.synchronize()
    out = f"the runtime step's operators over {steps} steps, by host time:\n"
    out += prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if on_gpu:
        out += "\nby device time:\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    return out


def host_syncs(system: RuntimeSystem, batch) -> str:
    """Where one runtime step waits for the GPU: each synchronizing CUDA call
    (:func:`torch.cuda.set_sync_debug_mode`), counted by the innermost line of this project on the
    stack when it warned."""
    import traceback
    import warnings

    root = Path(__file__).resolve().parents[1]
    counts: dict[str, int] = {}

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        here = Path(__file__).resolve()
        ours = [
            f
            for f in traceback.extract_stack()
            if Path(f.filename).resolve() != here and str(Path(f.filename).resolve()).startswith(str(root))
        ]
        f = ours[-1] if ours else None
        where = f"{Path(f.filename).resolve().relative_to(root)}:{f.lineno} {f.name}" if f else filename
        counts[where] = counts.get(where, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            system.step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"host syncs in one runtime step: {sum(counts.values())}"]
    lines += [f"  {n:3d}  {where}" for where, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def host_per_op(system: RuntimeSystem, data, device: torch.device, steps: int) -> dict:
    """The runtime step's host cost per aten op at a batch small enough that the values cost nothing
    (``data``'s batch; ``--host-batch``): the mean step (seconds, ended by a device sync) over the aten
    ops one step dispatches. The op count is the runtime's and so the same on every device; the seconds
    per op are this machine's (on a GPU: Python, dispatch, the kernel launch and the waits)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    batch = {k: (v.to(device), n.to(device)) for k, (v, n) in data.make_batch(0, 0).items()}
    seconds = step_s(system, batch, sync, steps)
    counter = OpCount()
    with counter:
        system.step(batch)
    if sync:
        sync()
    return {"batch": data.batch, "step_s": seconds, "ops": counter.ops, "s_per_op": seconds / counter.ops}


def measure(
    batch_size: int, args, device: torch.device, tables, system: RuntimeSystem, weights: list[torch.Tensor]
) -> list[dict]:
    """Every figure at one batch per rank; one record per piece, plus ``plain`` and ``step``. ``system``:
    the runtime, built once (its plan's batch does not bound the batches it takes); ``weights``: the
    rows ``plain`` and the pieces run on."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    data = default_data(batch_size, 0, 1, tables)
    batch = {k: (v.to(device), n.to(device)) for k, (v, n) in data.make_batch(0, 0).items()}
    ids = [v for v, _n in batch.values()]
    n = sum(int(i.numel()) for i in ids)
    distinct = [int(torch.unique(i).numel()) for i in ids]
    dims = [d for _t, _r, d in data.tables]

    def record(piece: str, seconds: float, bytes_: float) -> dict:
        return {"batch": batch_size, "piece": piece, "lookups": n, "seconds": seconds, "bytes": bytes_}

    plain_bytes = sum(
        BYTES["plain"](int(i.numel()), u, d) for i, u, d in zip(ids, distinct, dims, strict=True)
    )
    out = [record("step", step_s(system, batch, sync, args.steps), plain_bytes)]
    if args.profile and batch_size == args.profile:
        print(profile(system, batch, device), flush=True)
    if args.syncs and device.type == "cuda":
        print(host_syncs(system, batch), flush=True)
    out.append(record("plain", mean_s(lambda: plain_step(weights, ids), args.min_s, sync), plain_bytes))
    per_piece: dict[str, list[float]] = {p: [] for p in PIECES}
    piece_bytes = dict.fromkeys(PIECES, 0.0)
    for i, u, (_t, rows, d), w in zip(ids, distinct, data.tables, weights, strict=True):
        for p in time_pieces(i, d, rows, args.min_s, weight=w):
            per_piece[p.piece].append(p.seconds)
            piece_bytes[p.piece] += BYTES[p.piece](int(i.numel()), u, d)
    return out + [record(p, sum(per_piece[p]), piece_bytes[p]) for p in PIECES]


def table(records: list[dict], card: dict) -> str:
    """The records as a text table: lookups/s and bytes/s, as a fraction of the copy and the peak."""
    peak, copy = card.get("peak_Bps"), card["copy_Bps"]
    head = f"{'batch':>6}  {'what':<12} {'ms':>8} {'Mlookups/s':>11} {'GB/s':>8} {'% copy':>7} {'% peak':>7}"
    lines = [head, "-" * len(head)]
    for r in records:
        bps = r["bytes"] / r["seconds"]
        of_peak = f"{100 * bps / peak:7.1f}" if peak else f"{'-':>7}"
        rate = r["lookups"] / r["seconds"] / 1e6
        lines.append(
            f"{r['batch']:>6}  {r['piece']:<12} {r['seconds'] * 1e3:8.3f} {rate:11.1f} "
            f"{bps / 1e9:8.1f} {100 * bps / copy:7.1f} {of_peak}"
        )
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """The saved JSON (``--out``) as two Markdown tables: the whole step against plain, per batch; every
    piece's time and share of the card's peak (else of the measured copy), per batch."""
    card, recs = doc["card"], doc["records"]
    bw = card.get("peak_Bps") or card["copy_Bps"]
    of = "peak" if card.get("peak_Bps") else "copy"
    got = {(r["batch"], r["piece"]): r for r in recs}
    batches = sorted({r["batch"] for r in recs})

    def share(r: dict) -> str:
        return f"{100 * r['bytes'] / r['seconds'] / bw:.1f}%"

    def cell(r: dict) -> str:
        return f"{r['seconds'] * 1e3:.3f} ms, {r['lookups'] / r['seconds'] / 1e6:,.0f} M/s, {share(r)}"

    lines = [
        f"| batch per rank | lookups | plain (ms, lookups/s, % {of}) | runtime step | step / plain |",
        "| ---: | ---: | --- | --- | ---: |",
    ]
    for b in batches:
        plain, step = got[(b, "plain")], got[(b, "step")]
        lines.append(
            f"| {b:,} | {plain['lookups']:,} | {cell(plain)} | {cell(step)} | "
            f"{step['seconds'] / plain['seconds']:.1f}x |"
        )
    lines += ["", "| piece | " + " | ".join(f"{b:,}" for b in batches) + " |"]
    lines.append("| --- |" + " ---: |" * len(batches))
    for piece in PIECES:
        row = [f"{got[(b, piece)]['seconds'] * 1e3:.3f} ms ({share(got[(b, piece)])})" for b in batches]
        lines.append(f"| {piece} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="512,1024,2048,4096,8192", help="samples per rank, comma-separated")
    ap.add_argument(
        "--rows-scale",
        type=int,
        default=None,
        help="rows x the default tables' (default: 100 on a GPU, else 1)",
    )
    ap.add_argument("--min-s", type=float, default=0.05, help="seconds each piece is repeated for")
    ap.add_argument("--steps", type=int, default=20, help="timed runtime steps per batch")
    ap.add_argument("--profile", type=int, default=0, help="profile the runtime step at this batch (0: none)")
    ap.add_argument("--syncs", action="store_true", help="count the runtime step's host syncs (GPU)")
    ap.add_argument(
        "--host-batch",
        type=int,
        default=0,
        help="also time the host cost per aten op of a step at this batch per rank (0: not; 2: values free)",
    )
    ap.add_argument("--out", default=None, help="write the card and the records as JSON here")
    ap.add_argument("--markdown", default=None, help="print a saved --out JSON as Markdown tables; no run")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    scale = args.rows_scale or (100 if device.type == "cuda" else 1)
    tables = tuple((name, rows * scale, dim) for name, rows, dim in DEFAULT_TABLES)
    one_rank_group(device)
    card = card_bandwidth(device)
    peak = f"{card['peak_Bps'] / 1e9:,.0f} GB/s peak (NVML), " if card.get("peak_Bps") else ""
    print(
        f"local path on {card['name']} (torch {torch.__version__}, {dist.get_backend()}): "
        f"{peak}{card['copy_Bps'] / 1e9:,.0f} GB/s device copy; tables {tables}",
        flush=True,
    )
    batches = [int(x) for x in args.batches.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="local-path-") as tmp:
        system = runtime_system(default_data(max(batches), 0, 1, tables), Path(tmp))
    gen = torch.Generator(device=device).manual_seed(1)
    weights = [torch.randn(r, d, generator=gen, device=device) for _t, r, d in tables]
    print(f"set up in {time.perf_counter() - t0:.1f} s", flush=True)
    records, host = [], None
    if args.host_batch:
        host = host_per_op(system, default_data(args.host_batch, 0, 1, tables), device, 10 * args.steps)
        print(
            f"host cost per op at batch {host['batch']}: {host['step_s'] * 1e3:.3f} ms a step over "
            f"{host['ops']} aten ops = {host['s_per_op'] * 1e6:.2f} us per op",
            flush=True,
        )
    for b in batches:
        got = measure(b, args, device, tables, system, weights)
        print(table(got, card), flush=True)
        records += got
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                dict(card=card, torch=torch.__version__, tables=tables, records=records, host=host), indent=1
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
