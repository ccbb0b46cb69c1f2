"""The reference demo: a reconciliation agent that survives kill -9 without repeating effects.

    python -m runlog.demo run --seed 7 --kills 3     # the supervised demo (``make demo``)
    python -m runlog.demo ledger --namespace NS      # the ledger service alone
    python -m runlog.demo worker --run-id R --ledger-url URL   # one agent worker

Modules: ``ledger`` (the service the agent changes, in its own process), ``agent`` (the
worker: tools, script, exit codes), ``supervisor`` (kills, pauses, restarts and decides),
``report`` (the final summary, read from the log and the ledger). Nothing here connects
to anything at import time.
"""
