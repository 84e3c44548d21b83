"""What the hot and warm tiers save in modeled step time over ``row_wise_group_dedup``, on the embedded
default and every real data set (issue 23's last criterion), on the ``h100:8`` and ``h100:64`` presets
(64 and 512 GPUs in groups of 8; their NCCL latencies and the HBM-roofline rates of the value work,
docs/cost_model.md section 10), with each GPU host work model of ``--gpu-host`` (default both: none,
``fused``, and this runtime's, ``measured``), at a budget of 2x row-wise with per-rank dedup, every
plan made and priced as ``train --pipeline on`` runs the step (the replica sync beside the next batch's
id exchange; ``--pipeline off``: one after the other). Writes docs/results/tier_savings.md.

For each workload: FlexShard's plan under the step-time objective (the default) and under the bytes
objective, each priced by :func:`solvers.time_model.step_time` (total, latency, bandwidth, local work,
collectives, replicated rows), beside ``row_wise_group_dedup``, and the report's tiers line. Run:

    nice .venv/bin/python experiments/tier_savings.py [--topology h100:8,h100:64] [--budget 2]
        [--pipeline on|off] [--gpu-host fused,measured] [--quick]

``--quick``: the default and the first real data set only.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import study  # noqa: E402

from flexshard import workloads  # noqa: E402
from flexshard.step_report import GROUP_DEDUP, savings_text, step_record  # noqa: E402
from solvers.optimizer import OptimizerConfig  # noqa: E402
from solvers.planner import budget_bytes, make_plan  # noqa: E402
from topology import cluster_view, load_topology  # noqa: E402


def _line(label: str, planned) -> str:
    st, plan = planned.step, planned.plan
    replicated = sum(tp.hot_rows + tp.warm_rows for tp in plan.tables)
    return (
        f"  {label:<22} {st.total_s * 1e3:8.3f} ms = latency {st.latency_s * 1e3:.3f} + bandwidth "
        f"{st.bandwidth_s * 1e3:.3f} + local {st.local_s * 1e3:.3f}; {st.collectives} collectives, "
        f"{replicated:,} replicated rows"
    )


def _row(label: str, step, by_bytes, base) -> list[str]:
    """One workload's markdown row: the step objective's plan, the bytes objective's, the baseline."""

    def cell(planned) -> str:
        st = planned.step
        return f"{st.total_s * 1e3:.3f} ms ({st.collectives})"

    replicated = sum(tp.hot_rows + tp.warm_rows for tp in by_bytes.plan.tables)
    ours = sum(tp.hot_rows + tp.warm_rows for tp in step.plan.tables)
    saved = base.step.total_s - step.step.total_s
    return [label, cell(step), f"{ours:,}", cell(by_bytes), f"{replicated:,}", cell(base)] + [
        f"{saved * 1e3:+.3f} ms ({saved / base.step.total_s:+.1%})"
    ]


def main() -> None:
    ap = study.arguments(__doc__, quick="the default and the first real data set only")
    ap.add_argument("--topology", default="h100:8,h100:64", help="comma-separated topologies")
    ap.add_argument("--budget", type=float, default=2.0)
    ap.add_argument("--pipeline", choices=("on", "off"), default="on")
    ap.add_argument(
        "--gpu-host",
        default="fused,measured",
        help="comma-separated GPU host work models (plan --gpu-host): fused, measured (default both)",
    )
    args = ap.parse_args()
    import sweep_comms  # the real data sets, as the communication sweep finds them

    start = time.time()
    sets = [("default", workloads.default_workload())]
    found = sweep_comms.data_sets()
    for label, path in found[:1] if args.quick else found:
        sets.append((label, workloads.load_workload(path)))
    piped = args.pipeline == "on"
    tables = []
    for host, topology in ((h, t) for h in args.gpu_host.split(",") for t in args.topology.split(",")):
        view = cluster_view(load_topology(topology))
        print(
            f"{topology}: {view.num_ranks} GPUs in {view.num_groups} groups; "
            f"budget {args.budget:g}x, dedup on, pipeline {args.pipeline}, GPU host work {host}"
        )
        rows = []
        for label, workload in sets:
            budget = budget_bytes(workload, view, args.budget)
            cfg = OptimizerConfig(overlap=piped, gpu_host=host)
            step = make_plan("flexshard", workload, view, budget, True, config=cfg)
            by_bytes = make_plan(
                "flexshard",
                workload,
                view,
                budget,
                True,
                config=OptimizerConfig(step_time=False, overlap=piped, gpu_host=host),
            )
            base = make_plan(GROUP_DEDUP, workload, view, budget, True, config=cfg)
            print(f"{label}:")
            print(_line("flexshard (step)", step))
            print(_line("flexshard (bytes)", by_bytes))
            print(_line(GROUP_DEDUP, base))
            ours = {
                **step_record(step.step),
                "hot_rows": sum(tp.hot_rows for tp in step.plan.tables),
                "warm_rows": sum(tp.warm_rows for tp in step.plan.tables),
            }
            print("  tiers: " + savings_text(ours, step_record(base.step)))
            rows.append(_row(label, step, by_bytes, base))
        header = ["workload", "FlexShard step (collectives)", "replicated rows", "bytes-objective plan"]
        header += ["its replicated rows", GROUP_DEDUP, "FlexShard saves"]
        title = (
            f"## `{topology}`: {view.num_ranks} GPUs in {view.num_groups} groups, GPU host work {host}\n\n"
        )
        tables.append(title + study.md_table(header, rows, "lrrrrrr"))
    if not args.no_write:
        flags = (["--quick"] if args.quick else []) + (["--pipeline off"] if not piped else [])
        cmd = study.command(__file__, *flags)
        how = "pipelined (`train --pipeline on`: the replica sync beside the next batch's id exchange)"
        text = (
            "# What the tiers save in modeled step time\n\n"
            + study.generated(cmd, time.time() - start)
            + "\n\nOn the H100 presets (groups of 8 GPUs; the "
            "presets' NCCL latencies and the HBM-roofline rates of the value work, docs/cost_model.md "
            "section 10), with each GPU host work model of `plan --gpu-host` (`fused`: no host work around "
            "the collectives; `measured`: this runtime's, measured on an H100, section 10.2), "
            f"every step {how if piped else 'unpipelined'}, "
            f"budget {args.budget:g}x row-wise memory, dedup on: FlexShard's plan under the step "
            "objective (the default), the plan the bytes objective makes (with its replicated rows), and "
            f'`{GROUP_DEDUP}`, each as modeled step time with its collectives per step. "FlexShard '
            f"saves\" is `{GROUP_DEDUP}`'s step minus FlexShard's. Where FlexShard replicates nothing, a "
            "saving comes from the cold rows' fetch modes (flat where the group fetch's extra stages cost "
            "more than its bytes save), not from the tiers.\n\n" + "\n\n".join(tables)
        )
        study.write_markdown(study.RESULTS / "tier_savings.md", text)


if __name__ == "__main__":
    main()
