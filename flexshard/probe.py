"""``flexshard probe``: measure the cluster this job runs on and write its topology JSON.

Under a launcher (torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
every rank runs the probe; without one, ``--nproc N`` local processes are spawned on the loopback
interface (gloo on CPU), so ``flexshard probe --out topo.json`` works on a single machine.

Each host asks NVML for its GPUs (the first rank of the host; a host without NVML says so in one line and
the probe falls back to measurements alone), then every rank times point-to-point transfers and
collectives (:mod:`topology.probe.timing`). Rank 0 builds the topology (the NVML graph of the job
with measured numbers on its edges, or a graph made from the measurements), writes it atomically and
prints the groups, a bandwidth table per link class and the slow parts. Every wait is bounded by
``--timeout``; a rank that never joins or stops answering ends the probe with one line naming it.

    torchrun --nnodes 2 --nproc-per-node 8 ... -m flexshard.probe --out topo.json
    flexshard probe --nproc 4 --groups 2 --quick --out topo.json
"""

from __future__ import annotations

import argparse
import logging
import os
import queue as queue_module
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from core.errors import ConfigError, InputError, ProbeError
from core.osutil import check_writable, on_a_free_port
from core.ranks import RankLayout
from flexshard import logs
from flexshard.cli_common import Parser, first_line, positive_float, positive_int
from flexshard.progress import Progress
from topology import cluster_view, summary, write_json
from topology.probe.measurements import Measurements, ProbeConfig, RankInfo
from topology.probe.nominal_graph import merge_hosts
from topology.probe.nvml import probe_host
from topology.probe.results import measured_graph, report, restrict_to_job
from topology.probe.session import all_gather, gather_rank_info, init_probe_group, rendezvous
from topology.probe.timing import measure

LAUNCHER_ENV = ("RANK", "WORLD_SIZE")

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--out",
        help="topology JSON to write (rank 0; atomically, only on success; default: report only)",
    )
    p.add_argument("--quick", action="store_true", help="fewer message sizes and repeats (default: all)")
    p.add_argument(
        "--repeats",
        type=positive_int,
        help=f"timed repeats per message size, whose median is fitted (default {ProbeConfig.repeats}; "
        f"{ProbeConfig.quick().repeats} with --quick)",
    )
    p.add_argument(
        "--timeout", type=positive_float, default=60.0, help="seconds any rank may wait (default 60)"
    )
    p.add_argument(
        "--groups",
        type=positive_int,
        help="G groups of consecutive ranks (default: NVML's NVLink domains, else one group per host)",
    )
    p.add_argument(
        "--nproc", type=positive_int, default=2, help="local processes when not under a launcher (default 2)"
    )
    p.add_argument(
        "--world-size",
        type=positive_int,
        help="ranks to wait for when spawning locally (default --nproc; more waits for other machines)",
    )
    p.add_argument("--name", default="probe", help="topology name (default 'probe')")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m flexshard.probe", description=__doc__.splitlines()[0])
    add_arguments(parser)
    logs.add_log_level(parser)
    return parser


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options = {k: getattr(args, k) for k in ("out", "quick", "repeats", "timeout", "groups", "name")}
    options["log_level"] = getattr(args, "log_level", logs.DEFAULT_LOG_LEVEL)  # for spawned ranks
    return options


def _nvml_notes(hosts: dict[str, Any]) -> list[str]:
    """One line per distinct reason NVML was unavailable, naming the hosts."""
    reasons: dict[str, list[str]] = {}
    for host, probe in hosts.items():
        if isinstance(probe, str):
            reasons.setdefault(probe.split(";")[0], []).append(host)
    return [
        f"{reason} on {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}; "
        "falling back to collective measurements"
        for reason, names in reasons.items()
    ]


def _job_graph(
    rank: int, infos: Sequence[RankInfo], timeout: float, store: Any, name: str
) -> tuple[Any, list[str]]:
    """The job's NVML graph (ranks = torch ranks), or None with one note per reason it cannot be used.

    The first rank of each host asks NVML; any NVML trouble there means: measure instead.
    """
    first_of_host: dict[str, int] = {}
    for info in infos:
        first_of_host.setdefault(info.host, info.rank)
    mine: Any = None
    if first_of_host[infos[rank].host] == rank:
        try:
            mine = probe_host(host=infos[rank].host)
        except Exception as err:  # no driver, no library, a VM that answers oddly: noted, then measured
            mine = first_line(err)
    gathered = all_gather(mine, "nvml", timeout, store)
    probes = {infos[r].host: gathered[r] for r in first_of_host.values()}
    notes = _nvml_notes(probes)
    if notes or not probes:
        return None, notes
    if not all(i.device.startswith("cuda") for i in infos):
        return None, ["ranks run on CPU; NVML links are not used, only collective measurements"]
    base = restrict_to_job(merge_hosts(list(probes.values()), name=name), infos)
    if base is None:
        notes.append("NVML GPUs do not match the job's ranks; using collective measurements")
    return base, notes


def _groups(
    options: dict[str, Any], world_size: int, base: Any, infos: Sequence[RankInfo]
) -> tuple[RankLayout, list[str]]:
    """The groups to measure and their names: ``--groups`` G groups of consecutive ranks, else the NVML
    graph's NVLink domains, else one group per host."""
    if options.get("groups"):
        layout = RankLayout.consecutive(world_size, int(options["groups"]), "--groups")
        return layout, [f"g{k}" for k in range(layout.num_groups)]
    if base is not None:
        layout = RankLayout.of(cluster_view(base).groups, world_size)
        return layout, [base.nodes[_gpu_of(base, g[0])]["group"] for g in layout.groups]
    layout = RankLayout.by_host([i.host for i in infos])
    return layout, [infos[g[0]].host for g in layout.groups]


def _measure_with_progress(
    layout: RankLayout, names: list[str], config: ProbeConfig, infos: Sequence[RankInfo], store: Any
) -> Measurements:
    """:func:`measure` with a progress bar on rank 0's stderr."""
    bar: Progress | None = None

    def progress(done: int, total: int, note: str) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(total, "probe")
        bar.done = done
        bar.note(note)

    try:
        return measure(layout.groups, config, infos=infos, store=store, progress=progress, group_names=names)
    finally:
        if bar is not None:
            bar.__exit__()


def run_rank(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    options: dict[str, Any],
    *,
    client_only: bool = False,
    backend: str | None = None,
) -> str | None:
    """Run the probe as ``rank``; rank 0 writes ``options["out"]`` and returns the report text."""
    import torch.distributed as dist

    timeout = float(options["timeout"])
    store = rendezvous(rank, world_size, master_addr, master_port, timeout, client_only=client_only)
    try:
        init_probe_group(rank, world_size, store, timeout, backend)
    except RuntimeError as err:
        raise ProbeError(f"rank {rank}: cannot start the process group: {str(err).splitlines()[0]}") from None
    try:
        infos = gather_rank_info(timeout, store)
        base, notes = _job_graph(rank, infos, timeout, store, options["name"])
        layout, names = _groups(options, world_size, base, infos)
        if base is not None and options.get("groups"):  # the NVML graph takes the groups asked for
            for k, members in enumerate(layout.groups):
                for r in members:
                    base.nodes[_gpu_of(base, r)]["group"] = names[k]
        config = ProbeConfig.quick(timeout_s=timeout) if options.get("quick") else ProbeConfig()
        config = replace(config, timeout_s=timeout, repeats=options.get("repeats") or config.repeats)
        m = _measure_with_progress(layout, names, config, infos, store)
    except RuntimeError as err:  # a torch error the probe did not wrap: keep it to one line
        raise ProbeError(f"rank {rank}: {str(err).strip().splitlines()[-1][:200]}") from None
    # after a failure the group is left as is (tearing it down can wait on a dead peer); the process ends
    dist.destroy_process_group()
    if rank != 0:
        return None
    G = measured_graph(m, base, name=options["name"])
    if options.get("out"):
        write_json(G, options["out"])
    return probe_text(m, G, notes)


def probe_text(m: Any, G: Any, notes: list[str]) -> str:
    """What the probe prints for measurements ``m`` and their graph ``G``: the notes, the report (with
    the one count of slow parts, as measured) and the graph's summary without its slow links (the same
    parts seen on the graph's edges)."""
    return "\n".join([*notes, report(m), "", summary(G, slow=False)])


def _gpu_of(G: Any, rank: int) -> Any:
    return next(n for n, a in G.nodes(data=True) if a.get("kind") == "gpu" and a["rank"] == rank)


def _child(rank: int, world_size: int, port: int, nproc: int, options: dict[str, Any], results: Any) -> None:
    """One spawned rank: runs the probe and reports to the parent ("ok", text), ("error", one line) for
    bad input or a failed probe, or ("bug", traceback) for anything else."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # a peer's failure is reported once, by us
    import torch

    logs.configure(options.get("log_level", logs.DEFAULT_LOG_LEVEL))  # a fresh interpreter (spawn)

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(world_size)
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if 0 < nproc <= gpus else "gloo"  # one GPU per local rank, else CPU
    code = 0
    try:
        text = run_rank(rank, world_size, "127.0.0.1", port, options, backend=backend)
        results.put(("ok", rank, text))
    except InputError as err:
        results.put(("error", rank, first_line(err)))
        code = 1
    except Exception as err:  # a bug: the parent shows its traceback
        results.put(("bug", rank, "".join(traceback.format_exception(err)).rstrip()))
        code = 1
    except BaseException as err:  # interrupted
        results.put(("error", rank, first_line(err)))
        code = 1
    results.close()
    results.join_thread()
    sys.stdout.flush()
    os._exit(code)  # no teardown of a process group a dead peer may still hold


def spawn_local(options: dict[str, Any], nproc: int, world_size: int | None = None) -> str:
    """Run the probe in ``nproc`` local processes (ranks 0..nproc-1 of ``world_size``); rank 0's report.

    A rank's bad input or failed probe raises :class:`ProbeError` with its line (the lowest such rank's);
    a bug in a rank raises ``RuntimeError`` carrying that rank's traceback. When every rank is local and
    rank 0 could not host the rendezvous store because its port was taken (another process bound it
    after :func:`core.osutil.free_port` chose it), the probe starts again on another port, up to
    ``RENDEZVOUS_TRIES`` times.
    """
    world_size = world_size or nproc
    if world_size < nproc:
        raise ConfigError(f"--world-size {world_size}: smaller than --nproc {nproc}")
    return on_a_free_port(
        lambda port: _spawn_once(options, nproc, world_size, port),
        lambda err: isinstance(err, ProbeError) and world_size == nproc and store_port_taken(str(err)),
    )


def store_port_taken(line: str) -> bool:
    """Whether a probe's error line says that rank 0 could not host the rendezvous store on a port that
    another process holds (nothing of the probe ran)."""
    return line.startswith("rank 0: cannot host the rendezvous store") and "EADDRINUSE" in line


def _spawn_once(options: dict[str, Any], nproc: int, world_size: int, port: int) -> str:
    """:func:`spawn_local` on rendezvous port ``port``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, nproc, options, results), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    errors: dict[int, str] = {}
    bugs: dict[int, str] = {}
    grace_until: float | None = None
    try:
        while len(got) < nproc:
            if grace_until is not None and time.monotonic() > grace_until:
                break
            try:
                status, rank, payload = results.get(timeout=0.1)
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r not in got and p.exitcode is not None and r not in errors:
                        time.sleep(0.2)  # its message may still be in flight
                        if results.empty():
                            errors[r] = f"rank {r} exited with code {p.exitcode} before reporting"
                            got[r] = ("error", errors[r])
                if errors and grace_until is None:
                    grace_until = time.monotonic() + min(float(options["timeout"]), 5.0)
                continue
            got[rank] = (status, payload)
            if status != "ok":
                (bugs if status == "bug" else errors)[rank] = payload
                if grace_until is None:
                    grace_until = time.monotonic() + min(float(options["timeout"]), 5.0)
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors or bugs else 5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
    if bugs:
        raise RuntimeError(f"rank {min(bugs)} of the probe failed:\n{bugs[min(bugs)]}")
    if errors:
        raise ProbeError(errors[min(errors)])
    return str(got[0][1])


def run(args: argparse.Namespace) -> int:
    """The ``flexshard probe`` command: under a launcher run this rank, else spawn ``--nproc`` ranks.

    Flags and the ``--out`` path are checked before any process starts.
    """
    options = _options(args)
    if args.out:
        check_writable(args.out, "--out")
    launched = all(k in os.environ for k in LAUNCHER_ENV)
    if args.groups:
        world = int(os.environ["WORLD_SIZE"]) if launched else args.world_size or args.nproc
        RankLayout.consecutive(world, args.groups, "--groups")
    if launched:
        if args.world_size is not None:
            raise ConfigError("--world-size: only for local runs; under a launcher WORLD_SIZE decides")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise ConfigError("MASTER_PORT: not set; launch with torchrun or set MASTER_ADDR and MASTER_PORT")
        client_only = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        text = run_rank(rank, world, addr, int(os.environ["MASTER_PORT"]), options, client_only=client_only)
    else:
        text = spawn_local(options, args.nproc, args.world_size)
    if text:  # rank 0's report, and its file
        print(text)
        if args.out:
            log.info(f"wrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flexshard.probe``: bad input prints one line and exits 2; a bug keeps its traceback."""
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        return run(args)
    except InputError as e:  # ProbeError, ConfigError, OutputError, TopologyError
        print(f"flexshard probe: error: {first_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
