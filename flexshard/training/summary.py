"""The end of a training run in a few lines: steps, final loss, throughput, and the bytes each link class
carried per step beside what the plan predicted.

Rank 0 prints it on stdout after the last step, also under ``--quiet`` (it is the run's result, not a log
line). Bytes are the busiest rank's per step (``max(send, recv)`` over the components, as the step
lines show them), averaged over the steps this run did; the plan's prediction is the cost model's
expected bytes of its busiest rank per iteration (``predicted`` in the plan file). Expected bytes of
random batches: a step's busiest rank is a maximum over ranks of random counts, so on small batches it
sits somewhat above the prediction of the busiest rank's mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from core.vocabulary import LinkClass
from flexshard.plan_file import PlanFile
from flexshard.report import format_table


@dataclass
class RunSummary:
    """Running totals of the steps one run did (``add`` once per step, on every rank alike)."""

    world: int  # ranks
    batch_size: int  # samples per rank and step
    start: int = 0  # steps done before this run (a resumed run)
    steps: int = 0
    final_loss: float = float("nan")
    step_s: float = 0.0  # the slowest rank's step times, summed, in seconds
    link_bytes: dict[str, float] = field(default_factory=lambda: {link.label: 0.0 for link in LinkClass})

    def add(self, loss: float, elapsed_s: float, busiest_bytes: Mapping[str, float]) -> None:
        """One step: the global mean ``loss``, the slowest rank's time in seconds and each link class's
        busiest-rank bytes (keyed by the link class label)."""
        self.steps += 1
        self.final_loss = loss
        self.step_s += elapsed_s
        for label in self.link_bytes:
            self.link_bytes[label] += float(busiest_bytes[label])

    def lines(self, plan_file: PlanFile, sample_placement: str = "off") -> list[str]:
        """The summary's lines (the figures of the plan, its ``predicted`` bytes and overrides, from
        ``plan_file``)."""
        if not self.steps:
            return [f"summary: no steps run (resumed at step {self.start}, already --steps)"]
        samples = self.steps * self.world * self.batch_size
        rate = samples / self.step_s if self.step_s > 0 else float("nan")
        span = f"steps {self.start + 1}-{self.start + self.steps}"
        head = (
            f"summary: {self.steps} steps ({span}), final loss {self.final_loss:.6f}, {rate:,.0f} samples/s "
            f"({samples:,} samples in {self.step_s:.3f} s of steps, the slowest rank's)"
        )
        applies = not (plan_file.overrides or plan_file.left_out)
        rows = []
        for label, total in self.link_bytes.items():
            measured = total / self.steps
            predicted = float(plan_file.predicted.get(f"{label}_bytes", 0.0)) if applies else None
            rows.append([label, f"{measured:,.0f} B", *_beside(measured, predicted)])
        table = format_table(
            ["bytes per step", "measured (busiest rank, mean)", "plan's prediction", "measured vs plan"],
            rows,
        )
        lines = [head, *table.splitlines()]
        if plan_file.overrides:
            overridden = ", ".join(plan_file.overrides)
            lines.append(f"the plan's prediction does not apply: this run overrides its {overridden}")
        if plan_file.left_out:
            lines.append(f"the plan's prediction does not apply: {left_out_note(plan_file)}")
        if sample_placement != "off":
            lines.append(
                f"measured bytes include moving samples (sample placement {sample_placement}), which the "
                "plan does not price"
            )
        return lines


def left_out_note(plan_file: PlanFile) -> str:
    """What a plan restricted to a run's tables (:meth:`PlanFile.restricted_to`) leaves out, and how to
    make one whose prediction covers just these tables."""
    kept = ",".join(t.name for t in plan_file.tables)
    return (
        f"it also prices the tables {', '.join(plan_file.left_out)}, which this run does not look up "
        f"(make the plan with --tables {kept} to price these alone)"
    )


def _beside(measured: float, predicted: float | None) -> list[str]:
    """The prediction and the measured bytes relative to it ("-" where there is none to compare)."""
    if predicted is None:
        return ["-", "-"]
    if predicted <= 0:
        return [f"{predicted:,.0f} B", "-" if measured <= 0 else "none predicted"]
    return [f"{predicted:,.0f} B", f"{measured / predicted - 1:+.1%}"]
