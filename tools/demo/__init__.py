"""The reference demo: the fleet finishes runs through kill -9 without repeating an effect.

    runlog demo --seed 7 --kills 5      # make demo (also: python -m tools.demo)

Modules: ``run`` (requests the runs, starts three ``runlog worker`` processes and SIGKILLs
them at random, then the report read from the log and the ledger, and ``verify``),
``agents`` (the refund agent and its non-idempotent ledger with a lookup, imported only by
the demo's workers), ``pydantic_ai_refund`` (the Pydantic AI how-to's agent). Nothing here
connects to anything at import time.
"""
