"""Training curves: FlexShard vs row-wise sharding with torchrun on a real data set.

Trains the sequence model of :mod:`flexshard.model` on Amazon Beauty (``amazon-yelp-sequences/
Beauty.txt`` under :func:`flexshard.workloads.data_root`) with ``torchrun --standalone
--nproc-per-node 4 -m flexshard.train`` (gloo on CPU, ranks as 2 emulated groups of 2), once per
strategy with the same seed, batches, optimizer and learning rate:

* ``flexshard`` at 2x row-wise memory (the default budget);
* ``row_wise``: every row cold, split evenly over the 4 ranks (TorchRec's sequence sharding);
* both again with ``--no-dedup`` (no per-rank id dedup before the exchange: repeated hot ids cost
  bytes, so replicating them saves more; left out by ``--quick``). Dedup changes only the traffic,
  not the math. (A 4x budget gives the same FlexShard plan as 2x on this data: more replication
  would cost more sync than it saves.)
* FlexShard and row-wise with embeddings and gradients in bf16 on the wire, and FlexShard in fp16
  (``--wire-dtype``; rows, optimizer state and gradient sums stay float32): the loss curves against
  float32 (left out by ``--quick``).

Every run passes ``--metrics-out`` (per-step loss and bytes per link class and component, see
:mod:`flexshard.training.metrics`); with ``--verify`` also ``--verify`` (:mod:`flexshard.training.verify`:
each step an unsharded reference takes the same step from the run's state, replicas bitwise equal,
logits, dense gradient and row updates within 16 unit roundoffs of the wire dtype).
Bytes are per rank and step: lookups (ids, forward, backward) are counted from the realised split sizes,
sync bytes are the cost model's all-reduce bytes of the realised payload (not measured); "max" is the
busiest rank, "mean" the average over ranks. The plan's ``predicted`` metrics (the cost model, expected
batches) are shown next to the measured means.

Writes docs/results/train_curves.md (command, setup, loss at selected steps and the largest loss
difference over all steps, bytes per link class and component, the inter-group reduction vs
row-wise) and docs/results/train_curves.png (loss curves and their difference; bytes per step).
Progress goes to stderr. Run from the repository root:

    .venv/bin/python experiments/train_curves.py [--quick] [--steps N] [--verify] [--no-write]

``--quick``: 30 steps, FlexShard and row-wise with dedup only (about a minute on 2 idle cores; several on
loaded ones). ``--verify``: every job also passes ``flexshard train --verify`` (about twice the time).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import study

from core.vocabulary import COMPONENTS, LINK_CLASSES
from flexshard import workloads

DATA = Path("amazon-yelp-sequences") / "Beauty.txt"
NPROC, GROUPS, BATCH, LR, SEED = 4, 2, 256, 0.1, 0
STEPS, QUICK_STEPS = 150, 30


@dataclass
class RunSpec:
    label: str  # shown in tables and the figure
    strategy: str
    budget: float  # per-GPU memory, multiple of row-wise
    dedup: bool = True  # per-rank id dedup before the exchange
    wire: str = "fp32"  # element type of embeddings and gradients on the wire


@dataclass
class RunResult:
    spec: RunSpec
    header: dict
    steps: list[dict]
    seconds: float  # wall time of the torchrun command
    command: list[str]

    def loss(self) -> np.ndarray:
        """float64[steps]: the global mean loss of each step."""
        return np.array([r["loss"] for r in self.steps])

    def bytes_mean(self, link: str, stat: str) -> float:
        """Mean over steps of this step's bytes on ``link`` (``stat``: "max" or "mean" over ranks)."""
        return float(np.mean([r["bytes"][link][stat] for r in self.steps]))

    def component_mean(self, link: str, component: str, stat: str) -> float:
        """Mean over steps of one component's bytes on ``link`` (``stat`` over ranks)."""
        return float(np.mean([r["bytes_by_component"][link][component][stat] for r in self.steps]))

    def tiers(self) -> str:
        return ", ".join(
            f"{t['name']} {t['hot_rows']:,}/{t['warm_rows']:,}/{t['cold_rows']:,}"
            for t in self.header["plan"]["tables"]
        )


def train_command(data: Path, spec: RunSpec, steps: int, metrics: Path | str, verify: bool) -> list[str]:
    """The torchrun command line of one run (``metrics``: the --metrics-out path)."""
    return [
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        "-m",
        "flexshard.train",
        "--data",
        str(data),
        "--groups",
        str(GROUPS),
        "--strategy",
        spec.strategy,
        "--budget",
        f"{spec.budget:g}",
        "--steps",
        str(steps),
        "--batch-size",
        str(BATCH),
        "--lr",
        f"{LR:g}",
        "--optimizer",
        "adagrad",
        "--dedup" if spec.dedup else "--no-dedup",
        "--wire-dtype",
        spec.wire,
        "--seed",
        str(SEED),
        *(["--verify"] if verify else []),
        "--metrics-out",
        str(metrics),
    ]


def run_one(
    data: Path, spec: RunSpec, steps: int, verify: bool, tmp: Path, index: int, total: int
) -> RunResult:
    """Run one training job under torchrun (``python -m torch.distributed.run``, the same program),
    echoing its progress to stderr; its metrics records."""
    stem = f"{spec.strategy}-{spec.budget:g}-{'dedup' if spec.dedup else 'nodedup'}-{spec.wire}"
    metrics = tmp / f"{stem}.jsonl"
    command = train_command(data, spec, steps, metrics, verify)
    argv = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    env = study.cpu_job_env()
    tag = f"[run {index}/{total} {spec.label}]"
    print(f"{tag} starting: {' '.join(command)}", file=sys.stderr, flush=True)
    every = max(1, steps // 10)
    err_path = tmp / f"{stem}.stderr"
    start = time.perf_counter()
    lines: list[str] = []
    with (
        open(err_path, "w") as err,
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:  # results and the log lines (stderr) together
            lines.append(line.rstrip())
            err.write(line)
            if line.startswith("step "):
                k = int(line.split()[1].split("/")[0])
                if k == 1 or k % every == 0 or k == steps:
                    print(f"{tag} {line.rstrip()}", file=sys.stderr, flush=True)
            elif line.startswith(("plan", "verify")):
                print(f"{tag} {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait()
    seconds = time.perf_counter() - start
    if rc != 0:
        tail = "\n".join(err_path.read_text().splitlines()[-15:])
        raise SystemExit(f"train_curves: {spec.label} failed (exit {rc}):\n{tail}")
    if verify and not any(ln.startswith("verify: OK") for ln in lines):
        raise SystemExit(f"train_curves: {spec.label}: no 'verify: OK' line in the output")
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    header = records[0]
    step_records = [r for r in records if r["kind"] == "step"]
    print(f"{tag} done in {seconds:.0f} s", file=sys.stderr, flush=True)
    shown = train_command(Path("<data_root>") / DATA, spec, steps, "<tmp>/metrics.jsonl", verify)
    return RunResult(spec, header, step_records, seconds, shown)


# --- report ------------------------------------------------------------------------------------------


def selected_steps(steps: int) -> list[int]:
    """1-based steps shown in the loss table: the first, about every tenth, the last."""
    picks = {1, steps, *np.linspace(0, steps, 11)[1:].round().astype(int).tolist()}
    return sorted(s for s in picks if 1 <= s <= steps)


def smooth(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over ``window`` steps (shorter at the start)."""
    c = np.cumsum(np.concatenate([[0.0], x]))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def row_wise_of(results: list[RunResult], r: RunResult) -> RunResult | None:
    """The float32 row-wise job with ``r``'s dedup setting, if any."""
    return next(
        (
            x
            for x in results
            if x.spec.strategy == "row_wise" and x.spec.dedup == r.spec.dedup and x.spec.wire == "fp32"
        ),
        None,
    )


def markdown(results: list[RunResult], base: RunResult, steps: int, argv_line: str, total_s: float) -> str:
    cfg = base.header["config"]
    data_desc = base.header["data"].replace(str(workloads.data_root()), "<data_root>")
    lines = [
        "# Training: FlexShard vs row-wise sharding (torchrun, Amazon Beauty)",
        "",
        study.generated(
            argv_line,
            total_s,
            f"wall times vary several-fold with the load of this shared machine; {len(results)} torchrun "
            "jobs run one after another",
        )
        + " Each job is:",
        "",
        "```",
        " ".join(results[0].command),
        "```",
        "",
        "with `--strategy` / `--budget` / `--dedup` / `--wire-dtype` as in the table below (`<data_root>`: "
        "`flexshard.workloads.data_root()`, `FLEXSHARD_DATA`).",
        "",
        "## Setup",
        "",
        f"- Data: {data_desc}; per sample a user's history (up to {cfg['max_len']} items before a "
        f"random cut), the next item and {cfg['negatives']} random negatives, objective "
        f"`{cfg['objective']}`; batches are deterministic in (seed {cfg['seed']}, step, rank), so every "
        "job sees the same samples.",
        f"- {base.header['world']} ranks (gloo, CPU) as {len(base.header['groups'])} emulated groups "
        f"{base.header['groups']}; {cfg['batch_size']} samples per rank per step; dim {cfg['dim']}; "
        f"{cfg['optimizer']} (row-wise for embeddings, element-wise for the dense model), lr {cfg['lr']:g}; "
        f"{steps} steps.",
        (
            "- Every job ran with `--verify`: each step an unsharded reference took the same step from the "
            "run's state; replicas matched bit for bit, and logits, the dense gradient and every row update "
            "matched within 16 unit roundoffs of the job's wire dtype (2-norm): all jobs printed "
            "`verify: OK`."
            if cfg["verify"]
            else "- Run without `--verify` (pass it to the script to add the unsharded reference check; "
            "`tests/runtime/test_train.py` verifies every strategy)."
        ),
        "",
        study.md_table(
            ["job", "strategy", "budget (x row-wise)", "id dedup", "wire", "tiers hot/warm/cold rows"]
            + ["wall time (s)"],
            [
                [r.spec.label, f"`{r.header['plan']['strategy']}`", f"{r.spec.budget:g}"]
                + ["on" if r.spec.dedup else "off", r.spec.wire, r.tiers(), f"{r.seconds:.0f}"]
                for r in results
            ],
            align="llrlllr",
        ),
    ]
    # loss
    others = [r for r in results if r is not base]
    lines += [
        "",
        "## Loss",
        "",
        f"Global mean loss per step (sum over ranks of batch mean / {base.header['world']}); "
        f"|diff| is against {base.spec.label}. "
        f"Start: ln(1 + negatives) = {np.log(1 + cfg['negatives']):.4f}.",
        "",
    ]
    header = ["step", *(r.spec.label for r in results)]
    header += [f"\\|{r.spec.label} - {base.spec.label}\\|" for r in others]
    losses = {id(r): r.loss() for r in results}
    rows = []
    for s in selected_steps(steps):
        row = [s, *(f"{losses[id(r)][s - 1]:.6f}" for r in results)]
        row += [f"{abs(losses[id(r)][s - 1] - losses[id(base)][s - 1]):.2e}" for r in others]
        rows.append(row)
    lines.append(study.md_table(header, rows, align="r" * len(header)))
    k = max(1, steps // 10)
    lines += ["", "Over all steps:", ""]
    for r in others:
        d = np.abs(losses[id(r)] - losses[id(base)])
        lines.append(
            f"- {r.spec.label} vs {base.spec.label}: max |loss difference| {d.max():.3g} (at step "
            f"{int(d.argmax()) + 1}), mean {d.mean():.3g}; relative max {np.max(d / losses[id(base)]):.3g}."
        )
    for r in results:  # each half-precision job against the float32 job of the same strategy and dedup
        twin = next(
            (
                x
                for x in results
                if x.spec.wire == "fp32"
                and (x.spec.strategy, x.spec.dedup) == (r.spec.strategy, r.spec.dedup)
            ),
            None,
        )
        if r.spec.wire == "fp32" or twin is None:
            continue
        d = np.abs(losses[id(r)] - losses[id(twin)])
        lines.append(
            f"- {r.spec.label} vs {twin.spec.label} (the precision alone): max |loss difference| "
            f"{d.max():.3g} (at step {int(d.argmax()) + 1}), mean {d.mean():.3g}; mean loss over the "
            f"last {k} steps {losses[id(r)][-k:].mean():.4f} vs {losses[id(twin)][-k:].mean():.4f}."
        )
    b = losses[id(base)]
    lines.append(
        f"- Mean loss over the first {k} steps {b[:k].mean():.4f}, over the last {k} steps "
        f"{b[-k:].mean():.4f} ({base.spec.label}; the other jobs agree to the digits above)."
    )
    # bytes
    lines += [
        "",
        "## Bytes per step per link class",
        "",
        "Bytes per rank and step, mean over steps; max = busiest rank, mean = average over ranks. "
        "Predicted: the plan's cost-model metrics (busiest rank, expected batch). Lookup bytes are "
        "counted from the realised exchanges; sync bytes are the cost model's all-reduce bytes of the "
        "realised payload (not measured on the wire).",
        "",
        "The last two columns compare with the float32 row-wise job of the same dedup setting.",
        "",
    ]
    stats = ("max", "mean", "predicted")
    header = ["job", *(f"{link} {stat}" for link in ("intra", "inter") for stat in stats)]
    header += ["inter max vs row-wise", "inter predicted vs row-wise"]
    rows = []
    for r in results:
        pred = r.header["plan"]["predicted"]
        inter = r.bytes_mean("inter_group", "max")
        rw = row_wise_of(results, r)
        change = predicted_change = ""
        if rw is not None and rw is not r:
            change = f"{inter / rw.bytes_mean('inter_group', 'max') - 1:+.1%}"
            rw_pred = rw.header["plan"]["predicted"]["inter_group_bytes"]
            predicted_change = f"{pred['inter_group_bytes'] / rw_pred - 1:+.1%}"
        intra = [r.bytes_mean("intra_group", "max"), r.bytes_mean("intra_group", "mean")]
        intra.append(pred["intra_group_bytes"])
        inters = [inter, r.bytes_mean("inter_group", "mean"), pred["inter_group_bytes"]]
        rows.append([r.spec.label, *(f"{x:,.0f}" for x in intra + inters), change, predicted_change])
    lines.append(study.md_table(header, rows, align="l" + "r" * (len(header) - 1)))
    lines += [
        "",
        "Per component (bytes per step, mean over steps of the busiest rank's `max(send, recv)` of that "
        "component alone, so the parts can add up to more than the link total above):",
        "",
    ]
    rows = [
        [r.spec.label, link, *(f"{r.component_mean(link, c, 'max'):,.0f}" for c in COMPONENTS)]
        for r in results
        for link in LINK_CLASSES
    ]
    lines.append(study.md_table(["job", "link", *COMPONENTS], rows, align="ll" + "r" * len(COMPONENTS)))
    lines += [
        "",
        "## Caveats",
        "",
        "- Groups are emulated on one host: the link classes are the ranks' group membership, not real "
        "NVLink / network links, so only byte counts are reported, not times.",
        "- Bytes are per rank per step and depend on the realised batches; the cost model's prediction "
        "uses the data set's access histogram (expected values).",
        "- The loss is a noisy per-step estimate (one global batch per step, no held-out evaluation); "
        "it is the same for every float32 job because the sharded runtime computes the same math as the "
        "unsharded reference (differences are float32 summation order: 1.19e-07 is one float32 ulp "
        "near 1). The bf16 and fp16 jobs differ by the rounding of every exchanged vector (relative "
        "2^-8 and 2^-11), which training then carries forward.",
        "",
        "![loss and bytes per step](train_curves.png)",
        "",
    ]
    return "\n".join(lines)


def figure(path: Path, results: list[RunResult], base: RunResult, steps: int) -> None:
    fig, (ax, bx) = study.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.25, 1]})
    x = np.arange(1, steps + 1)
    window = max(1, steps // 20)
    styles = ("-", "--", "-.", ":", "-", "--", "-.")
    colors = ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:olive")
    for r, ls, color in zip(results, styles, colors, strict=False):
        loss = r.loss()
        ax.plot(x, loss, color=color, lw=0.6, alpha=0.35)
        label = f"{r.spec.label} ({window}-step mean)"
        ax.plot(x, smooth(loss, window), color=color, ls=ls, lw=2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("global mean loss (thin: per step)")
    ax.set_title("Loss: the curves lie on top of each other")
    ax.grid(alpha=0.3)
    tx = ax.twinx()
    floor = 1e-12
    for r, color in zip(results, colors, strict=False):
        if r is base:
            continue
        d = np.abs(r.loss() - base.loss())
        tx.semilogy(x, np.maximum(d, floor), color=color, lw=0.8, marker=".", ms=2, ls="none",
                    label=f"|{r.spec.label} - {base.spec.label}| (0 drawn at {floor:g})")  # fmt: skip
    tx.set_ylim(floor / 2, 1e-1)
    tx.set_ylabel("|loss difference| vs row-wise (log)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = tx.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right", ncol=2)

    comp_colors = {"ids": "tab:gray", "forward": "tab:blue", "backward": "tab:orange", "sync": "tab:purple"}
    width = 0.8 / len(results)
    for j, r in enumerate(results):
        for i, link in enumerate(LINK_CLASSES):
            pos = i + (j - (len(results) - 1) / 2) * width
            bottom = 0.0
            for c in COMPONENTS:
                v = r.component_mean(link, c, "mean") / 1e3
                bx.bar(pos, v, width * 0.92, bottom=bottom, color=comp_colors[c],
                       label=c if (i, j) == (0, 0) else None, edgecolor="white", lw=0.5)  # fmt: skip
                bottom += v
            busiest = r.bytes_mean(link, "max") / 1e3
            bx.plot(pos, busiest, marker="_", color="black", ms=14, mew=2,
                    label="busiest rank (link total)" if (i, j) == (0, 0) else None)  # fmt: skip
            label_y = max(bottom, busiest) * 1.02
            bx.text(pos, label_y, r.spec.label, rotation=90, ha="center", va="bottom", fontsize=7)
    bx.set_xticks(range(len(LINK_CLASSES)), ["intra-group links", "inter-group links"])
    bx.set_ylabel("kB per rank per step (mean over ranks and steps)")
    bx.set_title("Bytes per step by link class and component")
    bx.grid(axis="y", alpha=0.3)
    top = max(max(r.bytes_mean(link, "max") for link in LINK_CLASSES) for r in results) / 1e3
    bx.set_ylim(0, top * 1.9)  # room for the job labels above the bars
    bx.legend(fontsize=8, loc="upper left")
    cfg = base.header["config"]
    fig.suptitle(
        f"Amazon Beauty, {base.header['world']} ranks in {len(base.header['groups'])} emulated groups, "
        f"batch {cfg['batch_size']}/rank, {cfg['optimizer']} lr {cfg['lr']:g}, {steps} steps (gloo, CPU)"
    )
    fig.tight_layout()
    study.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick=f"{QUICK_STEPS} steps; dedup-on jobs only")
    p.add_argument("--verify", action="store_true", help="every job also runs flexshard train --verify")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {STEPS})")
    args = p.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if steps < 2:
        p.error("--steps: at least 2")
    data = workloads.data_root() / DATA
    if not data.is_file():
        study.note_missing(data, f"the study (FLEXSHARD_DATA names the folder holding {DATA.parent}/)")
        return 2
    specs = [RunSpec("FlexShard", "flexshard", 2.0), RunSpec("row-wise", "row_wise", 2.0)]
    if not args.quick:
        specs += [
            RunSpec("FlexShard, no dedup", "flexshard", 2.0, False),
            RunSpec("row-wise, no dedup", "row_wise", 2.0, False),
            RunSpec("FlexShard, bf16 wire", "flexshard", 2.0, wire="bf16"),
            RunSpec("row-wise, bf16 wire", "row_wise", 2.0, wire="bf16"),
            RunSpec("FlexShard, fp16 wire", "flexshard", 2.0, wire="fp16"),
        ]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="train_curves-") as tmp:
        results = [
            run_one(data, s, steps, args.verify, Path(tmp), i + 1, len(specs)) for i, s in enumerate(specs)
        ]
    total_s = time.perf_counter() - start
    base = results[1]
    flags = (
        (["--quick"] if args.quick else [])
        + (["--steps", str(args.steps)] if args.steps else [])
        + (["--verify"] if args.verify else [])
    )
    argv_line = study.command(__file__, *flags)
    text = markdown(results, base, steps, argv_line, total_s)
    print(text)
    if not args.no_write:
        study.write_markdown(study.RESULTS / "train_curves.md", text)
        figure(study.RESULTS / "train_curves.png", results, base, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
