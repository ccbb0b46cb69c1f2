"""The writers' validation verdict for projections that keep less than the full state.

Uncertain-call and audit projections must count only what the log's ownership rule
accepts, so they fold a run state alongside their own and ask it. They do not need the
conversation, so the stored copy is *slim*: messages and stored results are dropped.
Neither affects the verdict (``is_valid`` reads status, seq, epoch, run and tenant) nor
the open calls and approvals these projections read.
"""

from __future__ import annotations

from typing import Any

from runlog.projections._run_state import RunState, durable_fields, jsonable


def slim_dict(state: RunState) -> dict[str, Any]:
    """``state.to_dict()`` without the conversation and stored results."""
    out: dict[str, Any] = {}
    for name, value in durable_fields(state):
        if name == "messages":
            out[name] = []
        elif name == "completed_calls":
            out[name] = {}
        else:
            out[name] = jsonable(value)
    return out
