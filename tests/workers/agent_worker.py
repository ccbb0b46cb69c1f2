"""A worker process the writer tests start, kill, pause and resume.

    python tests/workers/agent_worker.py --dir D --name N --run-id R --scenario agent ...

Settings come from RUNLOG_* variables. The worker reports progress by writing flag files
``D/N.<flag>`` (so a test kills it at a known point, not after a guessed sleep), writes
``D/N.result`` (JSON: outcome, epoch, state digest) when it stops on its own, and exits
with a code naming what stopped it (see ``workers.common.EXIT_*``).

The ``charge`` tool applies its effect to the ledger in Redis (outside this process),
keyed by idempotency key, sending the call's fencing token and commit deadline with it.
Its reconciler is an authoritative lookup of that ledger, asked with the new owner's
token. ``--receiver`` is what the ledger honours and the tool declares (``fenced`` unless
told; ``none``: nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from runlog.projections._run_state import RunState  # noqa: E402
from runlog.schemas._canonical import canonical_json  # noqa: E402
from runlog.schemas._vocabulary import EventType  # noqa: E402
from runlog.testing import (  # noqa: E402
    AgentLoop,
    ApprovalStep,
    Call,
    FinishStep,
    ModelStep,
    ScriptedModel,
    Step,
)
from workers.common import (  # noqa: E402
    REFUSED,
    Flags,
    Ledger,
    by_name,
    run_worker,
    worker_parser,
)


def make_charge(opts: argparse.Namespace, flags: Flags, ledger: Ledger) -> runlog.Tool:
    def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Any:
        found = ledger.found(idempotency_key, token=fencing_token)
        if found is None:
            # Absent now; whether the request can still land is the receiver's declaration.
            return runlog.Absent(f"ledger has no entry {idempotency_key}")
        if found != canonical_json(args):
            return runlog.Conflict(found)
        return runlog.Match(f"charged {args['amount']} to {args['acct']}")

    def charge(
        args: dict[str, Any],
        *,
        idempotency_key: str,
        fencing_token: int,
        commit_deadline: datetime,
    ) -> str:
        if opts.charge_mode == "block-before":
            # The request is on its way to the receiver: a pause here is a frozen
            # process, or a slow link holding the request, before it commits.
            flags.set("in-tool", idempotency_key)
            flags.hold()
        applied = ledger.apply(
            idempotency_key, canonical_json(args), token=fencing_token, deadline=commit_deadline
        )
        if applied == REFUSED:
            raise runlog.ToolError(f"the ledger refused {idempotency_key}: stale token or late")
        if opts.charge_mode == "block-after":
            flags.set("effect", idempotency_key)
            flags.hold()
        return f"charged {args['amount']} to {args['acct']}"

    reconcile = lookup if opts.reconcile == "ledger" else None
    return runlog.tool(
        "charge",
        risk=opts.risk,
        reconcile=reconcile,
        receiver=ledger.honours,
        commit_window_s=opts.commit_window_s,
    )(charge)


class SignallingModel(ScriptedModel):
    """Writes ``model-<pos>`` just before the loop runs (and thinks about) step ``pos``."""

    flags: Flags | None = None

    def next_step(self, state: RunState) -> Step | None:
        step = super().next_step(state)
        if self.flags is not None and isinstance(step, ModelStep):
            self.flags.set(f"model-{self.position(state)}")
        return step


def agent_script(think_at: int, think_s: float) -> list[Step]:
    """Step 1 charges; ``think_s`` is the model latency of step ``think_at``."""

    def think(pos: int) -> float:
        return think_s if pos == think_at else 0.0

    return [
        ModelStep("Looking at account A-1.", input_tokens=40, output_tokens=9, think_s=think(0)),
        ModelStep(
            "Charging seven dollars.",
            calls=(Call("charge", {"amount": 7, "acct": "A-1"}),),
            input_tokens=60,
            output_tokens=12,
            cost_usd=0.002,
            think_s=think(1),
        ),
        ModelStep("Charged; done.", input_tokens=80, output_tokens=5, think_s=think(2)),
        FinishStep("succeeded", "charged once"),
    ]


def scenario_agent(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    model = SignallingModel(agent_script(opts.think_at, opts.think_s))
    model.flags = flags
    AgentLoop(model).run(run, user_message="charge seven dollars to A-1")


def scenario_direct(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    """Re-executed from the top after a crash: keys come from the call order, not memory."""
    results = [run.call_tool("charge", {"amount": 7, "acct": "A-1"}) for _ in range(opts.repeat)]
    flags.set("after-calls", json.dumps(results))
    if opts.hold_after:
        flags.hold()
    run.finish("succeeded", f"{len(results)} charges")


def scenario_hold(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    if run.state.seq == 1:
        run.append(EventType.USER_MESSAGE, content="hold the run")
    flags.set("holding", str(run.epoch))
    flags.hold()
    run.append(EventType.MEMORY_WRITTEN, key="after-hold", value=opts.name)
    run.finish("succeeded", f"finished by {opts.name}")


def scenario_approval(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    """Asks a person before charging, and waits (holding the run) for the decision."""
    model = ScriptedModel(
        [
            ModelStep("Account A-1 was double billed.", input_tokens=30, output_tokens=8),
            ApprovalStep("refund 7 dollars to A-1"),
            ModelStep("Refunding.", calls=(Call("charge", {"amount": -7, "acct": "A-1"}),)),
            FinishStep("succeeded", "refunded after approval"),
        ]
    )
    loop = AgentLoop(model, approval_wait_s=opts.approval_wait_s)
    loop.on_event = lambda msg: flags.set("waiting") if msg.startswith("approval") else None
    loop.run(run, user_message="refund A-1")


SCENARIOS = by_name(scenario_agent, scenario_direct, scenario_hold, scenario_approval)


def main() -> int:
    ap = worker_parser(SCENARIOS, scenario="agent", reconcile="ledger", risk="irreversible")
    ap.add_argument("--charge-mode", choices=["normal", "block-before", "block-after"])
    ap.add_argument("--think-at", type=int, default=-1)
    ap.add_argument("--think-s", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--wait-s", type=float, default=None)
    ap.add_argument("--tenant", default="default")
    ap.add_argument("--approval-wait-s", type=float, default=120.0)
    ap.add_argument(
        "--receiver", choices=["fenced", "deadline", "dedupes_by_key", "none"], default="fenced"
    )
    ap.add_argument("--commit-window-s", type=float, default=30.0)
    opts = ap.parse_args()
    opts.charge_mode = opts.charge_mode or "normal"

    settings = Settings()
    flags = Flags(opts.dir, opts.name)
    honours = None if opts.receiver == "none" else opts.receiver
    ledger = Ledger(redis_client(settings), settings.redis_key_prefix, honours)
    charge = make_charge(opts, flags, ledger)

    def open_run() -> runlog.Run:
        return runlog.open_run(
            opts.run_id,
            tenant=opts.tenant,
            tools=[charge],
            settings=settings,
            wait_s=opts.wait_s,
            agent="worker",
        )

    return run_worker(
        settings, flags, open_run, lambda run: SCENARIOS[opts.scenario](run, opts, flags)
    )


if __name__ == "__main__":
    sys.exit(main())
