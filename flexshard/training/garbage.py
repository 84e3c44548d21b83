"""Python's garbage collector kept out of the steps, as torchtitan's trainer keeps it
(``torchtitan.tools.utils.GarbageCollection``): automatic collection off while the steps run, one full
collection when they start and a collection of the young generations every ``every_steps`` steps, at
the same step on every rank (a pause on one rank holds every other rank at its next collective).

Automatic collection runs when allocations pass a threshold, so it falls inside steps at random, and
each collection of the older generations walks every tracked object of the process: at 8 gloo ranks and
batch 64 a benchmark rank spent 3.7 ms of its 12.4 ms of CPU a step in the collector (18 collections in
40 steps over about 270,000 tracked objects; ``experiments/profile_step.py``). Python's ``timeit`` turns
it off while it times for the same reason.

With the collector off, memory held in a reference cycle stays until the next collection, so a step
must leave none: the runtime's steps, plain and pipelined, free every buffer by reference counting
(``tests/runtime/test_reference_cycles.py``; until 2026-11-26 each batch's ``PendingInput`` held its
own finishing step, and with it the batch's routed lookups and received ids, in a cycle).
"""

from __future__ import annotations

import gc
import time

from core.errors import ConfigError

DEFAULT_EVERY_STEPS = 50  # torchtitan's default gc_freq


class StepGarbageCollection:
    """``with StepGarbageCollection(50) as collector: ... collector.after_step(step)``: inside the block
    automatic collection is off (restored on exit), with one full collection on entry and generations 0
    and 1 collected after every ``every_steps``-th step (``step`` counts from 0). ``every_steps`` 0:
    nothing changes (Python collects as it does by default). ``collected_s``: seconds spent in the
    collections it ran."""

    def __init__(self, every_steps: int = DEFAULT_EVERY_STEPS) -> None:
        if not isinstance(every_steps, int) or isinstance(every_steps, bool) or every_steps < 0:
            raise ConfigError(f"--gc-every: must be an integer >= 0, got {every_steps!r}")
        self.every_steps = every_steps
        self.collected_s = 0.0
        self.collections = 0
        self._was_enabled = False

    def __enter__(self) -> StepGarbageCollection:
        self._was_enabled = gc.isenabled()
        if self.every_steps:
            self.collect(generation=2)  # what the set-up left
            gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.every_steps and self._was_enabled:
            gc.enable()

    def after_step(self, step: int) -> None:
        """Collect the young generations after step ``step`` (from 0) when ``step + 1`` is a multiple of
        ``every_steps``."""
        if self.every_steps and (step + 1) % self.every_steps == 0:
            self.collect()

    def collect(self, generation: int = 1) -> float:
        """One collection of generations 0..``generation`` now; returns its seconds."""
        t0 = time.perf_counter()
        gc.collect(generation)
        dt = time.perf_counter() - t0
        self.collected_s += dt
        self.collections += 1
        return dt
