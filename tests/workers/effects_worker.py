"""A worker process for the effect-safety tests: odd results, finishing twice, guardrails.

    python tests/workers/effects_worker.py --dir D --name N --run-id R --scenario S ...

Same conventions as ``agent_worker.py`` (flags, ``D/N.result``, exit codes): the tests
kill it with SIGKILL at a flag and start another one on the same run. Effects are counted
in the Redis ledger, outside every worker process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from runlog.producers._handle import engine_of  # noqa: E402
from runlog.testing import AgentLoop, FinishStep, ModelStep, ScriptedModel  # noqa: E402
from workers.common import STOPPED_BY_FINISHING, Flags, Ledger, by_name, run_worker, worker_parser  # noqa: E402

LARGE_BYTES = 2 * 1024 * 1024


def result_text(kind: str) -> str:
    """What the ``fetch`` tool returns: deterministic, so a reconciler can return it too."""
    if kind == "large":
        return "".join(f"line {i:07d} of a fetched page\n" for i in range(LARGE_BYTES // 29))
    if kind == "surrogate":
        return "receipt \ud800 with a lone surrogate"
    return "small"


def make_fetch(opts: argparse.Namespace, flags: Flags, ledger: Ledger, store: Any) -> runlog.Tool:
    def fetch(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        if opts.mode == "block-after":
            flags.set("effect", idempotency_key)
            flags.hold()
        return result_text(opts.result)

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        if ledger.found(idempotency_key) is None:
            return runlog.Absent("no such fetch")
        return runlog.Match(result_text(opts.result))

    def keep(key: str, whole: str) -> str:
        blob = f"{opts.prefix}:blob:{key}"
        store.set(blob, whole.encode("utf-8", "surrogatepass"))
        return f"redis:{blob}"

    return runlog.tool(
        "fetch",
        risk=opts.risk,
        reconcile=lookup if opts.reconcile == "ledger" else None,
        on_large_result=keep if opts.sink else None,
        receiver="fenced",
    )(fetch)


def make_pay_refund(opts: argparse.Namespace, ledger: Ledger) -> list[runlog.Tool]:
    """``pay`` is irreversible: its receiver applies 70 where 7 was asked, then the answer
    is lost; its lookup finds that conflict. ``refund`` is reversible."""

    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps({**args, "amount": 70}, sort_keys=True))
        raise TimeoutError("gateway timed out after accepting")

    def pay_lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        found = ledger.found(idempotency_key)
        if found is None:
            return runlog.Absent("no such payment")
        if found != json.dumps(args, sort_keys=True):
            return runlog.Conflict(found)
        return runlog.Match("paid")

    def refund(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return "refunded"

    return [
        runlog.tool("pay", risk="irreversible", reconcile=pay_lookup, receiver="fenced")(pay),
        runlog.tool("refund", risk="reversible")(refund),
    ]


def scenario_conflict(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    run.call_tool("pay", {"amount": 7, "acct": "A-1"})
    run.call_tool("refund", {"amount": 3, "acct": "A-1"})
    run.finish("succeeded")


def scenario_refund(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    run.call_tool("refund", {"amount": 3, "acct": "A-1"})
    run.finish("succeeded")


def hold_before_escalating(flags: Flags) -> None:
    """Stop (for the test's SIGKILL) after a reconciliation recorded an escalation and
    before its approval request is appended."""
    from runlog.producers import _calls as calls

    original = calls._escalate

    def escalate(*args: Any, **kw: Any) -> Any:
        flags.set("escalating")
        flags.hold()
        return (yield from original(*args, **kw))

    calls._escalate = escalate


def scenario_fetch(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    """Re-executed from the top after a kill: one fetch, then finish."""
    got = run.call_tool("fetch", {"url": "https://example.test/page"})
    run.barrier()  # a safe call's records are pipelined: durable before the test kills
    flags.set("after-calls", json.dumps({"len": len(got), "tail": got[-300:]}))
    if opts.hold_after:
        flags.hold()
    run.finish("succeeded", "fetched")


def scenario_finish(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    """The README's worker shape: calls, then finish; re-executed from the top."""
    run.call_tool("fetch", {"url": "https://example.test/a"})
    ev = run.finish(opts.outcome, "done")
    flags.set("finished", json.dumps({"seq": ev.seq, "outcome": opts.outcome}))
    if opts.hold_after:
        flags.hold()


def scenario_guardrail(run: runlog.Run, opts: argparse.Namespace, flags: Flags) -> None:
    """An agent whose model text trips a guardrail; the model thinks ``think_s`` after it."""

    def tripwire(text: str) -> tuple[str, str, str] | None:
        if "password" in text:
            return ("secrets", "warning", "model mentioned a password")
        return None

    model = ScriptedModel([ModelStep("the password is hunter2"), FinishStep("succeeded")])
    loop = AgentLoop(model, guardrails=[tripwire])
    if opts.hold_after:
        # Hold between the guardrail record and the model turn: wrap append.
        engine = engine_of(run)  # the loop drives the run's engine
        original = engine.append

        def append(event_type: Any, payload: Any = None, **kw: Any) -> Any:
            ev = original(event_type, payload, **kw)
            if runlog.EventType(event_type) is runlog.EventType.GUARDRAIL_TRIGGERED:
                flags.set("guardrail-recorded")
                flags.hold()
            return ev

        engine.append = append  # type: ignore[method-assign]
    loop.run(run, user_message="check the account")


SCENARIOS = by_name(
    scenario_fetch, scenario_finish, scenario_guardrail, scenario_conflict, scenario_refund
)


def main() -> int:
    ap = worker_parser(SCENARIOS, scenario="fetch", reconcile="none", risk="safe")
    ap.add_argument("--mode", choices=["normal", "block-after"], default="normal")
    ap.add_argument("--result", choices=["small", "large", "surrogate"], default="small")
    ap.add_argument("--sink", action="store_true")
    ap.add_argument("--outcome", default="succeeded")
    ap.add_argument("--hold-before-escalate", action="store_true")
    opts = ap.parse_args()

    settings = Settings()
    opts.prefix = settings.redis_key_prefix
    flags = Flags(opts.dir, opts.name)
    store = redis_client(settings)
    ledger = Ledger(store, settings.redis_key_prefix)
    tools = [make_fetch(opts, flags, ledger, store), *make_pay_refund(opts, ledger)]
    if opts.hold_before_escalate:
        hold_before_escalating(flags)

    def open_run() -> runlog.Run:
        return runlog.open_run(opts.run_id, tools=tools, settings=settings, agent="effects")

    def scenario(run: runlog.Run) -> None:
        if run.state.status != "finished" or opts.scenario == "finish":
            SCENARIOS[opts.scenario](run, opts, flags)

    return run_worker(settings, flags, open_run, scenario, STOPPED_BY_FINISHING)


if __name__ == "__main__":
    sys.exit(main())
