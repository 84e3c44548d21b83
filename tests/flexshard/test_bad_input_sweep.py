"""Every bad input of issue 13 in one place, through the commands a user runs: each ends with exactly one
line naming the field and the value, exit status 2, and no output file.

The cases the issue found (and the early checks of its outputs) are below; their finer variants stay
with the code that checks them (plan files: test_plan_contract; sequence files: test_bad_inputs and the
readers' tests). An id under the limit whose per-row array does not fit in memory (4e9 on a small
machine) is a unit test of ``_text.grow``: whether it fits depends on the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import run

from flexshard.plan_file import to_dict, write_plan
from flexshard.training.data import SyntheticSource
from solvers.planner import budget_bytes, make_plan
from topology.views import uniform_view

SMALL = ["--steps", "1", "--batch-size", "16", "--quiet"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder of inputs: a plan for a one-rank training run and broken copies of it, a topology file
    with a broken link, sequence files with ids past the limit, a checkpoint with a garbage rank file."""
    root = tmp_path_factory.mktemp("sweep")
    workload = SyntheticSource(16, 20, 4, 16, 0).workload()
    view = uniform_view(1, 1, 450e9, 50e9)
    planned = make_plan("flexshard", workload, view, budget_bytes(workload, view, 2.0))
    doc = to_dict(planned.plan, workload, view, planned.report, "t")
    write_plan(root / "plan.json", doc)
    for name, change in {
        "nan_share": lambda d: d["tables"][0].update(cold_share=[float("nan")]),
        "negative_share": lambda d: d["tables"][0].update(cold_share=[-1.0]),
        "uncovered": lambda d: d["world"].update(groups=[[1]]),
        "string_hot_rows": lambda d: d["tables"][0].update(hot_rows="3"),
        "table_twice": lambda d: d["tables"].append(dict(d["tables"][0])),
    }.items():
        bad = json.loads((root / "plan.json").read_text())
        change(bad)
        (root / f"{name}.json").write_text(json.dumps(bad))
    (root / "binary.json").write_bytes(bytes(range(256)))
    assert run_quietly(["topology", "--topology", "h100:1x2", "--out", str(root / "topo.json")]) == 0
    topo = json.loads((root / "topo.json").read_text())
    topo["edges"][0]["bandwidth_GBps"] = -450.0
    (root / "bad_topo.json").write_text(json.dumps(topo))
    (root / "id_2_64.txt").write_text(f"1 {2**64 + 5} 3\n2 5 6\n")
    (root / "id_2_32.txt").write_text(f"1 {2**32} 3\n2 5 6\n")
    (root / "arabic_digit.txt").write_text("1 2 3\n2 \u0663 6\n", encoding="utf-8")  # '٣': int() takes it
    (root / "arabic_digit.csv").write_text("1,\u0663,3\n", encoding="utf-8")
    (root / "arabic_first.txt").write_text("1 \u0663 4\n", encoding="utf-8")  # on the line sniffed
    (root / "a_file").write_text("not a folder\n")
    ckpt = root / "ckpt"
    assert (
        run_quietly(["train", "--plan", str(root / "plan.json"), *SMALL, "--checkpoint-dir", str(ckpt)]) == 0
    )
    size = (ckpt / "step-00000001" / "rank0.pt").stat().st_size  # garbage of the recorded size: its hash
    (ckpt / "step-00000001" / "rank0.pt").write_bytes((b"\x00\x01garbage" * size)[:size])
    return root


def run_quietly(argv: list[str]) -> int:
    from flexshard.cli import main

    return main(argv)


CASES = {  # id: (argv with {d} for the folder of inputs, the one line expected on stderr, output path)
    "plan NaN cold_share": (
        ["train", "--plan", "{d}/nan_share.json", *SMALL],
        "flexshard train: error: plan file '{d}/nan_share.json': tables[0] ('item').cold_share: "
        "every share must be a finite number >= 0, got nan",
        None,
    ),
    "plan negative cold_share": (
        ["train", "--plan", "{d}/negative_share.json", *SMALL],
        "flexshard train: error: plan file '{d}/negative_share.json': tables[0] ('item').cold_share: "
        "every share must be a finite number >= 0, got -1.0",
        None,
    ),
    "plan groups not covering the ranks": (
        ["train", "--plan", "{d}/uncovered.json", *SMALL],
        "flexshard train: error: plan file '{d}/uncovered.json': world.groups: [[1]] must cover "
        "ranks 0..0 exactly once",
        None,
    ),
    "plan dim other than the model's": (
        ["train", "--plan", "{d}/plan.json", *SMALL, "--dim", "32"],
        "flexshard train: error: table 'item': the plan was made for dim 16, the model has dim 32: "
        "train with --dim 16, or make the plan with flexshard stats --dim 32, then flexshard plan",
        None,
    ),
    "binary plan file": (
        ["train", "--plan", "{d}/binary.json", *SMALL],
        "flexshard train: error: plan file '{d}/binary.json': not a text file (a plan file is JSON "
        "from `flexshard plan`)",
        None,
    ),
    "random-bytes checkpoint": (
        ["train", "--plan", "{d}/plan.json", "--steps", "2", "--checkpoint-dir", "{d}/ckpt", "--resume"],
        "flexshard train: error: checkpoint '{d}/ckpt/step-00000001': rank0.pt: its sha256 is not the one "
        "the manifest records (damaged, or a file of another checkpoint); no older checkpoint in {d}/ckpt "
        "would load either",
        None,
    ),
    "topology file with a negative bandwidth": (
        ["plan", "--topology", "{d}/bad_topo.json", "--out", "{d}/p1.json"],
        "flexshard plan: error: topology file '{d}/bad_topo.json': edge 'nvswitch/node0'-'node0/gpu0': "
        "field 'bandwidth_GBps' = -450.0; expected a finite number > 0",
        "{d}/p1.json",
    ),
    "id above 2^64": (
        ["stats", "{d}/id_2_64.txt", "--out", "{d}/s1.npz"],
        "flexshard stats: error: {d}/id_2_64.txt:1: field 'item id' value '18446744073709551621': "
        "ids of 4,294,967,296 and above need remapping to dense ids (or an explicit num_rows)",
        "{d}/s1.npz",
    ),
    "id of 2^32": (
        ["stats", "{d}/id_2_32.txt", "--out", "{d}/s2.npz"],
        "flexshard stats: error: {d}/id_2_32.txt:1: field 'item id' value '4294967296': ids of "
        "4,294,967,296 and above need remapping to dense ids (or an explicit num_rows)",
        "{d}/s2.npz",
    ),
    "preset over the size limit": (
        ["plan", "--topology", "h100:100000", "--out", "{d}/p2.json"],
        "flexshard plan: error: preset 'h100:100000': 800,000 GPUs, over the 32,768 a preset builds; "
        "describe a larger cluster in a topology file",
        "{d}/p2.json",
    ),
    "simulate --budgets ,": (
        ["simulate", "--budgets", ","],
        "flexshard simulate: error: argument --budgets: expected comma-separated multiples of "
        "row-wise memory, got ',' (see flexshard simulate --help)",
        None,
    ),
    "infeasible table_wise": (
        [
            "plan",
            "--strategy",
            "table_wise",
            "--budget",
            "0.5",
            "--topology",
            "h100:1x8",
            "--out",
            "{d}/p3.json",
        ],
        "flexshard plan: error: table_wise: table 'item_id' needs 96.11 GiB on one GPU, over the "
        "9.95 GiB budget",
        "{d}/p3.json",
    ),
    "plan --out in a missing folder": (
        ["plan", "--out", "{d}/missing/p.json"],
        "flexshard plan: error: --out: '{d}/missing/p.json': folder '{d}/missing' does not exist",
        None,
    ),
    "topology --out in a missing folder": (
        ["topology", "--topology", "h100:1x2", "--out", "{d}/missing/t.json"],
        "flexshard topology: error: --out: '{d}/missing/t.json': folder '{d}/missing' does not exist",
        None,
    ),
    "stats --out in a missing folder": (
        ["stats", "default", "--out", "{d}/missing/s.npz"],
        "flexshard stats: error: --out: '{d}/missing/s.npz': folder '{d}/missing' does not exist",
        None,
    ),
    "probe --out in a missing folder": (
        ["probe", "--nproc", "2", "--out", "{d}/missing/t.json"],
        "flexshard probe: error: --out: '{d}/missing/t.json': folder '{d}/missing' does not exist",
        None,
    ),
    "probe --repeats 0": (
        ["probe", "--repeats", "0"],
        "flexshard probe: error: argument --repeats: must be positive, got '0' (see flexshard probe --help)",
        None,
    ),
    "train --metrics-out in a missing folder": (
        ["train", *SMALL, "--metrics-out", "{d}/missing/m.jsonl"],
        "flexshard train: error: --metrics-out: '{d}/missing/m.jsonl': folder '{d}/missing' does not exist",
        None,
    ),
    "train --checkpoint-dir under a file": (
        ["train", *SMALL, "--checkpoint-dir", "{d}/a_file/ckpt"],
        "flexshard train: error: --checkpoint-dir: cannot create {d}/a_file/ckpt: Not a directory",
        None,
    ),
    "train --steps 0": (
        ["train", "--steps", "0"],
        "flexshard train: error: --steps: must be positive, got 0",
        None,
    ),
    "train --gc-every -1": (
        ["train", "--gc-every", "-1"],
        "flexshard train: error: --gc-every: must be >= 0, got -1",
        None,
    ),
    "bench --settle -1": (
        ["bench", "--settle", "-1"],
        "flexshard bench: error: argument --settle: must be >= 0, got '-1' (see flexshard bench --help)",
        None,
    ),
    # issue 22: limits checked before work, and messages that say what happened
    "train --negatives 0": (
        ["train", "--negatives", "0"],
        "flexshard train: error: --negatives: must be at least 1 (the loss compares the target with its "
        "negatives), got 0",
        None,
    ),
    "train --negatives -1": (
        ["train", "--negatives", "-1"],
        "flexshard train: error: --negatives: must be at least 1 (the loss compares the target with its "
        "negatives), got -1",
        None,
    ),
    "train --seed -1": (
        ["train", "--seed", "-1"],
        "flexshard train: error: --seed: must be an integer in [0, 4294967295], got -1",
        None,
    ),
    "train --seed 2**32": (
        ["train", "--seed", str(2**32)],
        "flexshard train: error: --seed: must be an integer in [0, 4294967295], got 4294967296",
        None,
    ),
    "train --batch-size 0": (
        ["train", "--batch-size", "0"],
        "flexshard train: error: --batch-size: must be positive, got 0",
        None,
    ),
    "plan string hot_rows": (
        ["train", "--plan", "{d}/string_hot_rows.json", *SMALL],
        "flexshard train: error: plan file '{d}/string_hot_rows.json': tables[0] ('item').hot_rows must be "
        "an integer >= 0, got '3'",
        None,
    ),
    "plan with a table listed twice": (
        ["train", "--plan", "{d}/table_twice.json", *SMALL],
        "flexshard train: error: plan file '{d}/table_twice.json': tables[2].name: table 'item' is listed "
        "twice (also tables[0])",
        None,
    ),
    "plan --budget inf": (
        ["plan", "--budget", "inf", "--out", "{d}/p4.json"],
        "flexshard plan: error: argument --budget: must be a finite number > 0, got 'inf' (see flexshard "
        "plan --help)",
        "{d}/p4.json",
    ),
    "plan --budget nan": (
        ["plan", "--budget", "nan", "--out", "{d}/p4.json"],
        "flexshard plan: error: argument --budget: must be a finite number > 0, got 'nan' (see flexshard "
        "plan --help)",
        "{d}/p4.json",
    ),
    "plan --budget 0": (
        ["plan", "--budget", "0", "--out", "{d}/p4.json"],
        "flexshard plan: error: argument --budget: must be a finite number > 0, got '0' (see flexshard "
        "plan --help)",
        "{d}/p4.json",
    ),
    "plan --budget=-1": (
        ["plan", "--budget=-1", "--out", "{d}/p4.json"],
        "flexshard plan: error: argument --budget: must be a finite number > 0, got '-1' (see flexshard "
        "plan --help)",
        "{d}/p4.json",
    ),
    "simulate --budgets 2,inf": (
        ["simulate", "--budgets", "2,inf"],
        "flexshard simulate: error: argument --budgets: must be a finite number > 0, got 'inf' (see "
        "flexshard simulate --help)",
        None,
    ),
    "train --budget inf": (
        ["train", "--budget", "inf"],
        "flexshard train: error: --budget: must be a finite number > 0, got inf",
        None,
    ),
    "a non-ASCII digit in a sequence file": (
        ["stats", "{d}/arabic_digit.txt", "--out", "{d}/s3.npz"],
        "flexshard stats: error: {d}/arabic_digit.txt:2: field 'item id' value '\u0663': not a "
        "non-negative integer id (ids are written with the ASCII digits 0-9)",
        "{d}/s3.npz",
    ),
    "a non-ASCII digit on the first line of a sequence file": (
        ["stats", "{d}/arabic_first.txt", "--out", "{d}/s6.npz"],
        "flexshard stats: error: {d}/arabic_first.txt:1: field 'item id' value '\u0663': not a "
        "non-negative integer id (ids are written with the ASCII digits 0-9)",
        "{d}/s6.npz",
    ),
    "a non-ASCII digit in a CSV file": (
        ["stats", "{d}/arabic_digit.csv", "--out", "{d}/s4.npz"],
        "flexshard stats: error: {d}/arabic_digit.csv:1: field 'item' value '\u0663': not a "
        "non-negative integer id (ids are written with the ASCII digits 0-9)",
        "{d}/s4.npz",
    ),
    "stats --format xyz": (
        ["stats", "{d}/id_2_32.txt", "--format", "xyz", "--out", "{d}/s5.npz"],
        "flexshard stats: error: argument --format: invalid choice: 'xyz' (choose from 'auto', 'seq', "
        "'csv', 'recbole', 'parquet', 'rows') (see flexshard stats --help)",
        "{d}/s5.npz",
    ),
    "train --steps x": (
        ["train", "--steps", "x"],
        "flexshard train: error: argument --steps: invalid int value: 'x' (see flexshard train --help)",
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_no_output(files, capsys, monkeypatch, case):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    argv, line, output = CASES[case]
    argv = [a.format(d=files) for a in argv]
    try:
        rc, _out, err = run(capsys, *argv)
    except SystemExit as e:  # a usage error of the top-level parser (before the subcommand runs)
        rc, err = e.code, capsys.readouterr().err
    assert rc == 2
    assert err.strip() == line.format(d=files)
    if output:
        assert not Path(output.format(d=files)).exists()


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("mpi", "FLEXSHARD_BACKEND: 'mpi' is not a backend; choose from auto, gloo, nccl"),
        ("nccl", "FLEXSHARD_BACKEND: 'nccl' needs CUDA, which this process cannot see; use gloo"),
    ],
)
def test_a_bad_backend_is_one_line_exit_2(capsys, monkeypatch, value, line):
    if value == "nccl" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid choice here")
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLEXSHARD_BACKEND", value)
    rc, out, err = run(capsys, "train", *SMALL)
    assert (rc, out, err.strip()) == (2, "", f"flexshard train: error: {line}")
