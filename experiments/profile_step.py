"""Where a benchmark step's time goes: runs ``flexshard bench``'s strategies on spawned gloo ranks and
profiles rank 0's timed steps with ``torch.profiler`` (self CPU time per op, grouped into the pieces of
the time model), beside the time model's pieces for the same plan. Each exchange-protocol phase (and
the local dedup and routing, ``lookups``) is clocked in thread CPU and, with ``--counts``, its torch ops
and their self time are listed per phase; ``--clock-only`` leaves the profiler out (undistorted clocks).
``--ops`` (no profiler either) clocks every aten op of rank 0's steps in thread CPU (a dispatch mode; the
autograd backward's ops included) and prints a table of ms per step by op, one column per strategy,
largest difference first: which ops one strategy spends more on than another; with ``--sites``, also
the ops per step by the line of the project's code that issued them (the innermost frame under
``flexshard/``, ``solvers/`` or ``core/``): where a step's host work (its op count) comes from.
``--as-gpu`` takes the runtime's GPU op choices on the CPU (the ops a GPU issues; the same values), and
``--workload`` a stats file instead of the bench's tables.

The clocks also count minor page faults (``faults.<phase>``, and per step): read the op clocks beside
them. On 2026-12-07 at 4 ranks, batch 512, FlexShard's timed steps here faulted 2,000-3,000 pages a step
(its heap still growing: the backward's 10 MB ``mul`` outputs faulted in anew, about 1.5 us a page) where
the bench's timed steps of the same plan fault about 1.5 (`page_faults_per_step`): the dense ``mul``
that came out about 15% slower in FlexShard's column here is those faults, not the step's work.

    nice .venv/bin/python experiments/profile_step.py [--nproc 4] [--groups 2] [--batch 128] [--steps 10]
        [--only flexshard,row_wise] [--counts | --clock-only | --ops [--sites]] [--as-gpu]
        [--workload STATS]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.osutil import free_port  # noqa: E402
from flexshard.bench.settle import minor_faults  # noqa: E402

# op name substring -> piece (first match wins); everything else is "other"
GROUPS = (
    ("_Lookup", "collectives (wait, in the exchange's autograd function)"),
    ("c10d::", "collectives (wait, in the exchange's autograd function)"),
    ("unique", "dedup"),
    ("searchsorted", "route"),
    ("sort", "route"),
    ("index_select", "gather"),
    ("embedding", "gather"),
    ("scatter_add", "scatter_add"),
    ("index_add", "scatter_add"),
    ("index_copy", "update"),
    ("sqrt", "update"),
    ("div", "update"),
    ("pow", "output (loss)"),
    ("mul", "output (loss)"),
    ("sum", "output (loss)"),
    ("cat", "pack"),
    ("split", "pack"),
    ("copy_", "pack"),
)


def _piece(name: str) -> str:
    for key, piece in GROUPS:
        if key in name:
            return piece
    return "other ops and Python (host)"


_PHASE = ["model"]  # the exchange-protocol phase running now (innermost last; ``_time_protocol`` sets it)


_ROOT = str(Path(__file__).resolve().parents[1])
_SITE_DIRS = tuple(f"{_ROOT}/{d}/" for d in ("flexshard", "solvers", "core"))


def _site() -> str:
    """``path:line`` of the innermost frame of the project's own code (outside it: ``elsewhere``)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_SITE_DIRS):
            return f"{name[len(_ROOT) + 1 :]}:{frame.f_lineno}"
        frame = frame.f_back
    return "elsewhere"


class _OpClock(TorchDispatchMode):
    """Thread CPU seconds and calls per aten op (overload packet name) while active; ``by_phase``: the
    same keyed ``phase:op``; ``by_site``: keyed by the project's line that issued it (:func:`_site`)."""

    def __init__(self, by_phase: bool = False, by_site: bool = False) -> None:
        super().__init__()
        self.by_phase, self.by_site = by_phase, by_site
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.by_phase:
            name = f"{_PHASE[-1]}:{name}"
        if self.by_site:
            name = _site()
        self.cpu[name] += time.thread_time() - t0
        self.calls[name] += 1
        return out


def _ops_table(by_key: dict[str, _OpClock], steps: int, top: int = 25) -> str:
    """ms of thread CPU per step by op, a column per strategy, the largest spread first (one strategy:
    the largest first)."""
    keys = list(by_key)
    names = {n for c in by_key.values() for n in c.cpu}
    per = {n: [by_key[k].cpu.get(n, 0.0) * 1e3 / steps for k in keys] for n in names}
    spread = len(keys) > 1  # the largest difference first; one strategy: the largest first
    order = sorted(names, key=lambda n: -(max(per[n]) - min(per[n])) if spread else -per[n][0])[:top]
    width = max(12, *(len(k) + 2 for k in keys))  # a space between columns whatever their names
    head = f"{'op':<34}" + "".join(f"{k:>{width}}" for k in keys)
    rows = [head, "-" * len(head)]
    for n in order:
        calls = "/".join(f"{by_key[k].calls.get(n, 0) // steps}" for k in keys)
        rows.append(f"{n:<34}" + "".join(f"{v:>{width}.2f}" for v in per[n]) + f"   calls {calls}")
    totals = [sum(c.cpu.values()) * 1e3 / steps for c in by_key.values()]
    rows.append(f"{'all ops':<34}" + "".join(f"{v:>{width}.2f}" for v in totals))
    return "\n".join(rows)


def _sites_table(by_key: dict[str, _OpClock], steps: int, top: int = 60) -> str:
    """Ops per step by issuing line, a column per strategy, the most calls first (then the totals)."""
    keys = list(by_key)
    sites = {n for c in by_key.values() for n in c.calls}
    per = {n: [by_key[k].calls.get(n, 0) / steps for k in keys] for n in sites}
    order = sorted(sites, key=lambda n: -max(per[n]))[:top]
    width = max(12, *(len(k) + 2 for k in keys))
    head = f"{'line':<52}" + "".join(f"{k:>{width}}" for k in keys)
    rows = [head, "-" * len(head)]
    rows += [f"{n:<52}" + "".join(f"{v:>{width}g}" for v in per[n]) for n in order]
    rows.append(
        f"{'all lines':<52}" + "".join(f"{sum(c.calls.values()) / steps:>{width}g}" for c in by_key.values())
    )
    return "\n".join(rows)


def _faults() -> float:
    """This process's minor page faults so far (the bench's count), x 1e-3 (a clock entry: read per step
    in units)."""
    return minor_faults() * 1e-3


def _time_protocol(clock: dict) -> None:
    """Clock every exchange-protocol phase's local work (the call, and the wait of its stage with the
    finish after it) under ``proto.<phase>``, in CPU seconds of the calling thread (``time.thread_time``:
    what this rank spent, not the time slices other ranks took from it on shared cores, nor a blocked
    wait); ``local_lookups`` as ``proto.lookups``. Each is also a ``record_function`` range, so the
    profile's ops can be counted per phase."""
    from flexshard.runtime import awaitable, exchange_protocol, headed_ids

    def _in_phase(name, out, attr, wrapped):
        whole = getattr(out, attr)

        def waited():
            if _PHASE and _PHASE[-1] == name:  # called inside the phase's own wait: clocked there
                return whole()
            t1 = time.thread_time()  # a blocked wait takes no CPU of this thread
            f1 = _faults()
            _PHASE.append(name)
            try:
                with torch.autograd.profiler.record_function(f"proto.{name}"):
                    value = whole()
            finally:
                _PHASE.pop()
            clock[f"proto.{name}"] += time.thread_time() - t1
            clock[f"faults.{name}"] += _faults() - f1
            # these closures hold out's own methods: none left on it once its last stage (wait) ran, or
            # the cycle keeps its buffers until a collection, and the timed steps run without one
            for a in wrapped if attr == "wait" else (attr,):
                vars(out).pop(a, None)
            return value

        return waited

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.thread_time()
            f0 = _faults()
            _PHASE.append(name)
            try:
                with torch.autograd.profiler.record_function(f"proto.{name}"):
                    out = fn(*a, **k)
            finally:
                _PHASE.pop()
            clock[f"proto.{name}"] += time.thread_time() - t0
            clock[f"faults.{name}"] += _faults() - f0
            # the inner stages' finish runs in the works' wait (and ids' headers in its advance): the
            # phase's work
            waits = ("advance", "wait") if isinstance(out, headed_ids.HeadedIds) else ("wait",)
            if isinstance(out, (awaitable.Pending, headed_ids.HeadedIds)):
                for attr in waits:
                    setattr(out, attr, _in_phase(name, out, attr, waits))
            return out

        return call

    cls = exchange_protocol.ExchangeProtocol
    for name in ("route", "input_ids", "compute", "rows", "scatter", "grads", "rail_grads"):
        setattr(cls, name, timed(name, getattr(cls, name)))
    from flexshard.runtime import sharded

    sharded.local_lookups = timed("lookups", sharded.local_lookups)


def _ops_by_phase(prof, steps: int) -> str:
    """Torch ops per step inside each ``proto.<phase>`` range (nested ops included, as the op count
    counts them), the rest under ``other``; the ranges themselves are not counted."""
    per: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    self_us: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in prof.events():
        if ev.name.startswith("proto."):
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("proto."):
            parent = parent.cpu_parent
        phase = parent.name[6:] if parent is not None else "other"
        per[phase][ev.name] += 1
        self_us[phase][ev.name] += ev.self_cpu_time_total
    parts = []
    for phase, ops in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
        named = ", ".join(f"{k.removeprefix('aten::')} {v / steps:g}" for k, v in top)
        slow = sorted(self_us[phase].items(), key=lambda kv: -kv[1])[:4]
        timed = ", ".join(f"{k.removeprefix('aten::')} {v / steps / 1e3:.2f}" for k, v in slow)
        total = sum(self_us[phase].values()) / steps / 1e3
        parts.append(f"{phase} {sum(ops.values()) / steps:g} ({named}; self ms {total:.2f}: {timed})")
    return "; ".join(parts)


def _rank(rank: int, args, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.nproc))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    torch.set_num_threads(1)
    from flexshard.runtime.host_memory import keep_freed_memory

    keep_freed_memory()  # as the bench's ranks do
    from flexshard.bench.config import BenchConfig
    from flexshard.bench.plans import make_plans, plan_view, probed_view
    from flexshard.bench.settle import DEFAULT_MAX_PASSES, settle
    from flexshard.bench.worker import _build, load_data, machine_rates

    cfg = BenchConfig(
        nproc=args.nproc,
        groups=args.groups,
        batch=args.batch,
        plan_for=args.plan_for,
        objective=args.objective,
        torchrec=False,
        workload=args.workload,
    )
    data = load_data(cfg, args.nproc)
    machine = probed_view(cfg.groups, 60.0)
    planned_for = plan_view(args.plan_for, machine, args.nproc, args.groups)
    import flexshard.bench.plans as plans_mod
    from flexshard.runtime import awaitable
    from solvers.time_model import step_time

    models = {}

    real_parts = plans_mod.predicted_parts_ms

    def capture(w, view, plan, latency=None, rates=None, **kwargs):
        models[len(models)] = step_time(w, view, plan, latency=latency, rates=rates)
        return real_parts(w, view, plan, latency=latency, rates=rates, **kwargs)

    plans_mod.predicted_parts_ms = capture
    clock = defaultdict(float)

    def wait(self):
        if not self._done:
            t0 = time.perf_counter()
            for work in self._works:
                if work is not None:
                    c0 = time.thread_time()
                    work.wait()
                    if not isinstance(work, awaitable.Pending):  # a collective's own wait
                        clock["wait (thread cpu)"] += time.thread_time() - c0
            clock["wait"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            self._value, self._done = self._finish(), True
            clock["finish"] += time.perf_counter() - t0
            self._works, self._finish = [], awaitable._finished  # as Pending.wait
        return self._value

    awaitable.Pending.wait = wait
    _time_protocol(clock)
    held = contextlib.ExitStack()  # open until the rank returns
    if args.as_gpu:  # the GPU's op choices from here on (the ops a GPU issues, the same values)
        from flexshard.runtime.device_rules import counted_as_gpu

        held.enter_context(counted_as_gpu())
    plans = make_plans(data, planned_for, machine, cfg.budget, False, cfg.objective, machine_rates(cfg, data))
    with tempfile.TemporaryDirectory() as tmp:
        systems, _ = _build(cfg, data, plans, Path(tmp))
    batches = [data.make_batch(s, rank) for s in range(args.warmup + args.steps)]
    lines = []
    op_clocks: dict[str, _OpClock] = {}
    phase_clocks: dict[str, _OpClock] = {}
    site_clocks: dict[str, _OpClock] = {}
    profiled = [s for s in systems if not args.only or s.key in args.only.split(",")]

    def one_pass(i: int) -> None:  # every profiled strategy once: none pays the heap's growth alone
        for s in profiled:
            dist.barrier()
            s.step(batches[i % len(batches)])

    # the warm-up batches, then every timed batch once (the heap has seen every size before the clocks
    # run), then passes until no rank's heap grows
    passes = args.warmup + args.steps if args.warmup else 0
    for i in range(passes):
        one_pass(i)
    settled = settle(lambda i: one_pass(passes + i), DEFAULT_MAX_PASSES if args.warmup else 0)
    if rank == 0:
        lines.append(f"== warm-up: {passes} passes (every batch once), then {settled} until no heap grew")
    for s in profiled:
        times = []
        prof = (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            if rank == 0 and not (args.clock_only or args.ops)
            else None
        )
        if args.cprofile and rank == 0:
            import cProfile

            prof, python_prof = None, cProfile.Profile()
            python_prof.enable()
        if prof:
            prof.__enter__()
        clock.clear()
        gc.collect()  # no automatic collection inside the timed steps, as the bench's rounds
        gc.disable()
        cpu0, proc0 = time.thread_time(), time.process_time()
        faults0 = _faults()
        ops = _OpClock() if args.ops and rank == 0 else None
        phased = _OpClock(by_phase=True) if args.ops and rank == 0 else None
        sited = _OpClock(by_site=True) if args.sites and rank == 0 else None
        for b in batches[args.warmup :]:
            dist.barrier()
            if ops is not None:
                ops.__enter__()
                phased.__enter__()
            if sited is not None:
                sited.__enter__()
            t0, f0 = time.perf_counter(), _faults()
            embedded = s.model(b)
            t1, f1 = time.perf_counter(), _faults()
            loss = sum(0.5 * v.pow(2).sum() for v in embedded.values())
            t2, f2 = time.perf_counter(), _faults()
            loss.backward()
            t3, c3, f3 = time.perf_counter(), time.thread_time(), _faults()
            s.model.step()
            t4, f4 = time.perf_counter(), _faults()
            parts = ("forward", "loss", "backward", "opt_step")
            for k, v in zip(parts, np.diff([f0, f1, f2, f3, f4]), strict=True):
                clock[f"faults.{k}"] += float(v)
            clock["opt_step (thread cpu)"] += time.thread_time() - c3
            if sited is not None:
                sited.__exit__(None, None, None)
            if ops is not None:
                phased.__exit__(None, None, None)
                ops.__exit__(None, None, None)
            times.append(t4 - t0)
            for k, v in (
                ("forward", t1 - t0),
                ("loss", t2 - t1),
                ("backward", t3 - t2),
                ("opt_step", t4 - t3),
            ):
                clock[k] += v
        clock["cpu (thread) per step"] = time.thread_time() - cpu0
        gc.enable()
        clock["cpu (process, with gloo's threads) per step"] = time.process_time() - proc0
        # minor page faults (each a zeroed 4 KiB page the kernel maps: freed large buffers given back
        # to it and asked for again), counted as a number x 1e-3 so the per-step figure reads in units
        clock["minor page faults per step"] = _faults() - faults0
        if args.cprofile and rank == 0:
            import io
            import pstats

            python_prof.disable()
            text = io.StringIO()
            pstats.Stats(python_prof, stream=text).sort_stats("tottime").print_stats(30)
            lines.append(f"== {s.key}: Python self time over {args.steps} steps\n{text.getvalue()}")
        if ops is not None:
            op_clocks[s.key], phase_clocks[s.key] = ops, phased
        if sited is not None:
            site_clocks[s.key] = sited
        if (args.clock_only or args.ops) and rank == 0:
            lines.append(
                f"== {s.key} (no profiler): step median {sorted(times)[len(times) // 2] * 1e3:.1f} ms; "
                "phases ms/step: " + ", ".join(f"{k} {v * 1e3 / args.steps:.2f}" for k, v in clock.items())
            )
        if prof:
            prof.__exit__(None, None, None)
            by = defaultdict(float)
            for ev in prof.key_averages():
                by[_piece(ev.key)] += ev.self_cpu_time_total / 1e3 / args.steps
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
            ops = sum(e.count for e in prof.key_averages() if not e.key.startswith("proto.")) / args.steps
            lines.append(
                f"== {s.key}: step median {sorted(times)[len(times) // 2] * 1e3:.1f} ms (profiled), "
                f"{ops:.0f} torch ops per step"
            )
            by["other ops and Python (host)"] += sorted(times)[len(times) // 2] * 1e3 - sum(by.values())
            lines.append("  measured ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by.items())))
            if args.counts:
                by_count = sorted(
                    (e for e in prof.key_averages() if not e.key.startswith("proto.")), key=lambda e: -e.count
                )
                calls = "; ".join(f"{e.key} {e.count / args.steps:g}" for e in by_count)
                lines.append("  calls/step: " + calls)
                lines.append("  ops/step by phase: " + _ops_by_phase(prof, args.steps))
            lines.append(
                "  phases ms/step: " + ", ".join(f"{k} {v * 1e3 / args.steps:.2f}" for k, v in clock.items())
            )
            lines.append(
                "  top ops: "
                + "; ".join(
                    f"{e.key} {e.self_cpu_time_total / 1e3 / args.steps:.2f} x{e.count // args.steps}"
                    for e in top
                )
            )
    if op_clocks:
        lines.append(f"== thread CPU by op, rank 0, ms per step over {args.steps} steps")
        lines.append(_ops_table(op_clocks, args.steps))
        lines.append("== the same by exchange phase (model: outside the protocol's phases)")
        lines.append(_ops_table(phase_clocks, args.steps, top=40))
        lines.append("== aten ops per step by phase (calls, views included)")
        for key, c in phase_clocks.items():
            by: dict[str, int] = defaultdict(int)
            for name, n in c.calls.items():
                by[name.split(":")[0]] += n
            total = sum(by.values()) / args.steps
            parts = ", ".join(f"{k} {v / args.steps:g}" for k, v in sorted(by.items()))
            lines.append(f"  {key}: {total:g} ({parts})")
    if site_clocks:
        lines.append(f"== aten ops per step by the line that issued them, rank 0, over {args.steps} steps")
        lines.append(_sites_table(site_clocks, args.steps))
    if rank == 0:
        for key, sp in plans.items():
            if sp.document:
                for tp in sp.document["tables"]:
                    shown = ("share", "deal", "start", "fetch", "rows")
                    fields = {k: v for k, v in tp.items() if any(w in k for w in shown)}
                    lines.append(f"   {key} {tp.get('name')}: {fields}")

            st = models[list(plans).index(key)]
            lines.append(
                f"-- model {key}: predicted {sp.predicted_ms:.1f} ms: latency {st.latency_s * 1e3:.2f}, "
                f"bandwidth "
                f"{st.bandwidth_s * 1e3:.2f}, local "
                + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in st.local_by_piece.items())
            )
        Path(out, "profile.txt").write_text("\n".join(lines) + "\n")
    dist.barrier()
    held.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed passes (a step of every profiled strategy) first, then one on every timed batch "
        "and passes until no heap grows (0: none)",
    )
    ap.add_argument("--objective", default="step", help="step (bench's default) or bytes")
    ap.add_argument("--plan-for", default="h100", help="probed or h100 (what the plans are made for)")
    ap.add_argument("--cprofile", action="store_true", help="profile rank 0's Python instead (self time)")
    ap.add_argument("--counts", action="store_true", help="also list every op's calls per step")
    ap.add_argument(
        "--clock-only", action="store_true", help="no torch profiler: the phases' thread CPU undistorted"
    )
    ap.add_argument("--ops", action="store_true", help="thread CPU by aten op, a column per strategy")
    ap.add_argument("--sites", action="store_true", help="aten ops per step by the project line issuing them")
    ap.add_argument("--only", default="", help="comma-separated strategy keys to profile (default: all)")
    ap.add_argument(
        "--as-gpu",
        action="store_true",
        help="take the runtime's GPU op choices on the CPU (device_rules.counted_as_gpu): count a GPU's ops",
    )
    ap.add_argument("--workload", default="default", help="the bench's tables (default) or a stats file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(args, free_port(), out), nprocs=args.nproc, start_method="spawn")
        print(Path(out, "profile.txt").read_text())


if __name__ == "__main__":
    main()
