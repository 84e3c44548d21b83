"""Progress off a terminal: periodic log lines with the rate and the time left (a fake clock); on a
terminal the bar shows them too; nothing above INFO."""

from __future__ import annotations

import pytest

from flexshard import logs
from flexshard.progress import Progress


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    logs.configure("info")
    return Clock()


def _run(clock: Clock, times: list[float], total: int = 8, **kwargs) -> None:
    """Advance one step at each of ``times`` (seconds after the start), then finish at the last."""
    with Progress(total, "simulate", clock=clock, tty=False, **kwargs) as bar:
        start = clock.now
        for k, t in enumerate(times):
            clock.now = start + t
            bar.advance(f"step {k + 1}")


def test_periodic_lines_with_rate_and_time_left_off_a_terminal(clock, capsys):
    # 2 done after 12 s: 1/6 per second, 6 left -> 36 s; 6 done after 30 s: 0.2/s, 2 left -> 10 s;
    # the last line 10 s after the previous one at the earliest; 8 done after 40 s: a closing line
    _run(clock, [5.0, 12.0, 15.0, 21.9, 22.0, 30.0, 31.0, 40.0])
    assert capsys.readouterr().err.splitlines() == [
        "simulate: 2/8 (25%) after 12 s, 0.167/s, 36 s left (step 2)",
        "simulate: 5/8 (62%) after 22 s, 0.227/s, 13 s left (step 5)",
        "simulate: 8/8 done in 40 s",
    ]


def test_short_work_says_nothing_off_a_terminal(clock, capsys):
    _run(clock, [1.0, 2.0, 9.9])
    assert capsys.readouterr().err == ""


def test_minutes_and_hours_left(clock, capsys):
    _run(clock, [600.0], total=200)  # 1 step in 10 min: 199 steps at 600 s -> 33 h 10 min
    assert capsys.readouterr().err.splitlines() == [
        "simulate: 1/200 (0%) after 10 min 00 s, 0.00167/s, 33 h 10 min left (step 1)",
        "simulate: 1/200 in 10 min 00 s",  # the work ended early: not "done"
    ]


def test_the_interval_is_a_parameter(clock, capsys):
    _run(clock, [1.0, 2.0, 3.0, 4.0], every_s=2.0)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "simulate: 2/8 (25%) after 2 s, 1/s, 6 s left (step 2)",
        "simulate: 4/8 (50%) after 4 s, 1/s, 4 s left (step 4)",
        "simulate: 4/8 in 4 s",
    ]


def test_above_info_nothing_is_shown(clock, capsys):
    logs.configure("warning")
    _run(clock, [20.0, 40.0])
    with Progress(2, "plan", clock=clock, tty=True) as bar:
        bar.advance()
    assert capsys.readouterr().err == ""
    logs.configure("info")


def test_the_terminal_bar_shows_the_rate_and_the_time_left(clock, capsys):
    with Progress(4, "plan", clock=clock, tty=True) as bar:
        clock.now += 3.0
        bar.advance("x")
    err = capsys.readouterr().err
    assert err.startswith("\rplan [")
    assert "1/4   3.0s 0.333/s, 9 s left" in err and err.endswith("\n")
