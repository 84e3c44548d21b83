"""``flexshard bench``: a training step of several sharding strategies on the same batches, measured.

* :mod:`~flexshard.bench.config`: the flags, :class:`~flexshard.bench.config.BenchConfig`, the checks;
* :mod:`~flexshard.bench.data`: the tables and the batches (a function of seed, step and rank);
* :mod:`~flexshard.bench.plans`: the strategies' plans, for the probed machine or the H100 shape;
* :mod:`~flexshard.bench.systems`: FlexShard's runtime on a plan, TorchRec's row-wise;
* :mod:`~flexshard.bench.worker`: one rank's warm-up and alternating rounds; the local spawn;
* :mod:`~flexshard.bench.recorder`: collectives and bytes per link class, counted on torch.distributed;
* :mod:`~flexshard.bench.results`: one record per strategy, the table and JSON;
* :mod:`~flexshard.bench.predict`: the time model's prediction (the one call into it).
"""
