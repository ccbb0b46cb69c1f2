"""runlog's benchmarks: runlog against the physical limit and the alternatives, in one run.

``runlog bench [--quick] [--out DIR]`` (or ``make bench``) runs them all through
``benchmarks.run.run_all``; see docs/performance.md. Nothing is imported
here, so the benchmark subprocesses (``benchmarks.worker``) start light.
"""
