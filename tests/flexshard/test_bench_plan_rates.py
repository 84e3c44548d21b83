"""``flexshard bench --plan-for probed``: the plans for the running machine are made with the local-work
rates its prediction prices them with, so the planner picks by the step the bench predicts; plans for
another shape (``--plan-for h100``) keep that shape's own rates."""

from __future__ import annotations

from core.vocabulary import FetchMode
from flexshard.bench.data import default_data
from flexshard.bench.plans import h100_view, make_plans
from solvers.time_types import LocalRates


def _fetch(plans: dict) -> set[FetchMode]:
    return {tp.fetch for tp in plans["flexshard"].plan.tables}


def test_plans_for_the_running_machine_are_made_with_its_rates():
    data = default_data(512, 0, 8)
    machine = h100_view(8, 2)  # the running machine's view (here the H100 shape, priced at CPU rates)
    cpu = LocalRates.default()
    here = make_plans(data, machine, machine, 2.0, False, "step", cpu)
    # at the CPU's rates the group fetch's relay costs more than its bytes save: every table flat, and
    # FlexShard's predicted step is at most the row-wise ablation's
    assert _fetch(here) == {FetchMode.FLAT}
    assert here["flexshard"].predicted_ms <= here["row_wise"].predicted_ms * (1 + 1e-9)
    # planned for another view (an equal one, not the machine's): its own (GPU) rates pick the group fetch,
    # which the CPU's rates then price above the ablation
    other = make_plans(data, h100_view(8, 2), machine, 2.0, False, "step", cpu)
    assert _fetch(other) == {FetchMode.GROUP}
    assert other["flexshard"].predicted_ms > other["row_wise"].predicted_ms
    # without rates of the machine, both are planned with the view's own
    assert _fetch(make_plans(data, machine, machine, 2.0, False, "step", None)) == {FetchMode.GROUP}
