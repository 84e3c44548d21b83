"""Python's garbage collector kept out of the steps (flexshard.training.garbage): off inside the block
and restored after it, a full collection on entry, the young generations every N steps; 0 changes
nothing."""

from __future__ import annotations

import gc

import pytest

from core.errors import ConfigError
from flexshard.training.garbage import StepGarbageCollection


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # only the cyclic collector frees it


def _cycles_alive() -> int:
    return sum(isinstance(o, _Cycle) for o in gc.get_objects())


def test_off_inside_collected_every_n_steps_and_restored_after():
    assert gc.isenabled()
    with StepGarbageCollection(3) as collector:
        assert not gc.isenabled() and collector.collections == 1  # the full collection on entry
        _Cycle()
        for step in range(2):  # steps 0 and 1: no collection
            collector.after_step(step)
        assert collector.collections == 1 and _cycles_alive() == 1
        collector.after_step(2)  # the 3rd step: generations 0 and 1 collected, the cycle with them
        assert collector.collections == 2 and _cycles_alive() == 0
        collector.after_step(5)
        assert collector.collections == 3 and collector.collected_s >= 0.0
    assert gc.isenabled()


def test_zero_changes_nothing_and_a_disabled_collector_stays_disabled():
    with StepGarbageCollection(0) as collector:
        assert gc.isenabled()
        collector.after_step(0)
        assert collector.collections == 0
    gc.disable()
    try:
        with StepGarbageCollection(2):
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_period_is_one_line(value):
    with pytest.raises(ConfigError, match=r"--gc-every: must be an integer >= 0"):
        StepGarbageCollection(value)
