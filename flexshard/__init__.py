"""FlexShard: tiered (hot / warm / cold) sharding of sequence embedding tables across GPU clusters.

* ``flexshard.workloads``: row statistics from real traces and the calibrated synthetic default;
* ``flexshard.plan_file``: the plan a training job loads; ``flexshard.report``: readable reports;
* ``flexshard.cli``: the ``flexshard`` command (stats, plan, simulate, topology).

Planning itself lives in the ``solvers`` package and the cluster graph in ``topology``.
"""

__version__ = "0.1.0"
