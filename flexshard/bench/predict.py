"""The time model's prediction of a strategy's step on the machine the benchmark runs on (the one call).

:func:`solvers.time_model.step_time` prices a step as the latency of its scheduled collectives plus
bytes over bandwidth plus local work. On the probed view of the running job its defaults are the
machine's own figures: the collective latencies the quick probe measured (the view's
``collective_latency_us``) and the local-work rates measured on a CPU machine
(:meth:`solvers.time_types.LocalRates.for_view`).
"""

from __future__ import annotations

from solvers.time_model import step_time
from solvers.time_types import LatencyTable, LocalRates
from solvers.types import Plan, Workload
from topology.views import ClusterView


def predicted_parts_ms(
    workload: Workload,
    view: ClusterView,
    plan: Plan,
    latency: LatencyTable | None = None,
    rates: LocalRates | None = None,
    local_s: float | None = None,
) -> dict[str, float]:
    """The modeled step time of ``plan`` on ``view`` (slowest rank) and its parts, ms: ``total`` =
    ``latency`` + ``bandwidth`` + ``local``. ``latency`` and ``rates``: as
    :func:`~solvers.time_model.step_time` takes them (None: the view's); ``local_s``: the local work of a
    step measured as a whole (another implementation's, e.g. TorchRec's, on a one-rank group), in place
    of the modeled local work but for the exchange's buffer copies, which a one-rank group makes none of:
    those are priced as the runtime's own (the ``pack`` piece, :class:`~solvers.time_types.BufferCopies`:
    each value copied into a send buffer or out of a receive buffer)."""
    st = step_time(workload, view, plan, latency=latency, rates=rates)
    local = st.local_s if local_s is None else local_s + st.local_by_piece["pack"]
    parts = {"latency": st.latency_s, "bandwidth": st.bandwidth_s, "local": local}
    return {"total": (st.latency_s + st.bandwidth_s + local) * 1e3} | {k: v * 1e3 for k, v in parts.items()}
