"""The training entry point's parts (:mod:`flexshard.train` runs them): config, data, planning, loop,
reference (``--verify``), metrics (``--metrics-out``) and the process group."""
