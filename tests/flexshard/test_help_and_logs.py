"""``--help`` of every command has help text and the default of every option; ``--log-level`` (and
train's ``--quiet``) picks which messages reach stderr, while results stay on stdout."""

from __future__ import annotations

import argparse
import re

import pytest
from cli_helpers import fails, run

from flexshard import cli, probe
from flexshard.logs import LOG_LEVELS
from flexshard.training import config

SMALL = ["--workload", "synthetic:6:2e6:1.0", "--topology", "h100:2x2"]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser a user can ask for --help: flexshard, each of its subcommands, train and probe."""
    top = cli.build_parser()
    found = {"flexshard": top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update({f"flexshard {name}": p for name, p in action.choices.items()})
    found["python -m flexshard.train"] = config.build_parser()
    found["python -m flexshard.probe"] = probe.build_parser()
    return found


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Options without help text, or whose help does not give the default. Exempt from the default:
    -h, the subcommand choice, required options, and switches without a value (store_true,
    --dedup/--no-dedup: off unless given, or as their help says)."""
    missing = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = action.help or ""
        if not text.strip() or text == argparse.SUPPRESS:
            missing.append(f"{name}: no help text")
        elif action.option_strings and not action.required and action.nargs != 0 and "default" not in text:
            missing.append(f"{name}: help does not give the default ({action.default!r})")
    return missing


def test_every_option_of_every_command_has_help_and_its_default():
    parsers = _parsers()
    assert {"flexshard plan", "flexshard simulate", "flexshard stats", "flexshard probe"} <= set(parsers)
    problems = {name: _undocumented(p) for name, p in parsers.items()}
    assert {name: found for name, found in problems.items() if found} == {}
    for p in parsers.values():
        p.format_help()  # every %(default)s expands


def test_the_walk_finds_an_undocumented_option():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=2.0)
    p.add_argument("--strategy", default="flexshard", help="how rows are placed")
    p.add_argument("--json", action="store_true", help="print JSON")
    assert _undocumented(p) == [
        "--budget: no help text",
        "--strategy: help does not give the default ('flexshard')",
    ]


@pytest.mark.parametrize(
    ("command", "option", "default"),
    [("plan", "--strategy", "flexshard"), ("plan", "--budget", "2.0"), ("simulate", "--dedup", "on")],
)
def test_help_shows_the_issues_options_with_their_defaults(capsys, command, option, default):
    parser = _parsers()[f"flexshard {command}"]
    action = next(a for a in parser._actions if option in a.option_strings)
    expanded = parser._get_formatter()._expand_help(action)
    assert f"default {default})" in expanded
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert " ".join(expanded.split()) in " ".join(capsys.readouterr().out.split())


def _figures(report: str) -> str:
    """A plan report without the solver's seconds (they differ from run to run)."""
    return re.sub(r"[0-9.]+ s$", "", report, flags=re.MULTILINE)


def test_info_lines_go_to_stderr_and_the_level_flag_filters_them(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    rc, out, err = run(capsys, "plan", *SMALL, "--out", str(plan))
    assert rc == 0 and err.splitlines() == [f"wrote {plan}"] and "wrote" not in out  # plain INFO line
    report = out
    rc, out, err = run(capsys, "--log-level", "warning", "plan", *SMALL, "--out", str(plan))
    assert rc == 0 and err == "" and _figures(out) == _figures(report)  # results unchanged, info hidden
    rc, out, err = run(capsys, "plan", *SMALL, "--out", str(plan), "--log-level", "error")
    assert rc == 0 and err == "" and _figures(out) == _figures(report)  # after the subcommand too
    rc, out, err = run(capsys, "simulate", *SMALL, "--budgets", "2", "--strategies", "flexshard,row_wise")
    assert rc == 0 and err == ""
    rc, out_debug, err = run(capsys, "--log-level", "debug", "simulate", *SMALL, "--budgets", "2")
    assert rc == 0 and "debug: simulate: flexshard at 2x, dedup on: " in err.splitlines()[0]
    assert (
        "debug: simulate: row_wise at 2x, dedup off: " in err
    )  # the TorchRec default priced for the headline
    assert "debug" not in out_debug


def test_an_error_is_one_line_whatever_the_level(tmp_path, capsys):
    for level in LOG_LEVELS:
        line = fails(capsys, "--log-level", level, "plan", *SMALL, "--budget", "0.1")
        assert line.startswith("flexshard plan: error: ")
    with pytest.raises(SystemExit) as e:
        cli.main(["--log-level", "loud", "plan"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--log-level" in line and "'loud'" in line


def test_the_top_level_flag_reaches_train(monkeypatch, capsys):
    """`flexshard --log-level warning train ...` is `flexshard train --log-level warning ...`: no log lines,
    the summary on stdout."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = run(capsys, "--log-level", "warning", "train", "--steps", "1", "--batch-size", "16")
    assert rc == 0 and err == "" and out.startswith("summary: 1 steps (steps 1-1), final loss ")
