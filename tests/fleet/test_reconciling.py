"""``runlog reconcile``: an operator settles uncertain calls with their tools' lookups, on the
real stack with `runlog worker` processes (agents in ``workers.reconcile_agents``).

The case it exists for: ``runlog terminate`` while an irreversible refund is in flight; the
fenced worker's request still reaches the receiver, which makes the refund. The log keeps
the call open for good (nothing resumes a terminated run) until a person asks the fleet to
run the tool's lookup: then it is ``completed (reconciliation)`` in the log and in the
projections, the run stays ``terminated``, and nothing is invoked again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from confluent_kafka import Consumer
from fleet_support import Fleet, fleet_env, states
from scan_support import partition_records
from ui_support import TOKEN_A, TOKEN_B, console, projecting

import runlog
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.log._kafka import reader_config
from runlog.log._reader import LogReader
from runlog.producers._handle import engine_of
from runlog.projections._run_state import RunState, accept, rejection
from runlog.schemas import _models as m
from runlog.schemas._keys import partition_for
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(180)
AGENTS = "workers.reconcile_agents"


class Crash(BaseException):
    """Not an Exception: the owner dies after the receiver made the effect."""


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Any:
    f = Fleet(fleet_settings, tmp_path)
    yield f
    f.stop_all()


def _key(settings: Settings, name: str) -> str:
    return f"{settings.redis_key_prefix}:{name}"


def _cli(settings: Settings, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=fleet_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _events(settings: Settings, rid: str) -> list[m.Event]:
    with LogReader(settings) as reader:
        part = reader.partition_of(rid)
        return [r.event for r in reader.read(rid, partition=part, start=0)]


def _wait(what: str, cond: Any, timeout: float = 30, fleet: Fleet | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        logs = "" if fleet is None else "\n".join(fleet.tail(n, 1500) for n in fleet.logs)
        assert time.monotonic() < deadline, f"{what}\n{logs}"
        time.sleep(0.05)


def _terminated_refund(
    settings: Settings, fleet: Fleet, client: redis.Redis, tenant: str = "acme"
) -> tuple[str, str]:
    """A run of ``refunder`` terminated while its refund was in flight, and the refund then
    made by the fenced worker: (run id, the call's key)."""
    name = fleet.spawn(agents=AGENTS)
    rid = runlog.start("refunder", {"to": "jane"}, tenant=tenant, settings=settings)
    _wait("refund in flight", lambda: client.hlen(_key(settings, "inflight")) == 1, fleet=fleet)
    done = _cli(
        settings, "terminate", rid, "--tenant", tenant, "--reason", "runaway", "--by", "ops"
    )
    assert done.returncode == 0, done.stderr
    client.set(_key(settings, "release"), "1")
    _wait("the fenced worker's refund", lambda: client.hlen(_key(settings, "effects")) == 1)
    (key,) = [k.decode() for k in client.hkeys(_key(settings, "inflight"))]
    st = states(settings, [rid])[rid]
    assert (st.status, st.outcome) == ("finished", "terminated")
    assert key in st.open_calls, "terminate leaves the call open"
    assert fleet.procs[name].poll() is None, fleet.tail(name)
    return rid, key


def test_reconcile_settles_the_refund_a_terminated_run_left_uncertain(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    s = fleet_settings
    rid, key = _terminated_refund(s, fleet, redis_client)
    ProjectionRunner(s, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    queue = queries.uncertain_report(redis_client, s)
    assert [c["idempotency_key"] for c in queue.open] == [key], "the queue shows it open"

    done = _cli(s, "reconcile", rid, "--tenant", "acme", "--by", "ops@example", "--wait", "60")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed (reconciliation)" in done.stdout
    assert key in done.stdout

    raw = _events(s, rid)
    events = _valid(raw)
    st = states(s, [rid])[rid]
    # The run stays terminated; the call is closed by evidence, not by a retry.
    assert (st.status, st.outcome) == ("finished", "terminated")
    assert key not in st.open_calls
    assert st.completed_calls[key] == "refunded 30 to jane"
    completions = [
        e.payload
        for e in events
        if e.type is EventType.TOOL_CALL_COMPLETED and e.payload.idempotency_key == key
    ]
    assert [c.source for c in completions] == ["reconciliation"]
    recs = [e.payload for e in events if e.type is EventType.RECONCILIATION_ATTEMPTED]
    assert [(r.outcome, r.action) for r in recs] == [("match", "complete")]
    finish = next(e.seq for e in events if e.type is EventType.RUN_FINISHED)
    after = [e.type for e in events if e.seq > finish]
    assert EventType.TOOL_CALL_STARTED not in after, after
    # The receiver made the refund once; the lookup ran once; nothing invoked the tool.
    effects = {k.decode(): int(v) for k, v in redis_client.hgetall(_key(s, "effects")).items()}
    assert effects == {key: 1}
    # Nothing is fenced but what the fenced worker wrote under its old epoch (its own
    # completion of the refund, if it got that far before its lease check failed).
    terminated_at = next(e.epoch for e in raw if e.type is EventType.RUN_FINISHED)
    fenced = [e for e in raw if e not in events]
    assert all(e.epoch < terminated_at for e in fenced), fenced
    assert set(_rejections(raw)) <= {"stale_epoch", "stale_epoch_duplicate_seq"}
    verify = _cli(s, "verify", rid, "--tenant", "acme")
    assert verify.returncode == 0, verify.stdout + verify.stderr

    # The projections say the same: the queue no longer holds it, counted as reconciled;
    # the run's state projection has it completed and the run terminated.
    ProjectionRunner(s, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    queue = queries.uncertain_report(redis_client, s)
    assert queue.open == []
    assert queue.counters.get("reconciled") == 1
    view = queries.get_state(redis_client, s, rid, tenant="acme")
    assert view is not None
    assert view["state"]["outcome"] == "terminated"
    assert key in view["state"]["completed_calls"]
    assert key not in view["state"]["open_calls"]

    # Asked again, the key is no longer uncertain: refused, nothing appended.
    again = _cli(s, "reconcile", rid, key, "--tenant", "acme", "--by", "ops", "--wait", "20")
    assert again.returncode == 1
    assert "NotReconcilable" in again.stderr
    assert states(s, [rid])[rid].seq == st.seq


def test_reconcile_without_a_live_worker_says_so_and_writes_nothing(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    s = fleet_settings
    rid, key = _terminated_refund(s, fleet, redis_client)
    fleet.stop_all()
    _wait("the worker's presence expires", lambda: not runlog_workers(s))
    before = _lifecycle_keys(s, rid)
    done = _cli(s, "reconcile", rid, "--tenant", "acme", "--by", "ops", "--wait", "5")
    assert done.returncode == 1
    assert "NoLiveWorker" in done.stderr and "refunder" in done.stderr
    assert _lifecycle_keys(s, rid) == before, "no request was written"
    st = states(s, [rid])[rid]
    assert key in st.open_calls

    # --queue records it: not answered within --wait (exit 1, said so), then served by the
    # next worker that comes up.
    queued = _cli(s, "reconcile", rid, "--tenant", "acme", "--by", "ops", "--queue", "--wait", "1")
    assert queued.returncode == 1
    assert "NotSettledYet" in queued.stderr
    assert key in states(s, [rid])[rid].open_calls
    fleet.spawn(agents=AGENTS)
    _wait(
        "the queued request served",
        lambda: key in states(s, [rid])[rid].completed_calls,
        timeout=60,
        fleet=fleet,
    )
    assert states(s, [rid])[rid].outcome == "terminated"


def _terminated_in_flight(
    settings: Settings, client: redis.Redis, agent: str, fleet: Fleet
) -> tuple[str, str]:
    """A run of ``agent`` terminated while its one call is in flight: (run id, key)."""
    client.delete(_key(settings, "release"), _key(settings, "inflight"))
    rid = runlog.start(agent, {"to": "bob"}, tenant="acme", settings=settings)
    _wait("call in flight", lambda: client.hlen(_key(settings, "inflight")) == 1, fleet=fleet)
    (key,) = [k.decode() for k in client.hkeys(_key(settings, "inflight"))]
    runlog.terminate(rid, reason="stuck", by="ops", tenant="acme", settings=settings)
    return rid, key


def test_reconcile_puts_an_irreversible_call_without_lookup_to_a_person_and_refuses_the_rest(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """No lookup: an irreversible call is escalated (the risk rule's answer; its question
    then says what each answer does to the ended run); a reversible one would be retried,
    which checks nothing: refused, nothing appended. A key that is not open, or another
    tenant's run, is refused too."""
    s = fleet_settings
    fleet.spawn(agents=AGENTS)
    charged, charge_key = _terminated_in_flight(s, redis_client, "charger", fleet)
    mailed, mail_key = _terminated_in_flight(s, redis_client, "mailer", fleet)
    redis_client.set(_key(s, "release"), "1")

    done = _cli(s, "reconcile", charged, charge_key, "--tenant", "acme", "--by", "ops")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "escalated" in done.stdout
    st = states(s, [charged])[charged]
    assert st.open_calls[charge_key].status == "escalated" and st.pending_approvals
    assert st.outcome == "terminated"

    seq = states(s, [mailed])[mailed].seq
    nolookup = _cli(s, "reconcile", mailed, mail_key, "--tenant", "acme", "--by", "ops")
    assert nolookup.returncode == 1
    assert "NotReconcilable" in nolookup.stderr and "mail" in nolookup.stderr
    notopen = _cli(s, "reconcile", mailed, "no-such-key", "--tenant", "acme", "--by", "ops")
    assert notopen.returncode == 1 and "NotReconcilable" in notopen.stderr
    other = _cli(s, "reconcile", mailed, "--tenant", "other", "--by", "ops")
    assert other.returncode == 4
    st = states(s, [mailed])[mailed]
    assert st.seq == seq and mail_key in st.open_calls, "nothing was appended"


def test_a_reconcile_racing_a_resume_leaves_one_consistent_log(
    fleet_settings: Settings, redis_client: redis.Redis
) -> None:
    """An orphaned call (its owner died between STARTED and any outcome); a resume of the run
    (recovery runs the lookup) and a reconcile, released together from a barrier: the lease
    lets one act at a time, the other finds the call settled. One completion, one match, no
    fenced write, and the run still open for its owner."""
    s = fleet_settings
    results = _key(s, "results")

    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        redis_client.hset(results, idempotency_key, f"refunded {args['amount']}")
        raise Crash

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> runlog.Match | runlog.Absent:
        found = redis_client.hget(results, idempotency_key)
        return runlog.Absent("none") if found is None else runlog.Match(found.decode())

    def never(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise AssertionError("the refund is never invoked again")

    crashing = runlog.tool("refund", risk="irreversible", reconcile=lookup)(dies)
    refund = runlog.tool("refund", risk="irreversible", reconcile=lookup)(never)
    for attempt in range(3):
        _race_once(s, crashing, refund, attempt)


def _race_once(s: Settings, crashing: runlog.Tool, refund: runlog.Tool, attempt: int) -> None:
    run = runlog.open_run(tenant="acme", tools=[crashing], settings=s)
    rid = run.run_id
    with pytest.raises(Crash):
        run.call_tool("refund", {"to": "jane", "amount": attempt})
    engine_of(run).lease.release()  # the owner is gone; its lease with it
    key = next(iter(run.state.open_calls))

    barrier = threading.Barrier(2)
    got: dict[str, Any] = {}

    def resume() -> None:
        barrier.wait()
        with runlog.open_run(rid, tenant="acme", tools=[refund], settings=s) as r:
            got["resume"] = r.state.seq

    def reconcile() -> None:
        barrier.wait()
        try:
            got["reconcile"] = runlog.reconcile(
                rid, key, by="ops", tenant="acme", tools=[refund], settings=s
            )
        except runlog.NotReconcilable as exc:
            got["reconcile"] = exc

    threads = [threading.Thread(target=resume), threading.Thread(target=reconcile)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(got) == {"resume", "reconcile"}, got
    st: RunState = states(s, [rid])[rid]
    events = _events(s, rid)
    completions = [e for e in events if e.type is EventType.TOOL_CALL_COMPLETED]
    matches = [e for e in events if e.type is EventType.RECONCILIATION_ATTEMPTED]
    assert len(completions) == 1, events
    assert completions[0].payload.source == "reconciliation"
    assert [e.payload.outcome for e in matches] == ["match"]
    # A claim made on a view the other had just moved past is refused and made again
    # (the open path's own rule); nothing else of either may be fenced.
    assert set(_rejections(events)) <= {"lost_claim"}, _rejections(events)
    assert st.status == "running" and key in st.completed_calls
    outcome = got["reconcile"]
    if isinstance(outcome, runlog.NotReconcilable):
        assert outcome.why == "not_open"  # the resume settled it first
    else:
        assert [x.outcome for x in outcome.settled] == ["completed"]


def _valid(events: list[m.Event]) -> list[m.Event]:
    """The records the fold accepts, in log order."""
    state = RunState()
    return [ev for ev in events if accept(state, ev)]


def _terminated_during_refund(settings: Settings, dies: Any, lookup: Any) -> tuple[str, str]:
    """A run whose irreversible refund (``dies``, with ``lookup``) crashed after its STARTED,
    then terminated by an operator: the call is left open. Returns the run id and its key."""
    run = runlog.open_run(
        tenant="acme",
        tools=[runlog.tool("refund", risk="irreversible", reconcile=lookup)(dies)],
        settings=settings,
    )
    with pytest.raises(Crash):
        run.call_tool("refund", {"to": "jane", "amount": 30})
    engine_of(run).lease.release()
    rid, key = run.run_id, next(iter(run.state.open_calls))
    runlog.terminate(rid, reason="runaway", by="ops", tenant="acme", settings=settings)
    return rid, key


def _rejections(events: list[m.Event]) -> list[str]:
    """Why the fold refused each record it refused, in log order."""
    state, out = RunState(), []
    for ev in events:
        why = rejection(state, ev)
        if why is not None:
            out.append(why)
        accept(state, ev)
    return out


def runlog_workers(settings: Settings) -> list[dict[str, str]]:
    done = _cli(settings, "workers", "--json")
    assert done.returncode == 0, done.stderr
    found: list[dict[str, str]] = json.loads(done.stdout)
    return found


def _lifecycle_keys(settings: Settings, rid: str) -> list[bytes]:
    consumer = Consumer(reader_config(settings))
    try:
        part = partition_for(rid, settings.partitions)
        msgs = partition_records(consumer, settings.lifecycle_topic, part)
    finally:
        consumer.close()
    return [msg.key() for msg in msgs]


def test_the_consoles_reconcile_button_settles_the_call_or_says_why_not(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """The uncertain page offers Reconcile on an uncertain call; pressing it has the fleet
    run the lookup, and the run's page says the call is completed by evidence. A call whose
    tool has no lookup gets a page that says so (nothing recorded); another tenant's run is
    not found."""
    s = fleet_settings
    rid, key = _terminated_refund(s, fleet, redis_client)
    redis_client.delete(_key(s, "release"), _key(s, "inflight"))
    blind, blind_key = _terminated_in_flight(s, redis_client, "mailer", fleet)
    redis_client.set(_key(s, "release"), "1")
    with projecting(s, redis_client), console(s) as base:
        web = httpx.Client(base_url=base, follow_redirects=False, timeout=60)
        acme = {"Authorization": f"Bearer {TOKEN_A}"}
        _wait(
            "the uncertain page lists both",
            lambda: all(k in web.get("/uncertain", headers=acme).text for k in (key, blind_key)),
        )
        page = web.get("/uncertain", headers=acme).text
        assert f'data-key="{key}"' in page, "a Reconcile button for the call"

        r = web.post(f"/runs/{rid}/reconcile", data={"key": key}, headers=acme)
        assert r.status_code == 303, r.text
        assert r.headers["location"] == f"/runs/{rid}?done=reconcile-completed"
        st = states(s, [rid])[rid]
        assert key in st.completed_calls and st.outcome == "terminated"
        assert "completed (by evidence)" in web.get(r.headers["location"], headers=acme).text

        seq = states(s, [blind])[blind].seq
        no = web.post(f"/runs/{blind}/reconcile", data={"key": blind_key}, headers=acme)
        assert (
            no.status_code == 409
            and "declares no lookup" in no.text
            and "Nothing was recorded" in no.text
        )
        assert states(s, [blind])[blind].seq == seq, "nothing recorded"

        other = {"Authorization": f"Bearer {TOKEN_B}"}
        assert (
            web.post(f"/runs/{rid}/reconcile", data={"key": key}, headers=other).status_code == 404
        )


@pytest.mark.parametrize("answer", ["absent", "unavailable", "conflict"])
def test_a_lookup_without_a_match_on_an_ended_run_invokes_nothing_and_says_so(
    fleet_settings: Settings, redis_client: redis.Redis, answer: str
) -> None:
    """Reconciled in this process, with the tools (no fleet): an ended run whose lookup
    finds no matching effect. Absent: the refund's receiver declares nothing that makes an
    absence final (its original request may still land), so a person is asked, and nothing
    is invoked; unavailable: stays uncertain; conflict: escalated to a person with both
    payloads, the run still terminated."""
    s = fleet_settings

    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise Crash

    def never(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise AssertionError("an ended run's call is never invoked again")

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        if answer == "absent":
            return runlog.Absent("no refund under the key")
        if answer == "conflict":
            return runlog.Conflict('{"amount": 31}')
        return runlog.Inconclusive("the provider's lookup is down")

    rid, key = _terminated_during_refund(s, dies, lookup)

    refund = runlog.tool("refund", risk="irreversible", reconcile=lookup)(never)
    done = runlog.reconcile(rid, key, by="ops", tenant="acme", tools=[refund], settings=s)
    (settled,) = done.settled
    assert done.finished
    assert settled.outcome == {"unavailable": "uncertain"}.get(answer, "escalated")
    assert settled.evidence.startswith(answer)
    events = _events(s, rid)
    finish = next(e.seq for e in events if e.type is EventType.RUN_FINISHED)
    after = [e.type for e in events if e.seq > finish]
    assert EventType.TOOL_CALL_STARTED not in after and EventType.TOOL_CALL_COMPLETED not in after
    assert set(_rejections(events)) <= {"lost_claim"}, _rejections(events)
    st = states(s, [rid])[rid]
    assert (st.status, st.outcome) == ("finished", "terminated") and key in st.open_calls
    if answer == "conflict":
        assert st.open_calls[key].status == "conflict" and st.pending_approvals
    if answer == "absent":
        assert st.pending_approvals, "a person is asked about the absent refund"


@pytest.mark.parametrize("receiver", ["fenced", "dedupes_by_key"])
def test_an_absence_made_final_on_an_ended_run_records_no_retry_and_asks_a_person(
    fleet_settings: Settings, redis_client: redis.Redis, receiver: str
) -> None:
    """The receiver makes the lookup's absence final, which on a live run allows a retry.
    On an ended run nothing is invoked, so the record must not say "retry": it says that
    the absence was final and the run has ended, and a person is asked to close the call."""
    s = fleet_settings

    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise Crash

    def never(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise AssertionError("an ended run's call is never invoked again")

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        return runlog.Absent("no refund under the key")

    rid, key = _terminated_during_refund(s, dies, lookup)
    refund = runlog.tool("refund", risk="irreversible", reconcile=lookup, receiver=receiver)(never)
    done = runlog.reconcile(rid, key, by="ops", tenant="acme", tools=[refund], settings=s)
    (settled,) = done.settled
    assert done.finished and settled.outcome == "escalated"
    events = _events(s, rid)
    finish = next(e.seq for e in events if e.type is EventType.RUN_FINISHED)
    recorded = [
        e.payload
        for e in events
        if e.seq > finish and isinstance(e.payload, m.ReconciliationAttempted)
    ]
    assert [(r.outcome, r.action) for r in recorded] == [("absent", "escalate")]
    after = [e.type for e in events if e.seq > finish]
    assert EventType.TOOL_CALL_STARTED not in after and EventType.TOOL_CALL_COMPLETED not in after
    st = states(s, [rid])[rid]
    assert (st.status, st.outcome) == ("finished", "terminated")
    assert st.open_calls[key].status == "escalated" and st.pending_approvals


def test_two_reconciles_of_a_terminated_run_at_once_record_one_settlement(
    fleet_settings: Settings, redis_client: redis.Redis
) -> None:
    """Released together from a barrier: the lease lets one settle the call; the other
    finds it settled (``not_open``) and appends nothing, whichever order they reach it."""
    s = fleet_settings
    results = _key(s, "results")

    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        redis_client.hset(results, idempotency_key, "refunded 30")
        raise Crash

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> runlog.Match | runlog.Absent:
        found = redis_client.hget(results, idempotency_key)
        return runlog.Absent("none") if found is None else runlog.Match(found.decode())

    rid, key = _terminated_during_refund(s, dies, lookup)
    refund = runlog.tool("refund", risk="irreversible", reconcile=lookup)(dies)
    barrier = threading.Barrier(2)
    got: list[Any] = []

    def one(who: str) -> None:
        barrier.wait()
        try:
            got.append(
                runlog.reconcile(rid, key, by=who, tenant="acme", tools=[refund], settings=s)
            )
        except runlog.NotReconcilable as exc:
            got.append(exc)

    threads = [threading.Thread(target=one, args=(w,)) for w in ("ann", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 2
    settled = [g for g in got if isinstance(g, runlog.Reconciliation)]
    refused = [g for g in got if isinstance(g, runlog.NotReconcilable)]
    assert len(settled) == 1 and len(refused) == 1 and refused[0].why == "not_open"
    events = _events(s, rid)
    assert [e.payload.source for e in events if e.type is EventType.TOOL_CALL_COMPLETED] == [
        "reconciliation"
    ]
    assert set(_rejections(events)) <= {"lost_claim"}, _rejections(events)
    st = states(s, [rid])[rid]
    assert st.outcome == "terminated" and key in st.completed_calls


def test_a_live_runs_page_offers_reconcile_on_an_uncertain_call_and_refuses_without_agent(
    fleet_settings: Settings, redis_client: redis.Redis
) -> None:
    """A run in progress (not of the fleet) with an uncertain call: its page has the button;
    pressed, the console says no worker has the run's tools (it was not started through the
    agent registry) and nothing is recorded."""
    s = fleet_settings

    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise Crash

    run = runlog.open_run(
        tenant="acme", tools=[runlog.tool("refund", risk="irreversible")(dies)], settings=s
    )
    with pytest.raises(Crash):
        run.call_tool("refund", {"to": "jane", "amount": 30})
    engine_of(run).lease.release()
    rid, key = run.run_id, next(iter(run.state.open_calls))
    runlog.open_run(rid, tenant="acme", settings=s).close()  # uncertain now, still running
    seq = states(s, [rid])[rid].seq
    with projecting(s, redis_client), console(s) as base:
        web = httpx.Client(base_url=base, follow_redirects=False, timeout=60)
        acme = {"Authorization": f"Bearer {TOKEN_A}"}
        _wait(
            "the run is projected", lambda: web.get(f"/runs/{rid}", headers=acme).status_code == 200
        )
        assert f'data-key="{key}"' in web.get(f"/runs/{rid}", headers=acme).text
        r = web.post(f"/runs/{rid}/reconcile", data={"key": key}, headers=acme)
        assert r.status_code == 409 and "agent registry" in r.text
    st = states(s, [rid])[rid]
    assert st.seq == seq and key in st.open_calls and st.status == "running"


@pytest.mark.parametrize("approved", [False, True])
def test_a_person_decides_the_conflict_a_reconcile_found_on_an_ended_run(
    fleet_settings: Settings, redis_client: redis.Redis, approved: bool
) -> None:
    """The lookup finds a conflicting effect on a terminated run: escalated. The person's
    decision is recorded in the ended run's log (a decider takes it to settle it): rejected,
    the call closes (resolved by the person, nothing invoked); approved, the decision stands
    but an ended run retries nothing, and a reconcile says so."""
    s = fleet_settings

    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise Crash

    def never(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise AssertionError("an ended run's call is never invoked again")

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> runlog.Conflict:
        return runlog.Conflict('{"amount": 31}')

    rid, key = _terminated_during_refund(s, dies, lookup)
    refund = runlog.tool("refund", risk="irreversible", reconcile=lookup)(never)
    runlog.reconcile(rid, key, by="ops", tenant="acme", tools=[refund], settings=s)
    (approval,) = states(s, [rid])[rid].pending_approvals
    # The question says what each answer does to an ended run: nothing is invoked.
    q = runlog.question(rid, approval, tenant="acme", settings=s)
    assert q.ended == "terminated" and not q.undoable
    assert "nothing is retried" in q.confirmation(True)
    assert "nothing is invoked" in q.confirmation(False)

    how = runlog.decide(
        rid,
        approval,
        approved=approved,
        decided_by="ann",
        note="checked",
        tenant="acme",
        settings=s,
    )
    assert how == "recorded"
    st = states(s, [rid])[rid]
    assert (st.status, st.outcome) == ("finished", "terminated")
    assert not st.pending_approvals
    if approved:
        assert st.open_calls[key].status == "decided"
        done = runlog.reconcile(rid, key, by="ops", tenant="acme", tools=[refund], settings=s)
        assert [x.outcome for x in done.settled] == ["decided"]
        assert key in states(s, [rid])[rid].open_calls
    else:
        assert st.completed_calls[key].startswith("resolved by ann")
    events = _events(s, rid)
    finish = next(e.seq for e in events if e.type is EventType.RUN_FINISHED)
    assert EventType.TOOL_CALL_STARTED not in [e.type for e in events if e.seq > finish]
    assert set(_rejections(events)) <= {"lost_claim"}, _rejections(events)
