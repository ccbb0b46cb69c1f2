"""A framework's human-in-the-loop approval as a runlog approval: one rule for every integration.

A tool call a framework holds back for a person (OpenAI Agents SDK ``needs_approval``,
Pydantic AI ``requires_approval``/``ApprovalRequired``) becomes an APPROVAL_REQUESTED of kind
``action`` carrying the call's idempotency key; the same call asked again (a resumed or
re-executed run) finds that request by its key instead of asking twice. The decision is
whatever ``runlog approve``/``reject`` (or ``runlog.aio.decide``) recorded; until there is
one the caller waits up to ``wait_s`` and then gets ``runlog.Escalated``, leaving the run
waiting for the person and holding no worker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from runlog import aio
from runlog.errors import Escalated

APPROVAL_POLL_S = 0.1


async def approval_for(run: aio.AsyncRun, name: str, args_json: str, key: str | None) -> str:
    """The id of the approval request for this call: the recorded one, else a new one."""
    for approval in run.state.approvals.values():
        if approval.kind == "action" and approval.idempotency_key == key:
            return approval.approval_id
    return await run.request_approval(
        f"{name} {args_json}",
        kind="action",
        name=name,
        args_json=args_json,
        idempotency_key=key,
    )


async def await_decision(run: aio.AsyncRun, approval_id: str, wait_s: float) -> Any:
    """The decided approval; ``Escalated`` if no one decided within ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        approval = run.state.approvals[approval_id]
        if approval.approved is not None:
            return approval
        await run.poll_decisions()
        approval = run.state.approvals[approval_id]
        if approval.approved is not None:
            return approval
        if time.monotonic() >= deadline:
            raise Escalated(
                f"run {run.run_id} waits for a person to decide {approval_id}",
                approval_id=approval_id,
                run_id=run.run_id,
            )
        await asyncio.sleep(APPROVAL_POLL_S)


def rejection_note(approval: Any) -> str:
    """What the agent is told when a person said no."""
    return str(approval.note or f"rejected by {approval.decided_by}")
