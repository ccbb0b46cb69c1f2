"""runlog's benchmarks: runlog against the physical limit and the alternatives, in one run.

``runlog bench [--quick] [--out DIR]`` (or ``make bench``) runs them all through
``tools.benchmarks.run.run_all``; see docs/performance.md. A clone's only: the wheel does not
ship them. Nothing is imported here, so the benchmark subprocesses
(``tools.benchmarks.worker``) start light.
"""
