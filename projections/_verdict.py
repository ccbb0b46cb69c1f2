"""The writers' validation verdict for projections that keep less than the full state.

Uncertain-call and audit projections must count only what the log's ownership rule
accepts, so they fold a run state alongside their own and ask it. They do not need the
conversation, so the stored copy is *slim*: messages and stored results are dropped.
Neither affects the verdict (``is_valid`` reads status, seq, epoch, run and tenant) nor
the open calls and approvals these projections read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from runlog.projections._run_state import RunState, jsonable


def slim_dict(state: RunState) -> dict[str, Any]:
    """``state.to_dict()`` without the conversation and stored results."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(state):
        if f.name == "messages":
            out[f.name] = []
        elif f.name == "completed_calls":
            out[f.name] = {}
        else:
            out[f.name] = jsonable(getattr(state, f.name))
    return out
