"""An agent worker process the explorer starts, kills, pauses and takes over.

    python tests/explorer/worker.py --run-id R --plan JSON --journal FILE [--takeover]
        [--tenant T] [--async] [--decide approve|reject] [--decide-again AID:approve|reject]

The plan is the run's script: a list of ``[tool, args]`` calls, each followed by a user
message, then ``finish``. A worker re-executed from the top recomputes the same keys, so
a call the log holds as completed is not run again. Four tools, one per way of settling
an uncertain outcome, change a receiver outside every worker (a private Redis, the
"ledger", at ``EXPLORER_LEDGER_URL``), recording each effect with its idempotency key:

* ``probe``   safe, no lookup: retried blindly after a crash (harmless by declaration);
* ``refund``  reversible, a lookup and an inverse: a conflicting effect is compensated;
* ``charge``  irreversible with an authoritative lookup (match / absent / conflict /
  unavailable);
* ``ticket``  irreversible, no lookup: an uncertain ticket waits for a person.

Like the demo's ledger, the receivers of these four refuse a request whose fencing token
(``runlog.current_call().epoch``) is older than one they have seen for the run, and a
lookup raises that fence before it answers: so "absent" is final (a paused worker's late
request can no longer commit), which is the contract README asks of a receiver before
recovery may retry on absence.

Three more tools, only in the runs of the explorer's ``pause_call`` step (a worker frozen
inside its call while the run is taken over), cover the other receiver declarations, each
irreversible with an authoritative lookup:

* ``wire``    ``receiver="deadline"``: the receiver refuses a request past the commit
  deadline it carries (by the ledger's clock), ``commit_window_s`` = ``WIRE_WINDOW_S``;
* ``credit``  ``receiver="dedupes_by_key"``: a key's effect is applied once;
* ``letter``  declares nothing, and its receiver honours nothing: every request that
  arrives is applied, so "absent" is never final and recovery must not retry on it.

The fault ``hold`` (queued like the others) makes the call write its key to the ledger
(``held:<run>``) and wait, its request not sent yet, until the explorer releases it
(``release:<run>``): the moment the explorer freezes the worker.

Receiver and reconciler faults are queued in the ledger by the explorer (``fault:<run>:<tool>``,
``recon:<run>:<tool>``) and taken one per call, so a fault hits the next call of that tool
whichever worker makes it. Every append the worker was told is durable goes to the
journal (one O_APPEND line), so the checker can look for it in the log afterwards.

``--async`` drives the run through ``runlog.aio``: every call of the plan is issued at
once (``asyncio.gather``) on one ``AsyncRun``. ``--decide`` makes the owner decide its
own first pending approval (``Run.decide``) before it goes on; ``--decide-again`` makes it
contradict a decision already in the log, which must be refused (``DecisionConflict``,
journaled as ``decide-refused``; an accepted one is ``decide-accepted``, a finding). A
tenant name runlog refuses exits ``EXIT_INVALID_TENANT``: an expected refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import redis  # noqa: E402
from workers.common import EXIT_OK, stopped_by  # noqa: E402

import runlog  # noqa: E402
import runlog.aio  # noqa: E402
from runlog._bootstrap import Services  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.errors import (  # noqa: E402
    AppendOutcomeUnknown,
    ConfigError,
    DecisionConflict,
    InvalidTenant,
    KafkaUnavailable,
    RedisUnavailable,
    RegistryUnavailable,
)
from runlog.producers._tools import Evidence  # noqa: E402
from runlog.schemas._canonical import canonical_json  # noqa: E402

# The writer tests' exit codes, and three more for what only the explorer provokes.
EXIT_UNCLEAR = 1
EXIT_CONFIG = 9
EXIT_UNAVAILABLE = 10
EXIT_INVALID_TENANT = 11
HUGE_BYTES = 2 * 1024 * 1024
ODD_RESULT = "odd \ud800 result \x00 with NUL, \u202e RTL and \x1b[31m escapes"


APPLY_LUA = """
local seen = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) < seen then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[4], ARGV[3], ARGV[5])
redis.call('HSET', KEYS[5], ARGV[3], ARGV[1])
return 1
"""
APPLY_UNFENCED_LUA = """
if ARGV[5] == 'deadline' then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) > tonumber(ARGV[6]) then
    redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
    return 0
  end
end
if ARGV[5] == 'dedupes_by_key' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return 1
end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
return 1
"""
LOOKUP_LUA = """
local seen = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > seen then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return redis.call('HGET', KEYS[2], ARGV[3])
"""


class Receiver:
    """The ledger: effects by key, outside the worker, Kafka and the faulted Redis."""

    def __init__(self, url: str, ns: str, run_id: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.ns = ns
        self.run_id = run_id

    def k(self, name: str) -> str:
        return f"{self.ns}:{name}"

    def epoch(self) -> int:
        ctx = runlog.current_call()
        return 0 if ctx is None else ctx.epoch

    def apply(self, tool: str, key: str, args: dict[str, Any]) -> None:
        """Apply the effect, unless a newer owner of the run has been seen (a late request
        of a paused, fenced worker): refused, so nothing happens, a proven failure."""
        done = self.r.eval(
            APPLY_LUA,
            5,
            self.k("fence"),
            self.k("L:count"),
            self.k("L:args"),
            self.k("L:tool"),
            self.k("L:run"),
            self.run_id,
            self.epoch(),
            key,
            canonical_json(args),
            tool,
        )
        if not done:
            raise runlog.ToolError("refused: a newer owner of this run has called (fencing token)")

    def apply_as(self, honours: str, tool: str, key: str, args: dict[str, Any]) -> None:
        """The receivers of the pause-only tools: ``deadline`` refuses a request past its
        commit deadline, ``dedupes_by_key`` applies a key once, ``none`` applies anything."""
        ctx = runlog.current_call()
        deadline_us = 0 if ctx is None else int(ctx.commit_deadline.timestamp() * 1_000_000)
        done = self.r.eval(
            APPLY_UNFENCED_LUA,
            5,
            self.k("L:count"),
            self.k("L:args"),
            self.k("L:tool"),
            self.k("L:run"),
            self.k("L:refused"),
            key,
            canonical_json(args),
            tool,
            self.run_id,
            honours,
            deadline_us,
        )
        if not done:
            raise runlog.ToolError("refused: past the request's commit deadline")

    def hold(self, key: str) -> None:
        """Say which call is held, then wait (unsent) until the explorer releases it."""
        self.r.set(self.k(f"held:{self.run_id}"), key)
        deadline = time.monotonic() + 300
        while not self.r.exists(self.k(f"release:{self.run_id}")):
            if time.monotonic() > deadline:
                raise TimeoutError("held for 300 s and never released")
            time.sleep(0.02)

    def next_fault(self, tool: str) -> str:
        raw = self.r.lpop(self.k(f"fault:{self.run_id}:{tool}"))
        return "normal" if raw is None else raw.decode()

    def lookup(self, tool: str, key: str, args: dict[str, Any]) -> Evidence:
        if self.r.lpop(self.k(f"recon:{self.run_id}:{tool}")) is not None:
            return runlog.Inconclusive("the receiver's lookup timed out")
        # Raising the fence first makes "absent" final: a late request of an older owner
        # can no longer commit, which is what lets recovery retry on absence.
        found = self.r.eval(
            LOOKUP_LUA, 2, self.k("fence"), self.k("L:args"), self.run_id, self.epoch(), key
        )
        if found is None:
            # The worker that sent it is dead or got its answer: nothing can commit later.
            return runlog.Absent(f"no effect under {key}")
        if found.decode() != canonical_json(args):
            return runlog.Conflict(found.decode())
        return runlog.Match(f"{tool} {canonical_json(args)}")

    def lookup_plain(self, tool: str, key: str, args: dict[str, Any]) -> Evidence:
        """The pause-only tools' lookup: what is there now, raising no fence (an absence
        is final only by what the tool's receiver declares)."""
        found = self.r.hget(self.k("L:args"), key)
        if found is None:
            return runlog.Absent(f"no effect under {key} (yet)")
        if found.decode() != canonical_json(args):
            return runlog.Conflict(found.decode())
        return runlog.Match(f"{tool} {canonical_json(args)}")


Failure = tuple[float, type[Exception], str]
"""A failing receiver: seconds it hangs, then the error the caller sees and its message."""

FAILS_BEFORE_THE_EFFECT: dict[str, Failure] = {
    "refuse": (0.0, runlog.ToolError, "the receiver refused: nothing happened"),
    "fail-before": (0.0, ConnectionError, "connection reset before the request was sent"),
    "timeout": (1.5, TimeoutError, "no answer within 1.5 s (the request never arrived)"),
}
FAILS_AFTER_THE_EFFECT: dict[str, Failure] = {
    "fail-after": (0.0, TimeoutError, "timed out after the receiver applied the effect"),
    "timeout-after": (1.5, TimeoutError, "no answer within 1.5 s (the effect was applied)"),
}


def fail(failure: Failure) -> NoReturn:
    hang_s, error, message = failure
    if hang_s:
        time.sleep(hang_s)
    raise error(message)


PAUSE_ONLY: dict[str, str] = {"wire": "deadline", "credit": "dedupes_by_key", "letter": "none"}
"""The pause-only tools and what their receivers honour."""
WIRE_WINDOW_S = 4.0
"""``wire``'s commit window: a takeover may come before or after the deadline."""


def make_tools(rx: Receiver) -> list[runlog.Tool]:
    def body(tool: str, args: dict[str, Any], key: str) -> str:
        mode = rx.next_fault(tool)
        if mode == "hold":
            rx.hold(key)
        if mode in FAILS_BEFORE_THE_EFFECT:
            fail(FAILS_BEFORE_THE_EFFECT[mode])
        if mode == "conflict":
            rx.apply(tool, key, {**args, "tampered": True})
            raise TimeoutError("timed out after the receiver applied something else")
        if tool in PAUSE_ONLY:
            rx.apply_as(PAUSE_ONLY[tool], tool, key, args)
        else:
            rx.apply(tool, key, args)
        if mode in FAILS_AFTER_THE_EFFECT:
            fail(FAILS_AFTER_THE_EFFECT[mode])
        if mode == "huge":
            return "".join(f"line {i:07d} of a huge answer\n" for i in range(HUGE_BYTES // 30))
        if mode == "odd":
            return ODD_RESULT
        return f"{tool} {canonical_json(args)}"

    def fn(tool: str) -> Any:
        def call(args: dict[str, Any], *, idempotency_key: str) -> str:
            return body(tool, args, idempotency_key)

        return call

    def lookup(tool: str) -> Any:
        def find(args: dict[str, Any], *, idempotency_key: str) -> Evidence:
            return rx.lookup(tool, idempotency_key, args)

        return find

    def plain_lookup(tool: str) -> Any:
        def find(args: dict[str, Any], *, idempotency_key: str) -> Evidence:
            return rx.lookup_plain(tool, idempotency_key, args)

        return find

    def undo(args: dict[str, Any], *, idempotency_key: str, original_key: str) -> str:
        pipe = rx.r.pipeline(transaction=True)
        pipe.hincrby(rx.k("L:undone"), original_key, 1)
        pipe.hdel(rx.k("L:args"), original_key)  # undone: the key holds no effect any more
        pipe.hincrby(rx.k("L:count"), idempotency_key, 1)
        pipe.hset(rx.k("L:tool"), idempotency_key, "refund/compensate")
        pipe.hset(rx.k("L:run"), idempotency_key, rx.run_id)
        pipe.execute()
        return f"undid {original_key}"

    return [
        runlog.tool("probe", risk="safe")(fn("probe")),
        runlog.tool(
            "refund",
            risk="reversible",
            reconcile=lookup("refund"),
            compensate=undo,
            receiver="fenced",
        )(fn("refund")),
        runlog.tool("charge", risk="irreversible", reconcile=lookup("charge"), receiver="fenced")(
            fn("charge")
        ),
        runlog.tool("ticket", risk="irreversible")(fn("ticket")),
        runlog.tool(
            "wire",
            risk="irreversible",
            reconcile=plain_lookup("wire"),
            receiver="deadline",
            commit_window_s=WIRE_WINDOW_S,
        )(fn("wire")),
        runlog.tool(
            "credit",
            risk="irreversible",
            reconcile=plain_lookup("credit"),
            receiver="dedupes_by_key",
        )(fn("credit")),
        runlog.tool("letter", risk="irreversible", reconcile=plain_lookup("letter"))(fn("letter")),
    ]


class Journal:
    def __init__(self, path: str, run_id: str, name: str) -> None:
        self.path, self.run_id, self.name = path, run_id, name

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "run": self.run_id, "worker": self.name, **fields})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one small write: atomic across processes
        finally:
            os.close(fd)

    def ack(self, run: runlog.Run | runlog.aio.AsyncRun, event_id: str | None = None) -> None:
        self.write("ack", seq=run.state.seq, epoch=run.epoch, event_id=event_id)


def drive(run: runlog.Run, plan: list[list[Any]], journal: Journal, pace_s: float) -> None:
    for i, (tool, args) in enumerate(plan):
        time.sleep(pace_s)  # model think time: kills and pauses land between and inside calls
        for attempt in range(3):
            try:
                run.call_tool(tool, args)
                break
            except runlog.ToolFailed:
                # A proven failure: the same call again is the same action (same key). A
                # safe call's records are pipelined: durable (and acked) after a barrier.
                run.barrier()
                journal.ack(run)
                if attempt == 2:
                    raise
        run.barrier()
        journal.ack(run)
        content = f"after call {i}"
        if not any(m.content == content for m in run.state.messages):
            ev = run.append(runlog.EventType.USER_MESSAGE, content=content)
            journal.ack(run, ev.event_id)
    if run.state.status != "finished":
        ev = run.finish("succeeded", f"{len(plan)} calls")
        journal.ack(run, ev.event_id)


def _exit_code(exc: Exception, journal: Journal) -> int:
    """The exit code for what stopped the worker: the writer tests' codes for the errors of
    a run (``workers.common.STOPPED_BY``), then the explorer's own; anything else is shown."""
    stopped = stopped_by(exc)
    if stopped is not None:
        if isinstance(exc, runlog.Escalated):
            journal.write("escalated", approval_id=exc.approval_id)
        return stopped[1]
    if isinstance(exc, InvalidTenant):
        journal.write("invalid-tenant", error=str(exc)[:300])
        return EXIT_INVALID_TENANT
    if isinstance(exc, ConfigError):
        journal.write("config", error=str(exc)[:300])
        return EXIT_CONFIG
    unavailable = (AppendOutcomeUnknown, KafkaUnavailable, RedisUnavailable, RegistryUnavailable)
    if isinstance(exc, unavailable):
        journal.write("unavailable", error=f"{type(exc).__name__}: {exc}"[:300])
        return EXIT_UNAVAILABLE
    traceback.print_exc()
    return EXIT_UNCLEAR


Decision = tuple[str, bool, str, str]
"""What the owner decides: approval id ("" for its first pending one), approve, by, note."""


def owner_decisions(opts: argparse.Namespace) -> list[Decision]:
    out: list[Decision] = []
    if opts.decide:
        out.append(("", opts.decide == "approve", "explorer-owner", "decided by its owner"))
    if opts.decide_again:
        aid, verdict = opts.decide_again.rsplit(":", 1)
        out.append((aid, verdict == "approve", "explorer-again", "a second, contradicting one"))
    return out


def _which(run: runlog.Run | runlog.aio.AsyncRun, aid: str) -> str | None:
    if aid:
        return aid if aid in run.state.approvals else None
    pending = sorted(run.state.pending_approvals)
    return pending[0] if pending else None


def decide_as_owner(run: runlog.Run, decisions: list[Decision], journal: Journal) -> None:
    for want, approved, by, note in decisions:
        aid = _which(run, want)
        if aid is None:
            continue
        try:
            run.decide(aid, approved=approved, decided_by=by, note=note)
        except DecisionConflict:
            journal.write("decide-refused", approval_id=aid, approved=approved, by=by)
            continue
        journal.write("decide-accepted", approval_id=aid, approved=approved, by=by)
        journal.ack(run)


async def decide_as_async_owner(
    run: runlog.aio.AsyncRun, decisions: list[Decision], journal: Journal
) -> None:
    for want, approved, by, note in decisions:
        aid = _which(run, want)
        if aid is None:
            continue
        try:
            await run.decide(aid, approved=approved, decided_by=by, note=note)
        except DecisionConflict:
            journal.write("decide-refused", approval_id=aid, approved=approved, by=by)
            continue
        journal.write("decide-accepted", approval_id=aid, approved=approved, by=by)
        journal.ack(run)


async def drive_async(
    run: runlog.aio.AsyncRun, plan: list[list[Any]], journal: Journal, pace_s: float
) -> None:
    """Every call of the plan at once on one run (``asyncio.gather``): runlog serves them
    one after another; each effect still happens once per key. A proven failure is asked
    again (the same key) after the others, as the sync worker does at once."""
    await asyncio.sleep(pace_s)
    got = await asyncio.gather(
        *(run.call_tool(tool, args) for tool, args in plan), return_exceptions=True
    )
    await run.barrier()  # a safe call's records are pipelined: durable after a barrier
    journal.ack(run)
    for (tool, args), result in zip(plan, got, strict=True):
        if isinstance(result, runlog.ToolFailed):
            for attempt in range(2):
                try:
                    await run.call_tool(tool, args)
                    break
                except runlog.ToolFailed:
                    await run.barrier()
                    journal.ack(run)
                    if attempt == 1:
                        raise
            await run.barrier()
            journal.ack(run)
        elif isinstance(result, BaseException):
            raise result
    for i in range(len(plan)):
        content = f"after call {i}"
        if not any(m.content == content for m in run.state.messages):
            ev = await run.append(runlog.EventType.USER_MESSAGE, content=content)
            journal.ack(run, ev.event_id)
    if run.state.status != "finished":
        ev = await run.finish("succeeded", f"{len(plan)} calls")
        journal.ack(run, ev.event_id)


async def main_async(
    opts: argparse.Namespace, settings: Settings, rx: Receiver, journal: Journal
) -> int:
    plan = json.loads(opts.plan)
    code = EXIT_OK
    run: runlog.aio.AsyncRun | None = None
    try:
        run = await runlog.aio.open_run(
            opts.run_id,
            tenant=opts.tenant,
            tools=make_tools(rx),
            settings=settings,
            agent="explorer",
            takeover=opts.takeover,
        )
        journal.write("open", epoch=run.epoch, seq=run.state.seq, pid=os.getpid(), mode="async")
        if run.state.status != "finished":
            journal.ack(run)
            await decide_as_async_owner(run, owner_decisions(opts), journal)
            await drive_async(run, plan, journal, float(os.environ.get("EXPLORER_PACE_S", "0.3")))
    except Exception as exc:  # noqa: BLE001 - anything not named here is a finding: exit 1
        code = _exit_code(exc, journal)
    finally:
        if run is not None:
            try:
                await run.close()
            except runlog.RunlogError as exc:
                print(f"close: {exc}", file=sys.stderr)
    return code


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--takeover", action="store_true")
    ap.add_argument("--tenant", default="default")
    ap.add_argument("--async", dest="use_async", action="store_true")
    ap.add_argument("--decide", choices=("approve", "reject"), default=None)
    ap.add_argument("--decide-again", default=None, metavar="AID:approve|reject")
    opts = ap.parse_args()
    settings = Settings()
    rx = Receiver(os.environ["EXPLORER_LEDGER_URL"], os.environ["EXPLORER_LEDGER_NS"], opts.run_id)
    journal = Journal(opts.journal, opts.run_id, opts.name)
    if opts.use_async:
        code = asyncio.run(main_async(opts, settings, rx, journal))
    else:
        code = main_sync(opts, settings, rx, journal)
    with contextlib.suppress(Exception):  # closing a broken worker's clients: best effort
        Services.shared(settings).close()
    journal.write("exit", code=code)
    return code


def main_sync(opts: argparse.Namespace, settings: Settings, rx: Receiver, journal: Journal) -> int:
    plan = json.loads(opts.plan)
    code = EXIT_OK
    run: runlog.Run | None = None
    try:
        run = runlog.open_run(
            opts.run_id,
            tenant=opts.tenant,
            tools=make_tools(rx),
            settings=settings,
            agent="explorer",
            takeover=opts.takeover,
        )
        journal.write("open", epoch=run.epoch, seq=run.state.seq, pid=os.getpid(), mode="sync")
        if run.state.status != "finished":
            # A finished run is opened without an append: its last event is an older epoch's.
            journal.ack(run)
            decide_as_owner(run, owner_decisions(opts), journal)
            drive(run, plan, journal, float(os.environ.get("EXPLORER_PACE_S", "0.3")))
    except Exception as exc:  # noqa: BLE001 - anything not named here is a finding: exit 1
        code = _exit_code(exc, journal)
    finally:
        if run is not None:
            try:
                run.close()
            except runlog.RunlogError as exc:
                print(f"close: {exc}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
