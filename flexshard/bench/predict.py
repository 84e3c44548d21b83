"""The time model's prediction of a strategy's step on the machine the benchmark runs on (the one call).

``solvers.time_model.step_time(workload, view, plan, latency=None, rates=None) -> StepTime`` (fields
``total_s``, ``latency_s``, ``bandwidth_s``, ``local_s``, ``collectives``) prices a step as latency plus
bytes over bandwidth plus local work. Where that module is not installed the prediction is None and the
report says why (:data:`MISSING`).
"""

from __future__ import annotations

from typing import Any

from solvers.types import Plan, Workload
from topology.views import ClusterView

MISSING = "needs solvers.time_model"


def time_model_available() -> bool:
    """Whether ``solvers.time_model.step_time`` can be imported."""
    try:
        from solvers.time_model import step_time  # noqa: F401
    except ImportError:
        return False
    return True


def predicted_step_ms(
    workload: Workload, view: ClusterView, plan: Plan, latency: Any = None, rates: Any = None
) -> float | None:
    """The modeled step time of ``plan`` on ``view``, ms (slowest rank, latency + bandwidth + local work);
    None without :mod:`solvers.time_model`. ``latency`` and ``rates``: the machine's measured collective
    latencies and local-work rates, as ``step_time`` takes them (None: its defaults)."""
    try:
        from solvers.time_model import step_time
    except ImportError:
        return None
    return float(step_time(workload, view, plan, latency=latency, rates=rates).total_s) * 1e3
