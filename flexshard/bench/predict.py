"""The time model's prediction of a strategy's step on the machine the benchmark runs on (the one call).

:func:`solvers.time_model.step_time` prices a step as the latency of its scheduled collectives plus
bytes over bandwidth plus local work. On the probed view of the running job its defaults are the
machine's own figures: the collective latencies the quick probe measured (the view's
``collective_latency_us``) and the local-work rates measured on a CPU machine
(:meth:`solvers.time_types.LocalRates.for_view`).

Where the job's torch threads outnumber the host's cores (``threads_per_core`` > 1: its ranks times
their threads over the cores, :func:`flexshard.bench.worker.threads_per_core`; gloo on a CPU machine), the
cores work through every rank's share in turn: the work of a step (bandwidth and local work, priced
at the ranks' share of the cores) takes about the larger of the ranks' mean and the busiest rank's on
a core of its own (its priced work over ``threads_per_core``), not the busiest rank's at its share
(:func:`shared_core_factor`). A plan whose owners' shares are even is priced as before.
"""

from __future__ import annotations

from solvers.schedule import Stage
from solvers.time_model import step_time
from solvers.time_types import LatencyTable, LocalRates, StepTime
from solvers.types import Plan, Workload
from topology.views import ClusterView


def predicted_parts_ms(
    workload: Workload,
    view: ClusterView,
    plan: Plan,
    latency: LatencyTable | None = None,
    rates: LocalRates | None = None,
    local_s: float | None = None,
    threads_per_core: float = 1.0,
    stages: tuple[Stage, ...] | None = None,
) -> dict[str, float]:
    """The modeled step time of ``plan`` on ``view`` (slowest rank) and its parts, ms: ``total`` = ``latency``
    + ``bandwidth`` + ``local``; ``host``, of ``local``: the runtime's host work around its collectives
    (:meth:`~solvers.time_types.LocalRates.host_s` of the rates; 0 with ``local_s``), what
    ``experiments/calibrate_local.py --host-from`` fits again from measured steps. ``latency`` and
    ``rates``: as :func:`~solvers.time_model.step_time` takes them (None: the view's); ``local_s``: the
    local work of a step measured as a whole, its copies into and out of the exchange's buffers included
    (another implementation's, e.g. TorchRec's,
    :func:`~flexshard.bench.results.thread_cpu_s`), in place of the modeled local work.
    ``threads_per_core``: the job's torch threads on this host per core (more than 1:
    :func:`shared_core_factor` scales bandwidth and local work). ``stages``: the collectives of another
    implementation's step (TorchRec's: :func:`solvers.schedule.torchrec_schedule`)."""
    st = step_time(workload, view, plan, latency=latency, rates=rates, stages=stages)
    local = st.local_s if local_s is None else local_s
    host = st.local_by_piece["host"] if local_s is None else 0.0
    f = shared_core_factor(st, threads_per_core)
    parts = {"latency": st.latency_s, "bandwidth": f * st.bandwidth_s, "local": f * local}
    ms = {"total": sum(parts.values()) * 1e3} | {k: v * 1e3 for k, v in parts.items()}
    return ms | {"host": f * host * 1e3}


def shared_core_factor(st: StepTime, threads_per_core: float) -> float:
    """What share of the busiest rank's work (bandwidth and local, priced at its share of the cores) a
    step takes on a host where ``threads_per_core`` threads share each core: ``max(mean, busiest /
    threads_per_core) / busiest`` over the ranks' work (:attr:`StepTime.per_rank_total_s` less the
    latency); 1 with a core per rank, or with even work."""
    work = st.per_rank_total_s - st.latency_s
    busiest = float(work.max()) if work.size else 0.0
    if threads_per_core <= 1 or busiest <= 0:
        return 1.0
    return max(float(work.mean()), busiest / threads_per_core) / busiest
