"""Opening a run: the one call that starts and resumes.

Acquire the lease, replay the run's valid log into state, claim ownership with
RUN_STARTED or RUN_RESUMED (confirmed by reading the log back), then settle uncertain calls
before anything else may act.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from runlog.errors import (
    AgentMismatch,
    Fenced,
    NotReconcilable,
    RedisUnavailable,
    RunFinished,
    RunLocked,
    TenantMismatch,
    UnknownRun,
)
from runlog.log._authority import authority_for
from runlog.log._clients import REDIS_ERRORS
from runlog.log._fold import read_run
from runlog.log._reader import LogReader, Prefetch
from runlog.producers._approvals import (
    check_answer,
    decisions_key,
    refuse_forged,
    sign_decision,
)
from runlog.producers._approvals import conflict as approvals_conflict
from runlog.producers._engine import Engine, RunDeps, barrier_all, valid_kept
from runlog.producers._lease import METRICS, Held, Lease, new_owner
from runlog.producers._tools import Tool
from runlog.producers._writer import Delivered
from runlog.projections._run_state import RunState, standing_decision
from runlog.schemas import _codec as codec
from runlog.schemas._keys import check_run_id, new_run_id, partition_for
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

log = logging.getLogger(__name__)

CLAIM_ATTEMPTS = 5
"""Claims lost to concurrent owners before this worker gives up (it is then fenced)."""


LEASE_WAIT_REPORT_S = 5.0
"""How often an open that waits for another owner's lease says so again."""


def acquire(
    deps: RunDeps, tenant: str, run_id: str, wait_s: float, *, takeover: bool = False
) -> Lease:
    owner = new_owner(deps.writer_id)
    deadline = time.monotonic() + wait_s
    report_at = 0.0
    while True:
        got = deps.leases.try_acquire(
            tenant, run_id, owner, deps.settings.lease_ttl_ms, force=takeover
        )
        if isinstance(got, Lease):
            return got
        assert isinstance(got, Held)
        remaining = deadline - time.monotonic()
        if remaining > 0 and time.monotonic() >= report_at:
            # An owner that died keeps its lease until the TTL runs out: a resume waits that
            # long, and says for whom and until when rather than seeming to hang.
            until = codec.now_utc() + timedelta(milliseconds=got.ttl_ms)
            log.warning(
                "run %s: waiting for the lease held by %s, until %s (%.1f s) unless renewed; "
                "giving up in %.1f s",
                run_id,
                got.describe(),
                until.isoformat(timespec="milliseconds"),
                got.ttl_ms / 1000,
                remaining,
            )
            report_at = time.monotonic() + LEASE_WAIT_REPORT_S
        if remaining <= 0:
            locked = RunLocked(
                f"run {run_id} is held by {got.holder} (lease expires in {got.ttl_ms} ms)",
                run_id=run_id,
            )
            locked.holder_ttl_ms = got.ttl_ms
            raise locked
        time.sleep(min(remaining, max(0.02, min(got.ttl_ms / 1000, 0.05))))


def open_run_with(
    deps: RunDeps,
    run_id: str | None = None,
    *,
    tenant: str = "default",
    tools: Iterable[Tool] = (),
    wait_s: float | None = None,
    agent: str = "",
    goal: str = "",
    reason: str = "",
    recover: bool = True,
    create: bool = True,
    takeover: bool = False,
    operator: str | None = None,
    started_with: Mapping[str, str] | None = None,
    subject: str | None = None,
    expect_agent: str | None = None,
    prefetch: Prefetch | None = None,
    lease: Lease | None = None,
    batch: Batch | None = None,
) -> Engine:
    """Start a new run or resume an existing one: the same call either way.

    ``operator``: the person whose act (a decision, a cancellation, a termination) this
    opening is for; the RUN_RESUMED names them and is not counted as a resumption.
    ``started_with``: more fields of the RUN_STARTED this call may append (the agent
    registry's ``code_version`` and ``input_json``); ignored when the run exists.
    ``subject``: the data subject whose key seals the run's content (RUN_STARTED v3);
    None: the run itself. Ignored when the run exists (its RUN_STARTED said it).

    ``expect_agent``: the registered agent this opening will execute (a dispatch of the
    fleet). A run whose log recorded another agent (or none: a run not started by the
    registry) is refused with ``AgentMismatch`` before anything is appended or recovered:
    the log's agent, never the caller's, decides what code runs under the run's keys.

    ``create=False`` refuses to start a run that has no events (``UnknownRun``).
    ``takeover=True`` breaks a live lease at once instead of waiting for it to expire:
    for a supervisor that knows the owner died (it saw the process exit). If the owner
    was alive after all, fencing stops it at its next append.

    ``prefetch``: a pass over the run's partition made for many runs at once (a worker
    adopting a dead worker's runs); the replay reads from it when it covers the run.
    ``lease``: the run's lease, taken already (``LeaseManager.acquire_dead``: a worker
    adopting a dead worker's runs takes their leases in one round trip); released here
    if the open fails, as a lease this call takes.
    ``batch``: the run was claimed with others (``Batch``, a dead worker's runs adopted
    together): the run as that claim left it (or its failure, raised here); a run the
    batch does not hold is opened here as usual.
    """

    start = start_fields(agent, goal, started_with, subject)
    if run_id is None:
        return _start_fresh(deps, tenant, tools, start)
    rid = check_run_id(run_id)  # every caller, not only the facade: it spells Redis keys
    run = None if batch is None else batch.take(rid)
    if run is None:
        if lease is None:
            wait = deps.settings.lease_ttl_ms / 1000 + 1 if wait_s is None else wait_s
            lease = acquire(deps, tenant, rid, wait, takeover=takeover)
        elif (lease.tenant, lease.run_id) != (tenant, rid):
            raise ValueError(f"lease of run {lease.run_id} given to open run {rid}")
        claim = claim_of(
            lease,
            tools=tools,
            agent=agent,
            goal=goal,
            reason=reason,
            operator=operator,
            started_with=started_with,
            subject=subject,
            create=create,
            expect_agent=expect_agent,
        )
        try:
            reader = deps.reader_factory()
            try:
                run = _replayed(deps, reader, claim, prefetch)
                if run.state.status != "finished":
                    _claim(run, reader, claim)
            finally:
                reader.close()
        except BaseException:
            lease.release()
            raise
    if recover and run.state.status != "finished":
        try:
            # Decisions people queued while another worker held the run settle its
            # escalated calls; without this only an action-approval wait ever read them.
            run.poll_decisions()
            run.recover()
        except BaseException:
            run.lease.release()
            raise
    return run


def start_fields(
    agent: str, goal: str, started_with: Mapping[str, str] | None, subject: str | None
) -> dict[str, str]:
    """The fields of the RUN_STARTED an open appends to a run with no events."""
    start = {"agent": agent, "goal": goal, **(started_with or {})}
    if subject:
        start["subject"] = subject
    return start


@dataclass(frozen=True)
class Claim:
    """What an open claims a run with: its lease (taken) and ``open_run_with``'s
    arguments that decide the claim."""

    lease: Lease
    tools: tuple[Tool, ...]
    start: Mapping[str, str]
    """The RUN_STARTED fields, for a run with no events (``create``)."""
    reason: str = ""
    operator: str | None = None
    create: bool = True
    expect_agent: str | None = None


def claim_of(
    taken: Lease,
    *,
    tools: Iterable[Tool] = (),
    agent: str = "",
    goal: str = "",
    reason: str = "",
    operator: str | None = None,
    started_with: Mapping[str, str] | None = None,
    subject: str | None = None,
    create: bool = True,
    expect_agent: str | None = None,
    **_: Any,
) -> Claim:
    """The claim ``open_run_with`` would make with these arguments (the others ignored)
    under the lease ``taken``: for a batch (``Batch``) of runs opened together."""
    start = start_fields(agent, goal, started_with, subject)
    return Claim(taken, tuple(tools), start, reason, operator, create, expect_agent)


def _start_fresh(
    deps: RunDeps, tenant: str, tools: Iterable[Tool], start: Mapping[str, str]
) -> Engine:
    """Start a run under an id minted here: nothing to replay and no race to lose.

    The id holds 64 random bits and nobody else knows it yet, so no other writer can have
    appended to it: RUN_STARTED is folded locally and needs no read-back (the reader's
    consumer would cost more than the whole append).
    """
    rid = new_run_id()
    partition = partition_for(rid, deps.partition_count())
    lease = acquire(deps, tenant, rid, 0)
    try:
        run = Engine(
            deps=deps,
            lease=lease,
            state=RunState(authority=authority_for(deps.settings)),
            tools=toolset(tools),
            partition=partition,
            position=0,
        )
        with run.lock:
            run.send(EventType.RUN_STARTED, dict(start), local=True)
            (delivered,) = run.barrier()
        run.position = delivered.offset + 1
        run.mark_log_view()
        index_start(run, delivered)
        log.info("run %s started at epoch %s", rid, run.epoch)
        return run
    except BaseException:
        lease.release()
        raise


def _replay(
    deps: RunDeps,
    reader: LogReader,
    lease: Lease,
    tools: Iterable[Tool],
    prefetch: Prefetch | None = None,
) -> Engine:
    rid, tenant = lease.run_id, lease.tenant
    end = None
    if prefetch is not None and prefetch.load(deps.settings, deps.redis, deps.reader_factory):
        # The run as the pass read it, up to where the pass stopped: ``_claim`` reads the
        # run back from there, so what was appended since is seen before the claim counts.
        reader.prefetch, end = prefetch, prefetch.end
    # With the process's log tail, the partition comes from the writer's count (checked
    # against the deployment's once, as a fresh run's placement is): a requested run the
    # tail has never seen is then opened without the reader asking the broker anything.
    # ``_claim`` reads the run back from where the tail had read to.
    try:
        got = read_run(
            reader,
            deps.redis,
            deps.settings,
            tenant,
            rid,
            snapshots=deps.snapshots,
            keep=True,
            end=end,
            tail=deps.tail,
            partition=None if deps.tail is None else partition_for(rid, deps.partition_count()),
        )
    finally:
        reader.prefetch = None
    if got.snapshot_miss is not None:
        log.warning("snapshot of %s does not continue into the log; full replay", rid)
    state = got.state
    if state.tenant and state.tenant != tenant:
        raise TenantMismatch(
            f"run id {rid} belongs to another tenant; choose another run id",
            run_id=rid,
        )
    run = Engine(
        deps=deps,
        lease=lease,
        state=state,
        tools=toolset(tools),
        partition=got.partition,
        position=got.end,
        first_offset=got.folded.first_offset,
        since_turn=None if got.source == "snapshot" else [],
    )
    kept = valid_kept(got.folded)
    if any(ev.type is EventType.MODEL_TURN for ev in kept):
        run.since_turn = []
    for ev in kept:
        run.note(ev)
    if state.max_epoch_seen >= lease.epoch:
        # Redis forgot epochs the log remembers (restart without persistence): go above them.
        lease.raise_floor(state.max_epoch_seen)
        if lease.lost:
            raise Fenced(f"lease of {rid} lost while raising its epoch", run_id=rid)
    return run


def _replayed(deps: RunDeps, reader: LogReader, claim: Claim, prefetch: Prefetch | None) -> Engine:
    """The run replayed under ``claim``'s lease, refused before anything is appended when
    it has no events and may not be created (``UnknownRun``) or runs another agent than
    the one expected (``AgentMismatch``)."""
    run = _replay(deps, reader, claim.lease, claim.tools, prefetch)
    if not claim.create and run.state.status == "new":
        # What the replay read ends where it began (or where the process's log
        # tail had read to): the run's records may lie above it. The rest is read
        # before refusing: only the head may say that a run has no events.
        run.read_back(reader, reader.high_watermark(run.partition))
        if run.state.status == "new":
            raise UnknownRun(f"run {run.run_id} has no events", run_id=run.run_id)
    check_agent(run.state, run.run_id, claim.expect_agent)
    return run


def check_agent(state: RunState, run_id: str, expect_agent: str | None) -> None:
    """Refuse (``AgentMismatch``) a run whose log recorded another agent than
    ``expect_agent``; a run with no events, or no expectation, passes."""
    if expect_agent is None or state.status == "new" or state.agent_name == expect_agent:
        return
    recorded = state.agent_name
    said = (
        repr(recorded) if recorded is not None else "no agent (it was not started by runlog.start)"
    )
    raise AgentMismatch(
        f"run {run_id} runs {said}, not {expect_agent!r}: its RUN_STARTED decides",
        run_id=run_id,
        agent=expect_agent,
        recorded_agent=recorded,
    )


def _with_handover(reason: str, lease: Lease) -> str:
    """The claim's reason, naming the previous owner when it handed the run over (a
    drain), so the log tells a handover from a takeover of a vanished owner's run."""
    if lease.handed_over_by is None:
        return reason
    return f"{reason} (handed over by {lease.handed_over_by})"


def _claim(run: Engine, reader: LogReader, claim: Claim, attempts: int = CLAIM_ATTEMPTS) -> None:
    """Append the ownership event and confirm, by reading the log back, that it counts.

    A previous owner's append can land between our replay and our claim; the log then
    rejects our claim (wrong expected seq) and we claim again above what we now know.
    The claim is not folded locally: the state comes from reading the log back.
    ``attempts``: the claims left to make (a batch made the first: ``open_claimed``).
    """
    for _ in range(attempts):
        ev = _send_claim(run, claim)
        (delivered,) = run.barrier()
        if _claim_counts(run, reader, claim, ev, delivered):
            return
    raise run.fenced(f"could not claim the run after {CLAIM_ATTEMPTS} attempts")


def _send_claim(run: Engine, claim: Claim) -> Event:
    """Emit the claim: RUN_STARTED on a run with no events, else RUN_RESUMED above what
    the run's state says (not folded locally: the read-back decides)."""
    st = run.state
    if st.status == "new":
        return run.send(EventType.RUN_STARTED, dict(claim.start), local=False)
    gap = None
    if st.last_event_at is not None:
        gap = int((codec.now_utc() - st.last_event_at).total_seconds() * 1000)
    payload = {
        "previous_epoch": st.epoch,
        "expected_prev_seq": st.seq,
        "gap_ms": gap,
        "reason": _with_handover(claim.reason or "resumed by a new owner", run.lease),
        "operator": claim.operator,
    }
    return run.send(EventType.RUN_RESUMED, payload, local=False)


def _claim_counts(
    run: Engine, reader: LogReader, claim: Claim, ev: Event, delivered: Delivered
) -> bool:
    """Read the run back past its claim ``ev`` (acknowledged at ``delivered``, ownership
    re-checked): True when the claim counts, or when the run finished before it (nothing
    left to own); False when it lost a race and must be made again above what the read
    folded. Raises when the run turned out another tenant's or agent's, or a newer owner
    claimed it (fenced)."""
    accepted = run.read_back(reader, delivered.offset + 1)
    # Our own event must be the one the log accepted: after Redis lost its data, a
    # writer holding the same epoch number could otherwise confirm our claim for us.
    if ev.event_id in accepted:
        run.mark_log_view()
        if ev.type is EventType.RUN_STARTED:
            index_start(run, delivered)
        else:
            METRICS["takeovers"] += 1
        log.info("run %s claimed at epoch %s seq %s", run.run_id, run.epoch, ev.seq)
        return True
    METRICS["claims_lost"] += 1
    if run.state.tenant and run.state.tenant != run.tenant:
        raise TenantMismatch(
            f"run id {run.run_id} was started by another tenant meanwhile",
            run_id=run.run_id,
        )
    # A start of the same id by another request may have landed first: its agent, not
    # the one this opening was asked for, is the run's.
    check_agent(run.state, run.run_id, claim.expect_agent)
    if run.state.status == "finished":
        # The previous owner's RUN_FINISHED landed first: nothing left to own.
        log.info("run %s finished before our claim; returning it as finished", run.run_id)
        return True
    log.warning("claim of %s at seq %s lost a race; claiming again", run.run_id, ev.seq)
    if run.state.max_epoch_seen > run.epoch:
        raise run.fenced(f"a newer owner (epoch {run.state.max_epoch_seen}) claimed the run")
    if run.state.epoch >= run.epoch:
        # Same epoch number in the log (Redis forgot it): move above it, then claim.
        run.lease.raise_floor(run.state.max_epoch_seen)
        if run.lease.lost:
            raise run.fenced("lease lost while moving above a colliding epoch")
    return False


def open_claimed(
    deps: RunDeps, claims: Mapping[str, Claim], prefetch: Prefetch | None
) -> dict[str, Engine | Exception]:
    """Open many runs whose leases are taken (``claims``, by run id: a dead worker's runs
    of one partition, adopted together) as ``open_run_with`` opens each, without
    recovery: each replayed (from ``prefetch``, the pass over their partition), then the
    claims of all of them sent together, acknowledged by one flush and checked against
    their leases in one Redis round trip (``barrier_all``), then each run read back past
    its claim, which counts only if the log accepted it (``_claim_counts``, the rule of
    every claim). A claim that lost a race is made again on its own (``_claim``), as an
    open does after its first claim. Returns each run (claimed, or found finished) or its
    failure, its lease then released."""
    out: dict[str, Engine | Exception] = {}
    sent: list[tuple[Claim, Engine, Event]] = []
    reader = deps.reader_factory()
    try:
        for rid, claim in claims.items():
            try:
                run = _replayed(deps, reader, claim, prefetch)
                if run.state.status == "finished":
                    out[rid] = run
                    continue
                sent.append((claim, run, _send_claim(run, claim)))
            except Exception as exc:  # noqa: BLE001 - this run's failure, as its open's
                claim.lease.release()
                out[rid] = exc
        acknowledged = barrier_all([run for _, run, _ in sent])
        for claim, run, ev in sent:
            try:
                got = acknowledged[run.run_id]
                if isinstance(got, Exception):
                    raise got
                (delivered,) = got
                if not _claim_counts(run, reader, claim, ev, delivered):
                    _claim(run, reader, claim, CLAIM_ATTEMPTS - 1)
                out[run.run_id] = run
            except Exception as exc:  # noqa: BLE001 - this run's failure, as its open's
                claim.lease.release()
                out[run.run_id] = exc
        _read_inboxes([r for r in out.values() if isinstance(r, Engine)])
    except BaseException:
        for claim in claims.values():  # interrupted: nothing of the batch is handed on
            claim.lease.release()
        raise
    finally:
        reader.close()
    return out


def _read_inboxes(runs: list[Engine]) -> None:
    """The decision inboxes of runs just claimed, read in one round trip: each run's first
    ``poll_decisions`` (its open's recovery) takes its own instead of reading it. Redis
    failing leaves each to read its own."""
    runs = [run for run in runs if run.state.status != "finished"]
    if not runs:
        return
    try:
        pipe = runs[0].deps.redis.pipeline(transaction=False)
        for run in runs:
            pipe.lrange(decisions_key(run.deps, run.tenant, run.run_id), 0, -1)
        inboxes = pipe.execute()
    except REDIS_ERRORS as exc:
        log.warning("decision inboxes of %d runs not read at once: %s", len(runs), exc)
        return
    for run, entries in zip(runs, inboxes, strict=True):
        run.inbox = list(entries)


class Batch:
    """Runs adopted together, opened together (``open_claimed``) by ``open`` (the worker
    that adopted them starts it when the first of them is launched), or by the first of
    their dispatches that asks (``take``); the others wait for it and take theirs. A run
    whose dispatch does not come is let go (``drop``). Thread-safe."""

    def __init__(
        self, deps: RunDeps, claims: Mapping[str, Claim], prefetch: Prefetch | None
    ) -> None:
        self.deps = deps
        self.prefetch = prefetch
        self._claims = dict(claims)
        self._opening = threading.Lock()
        """Held while the batch opens: the dispatches that ask meanwhile wait for it."""
        self._lock = threading.Lock()
        self._state = "new"
        self._opened: dict[str, Engine | Exception] = {}
        self._dropped: set[str] = set()
        """Runs dropped while the batch opens: let go once it has."""
        self.started = False
        """Set by whoever scheduled ``open`` (a worker, at the first of its runs' launch)."""
        self._made = time.monotonic()
        """When the batch was made: its leases were taken before."""
        self.opened: Future[None] = Future()
        """Done once ``open`` has opened the runs (an event loop awaits it, no thread)."""

    def leases(self) -> dict[str, Lease]:
        """The leases the batch was made with, by run id (dropped ones left out)."""
        with self._lock:
            return {rid: claim.lease for rid, claim in self._claims.items()}

    def open(self) -> None:
        """Open the batch's runs unless that is done or under way (then wait for it)."""
        with self._opening:
            with self._lock:
                claims = None
                if self._state == "new":
                    self._state, claims = "opening", dict(self._claims)
            if claims is None:
                return
            opened: dict[str, Engine | Exception] = {}
            if self.prefetch is not None:
                # A pass read before the leases were taken (a drain's runs, read while
                # their last steps ran) is read on to what their previous owner wrote.
                self.prefetch.top_up(self._made, self.deps.reader_factory)
            try:
                opened = open_claimed(self.deps, claims, self.prefetch)
            except Exception as exc:  # noqa: BLE001 - every run's failure (leases released)
                opened = dict.fromkeys(claims, exc)
            finally:
                with self._lock:
                    self._opened, self._state = opened, "opened"
                    dropped, self._dropped = self._dropped, set()
                self.opened.set_result(None)
            for rid in dropped:
                _let_go(opened.pop(rid, None))

    def take(self, run_id: str) -> Engine | None:
        """The run as the batch's claim left it (the batch opens first if no one has);
        raises its failure (its lease released); None if the batch does not hold it."""
        self.open()
        with self._lock:
            got = self._opened.pop(run_id, None)
        if isinstance(got, Exception):
            raise got
        return got

    def drop(self, run_id: str) -> None:
        """The run's dispatch does not come: its lease is let go (once the batch has
        opened, if it is opening). Never waits for the batch."""
        with self._lock:
            if self._state == "opening":
                self._dropped.add(run_id)
                return
            claim = self._claims.pop(run_id, None) if self._state == "new" else None
            got = self._opened.pop(run_id, None)
        if claim is not None:
            claim.lease.release()
        _let_go(got)


def _let_go(got: Engine | Exception | None) -> None:
    if isinstance(got, Engine):
        got.close()


def claim_settlement(run: Engine, by: str) -> None:
    """Take the finished run to settle its open calls: a person's RUN_RESUMED above the
    current epoch at the next seq, confirmed by reading the log back (the fold accepts it
    only on a finished run with open calls, ``run_state._settles``)."""
    for _ in range(CLAIM_ATTEMPTS):
        st = run.state
        if not st.open_calls:
            # Another reconcile settled everything between our replay and our claim.
            raise NotReconcilable(
                f"run {run.run_id} has no open call left",
                key=None,
                why="not_open",
                run_id=st.run_id,
            )
        payload = {
            "previous_epoch": st.epoch,
            "expected_prev_seq": st.seq,
            "gap_ms": None,
            "reason": f"{by} settles the open calls of an ended run",
            "operator": by,
        }
        with run.lock:
            ev = run.send(EventType.RUN_RESUMED, payload, local=False)
            (delivered,) = run.barrier()
        reader = run.deps.reader_factory()
        try:
            accepted = run.read_back(reader, delivered.offset + 1)
        finally:
            reader.close()
        if ev.event_id in accepted:
            run.mark_log_view()
            return
        # Claimed on a view the log had moved past (the read-back folded what we missed):
        # claim again above it, as ``opening._claim`` does.
        if run.state.max_epoch_seen > run.epoch:
            raise run.fenced(f"a newer owner (epoch {run.state.max_epoch_seen}) took the run")
    raise run.fenced(f"could not claim {run.run_id} to settle it after {CLAIM_ATTEMPTS} attempts")


def index_start(run: Engine, delivered: Delivered) -> None:
    try:
        run.deps.redis.set(
            run.deps.start_key(run.tenant, run.run_id),
            f"{delivered.partition}:{delivered.offset}",
            nx=True,
        )
    except REDIS_ERRORS as exc:
        # Only an optimisation: readers fall back to the run id's time or a scan.
        log.warning("could not index the start of %s: %s", run.run_id, exc)


def toolset(tools: Iterable[Tool]) -> dict[str, Tool]:
    """The run's tools by name, with the compensation of each tool that declares one."""
    out: dict[str, Tool] = {}
    for t in tools:
        out[t.name] = t
        inverse = t.compensation()
        if inverse is not None:
            out[inverse.name] = inverse
    return out


DECISION_WAIT_S = 5.0
"""How long ``submit_decision`` waits for a queued decision's outcome before "queued"."""


def submit_decision(
    deps: RunDeps,
    run_id: str,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str = "",
    tenant: str = "default",
    tools: Iterable[Tool] = (),
    wait_s: float = DECISION_WAIT_S,
    answer: str | None = None,
) -> str:
    """Record a person's decision: directly if the run is free, else via its owner's inbox.

    Returns ``"recorded"`` (this call appended it, valid in the log) or ``"queued"`` (it
    went to the owner's inbox: recorded by the owner within ``wait_s``, or still waiting
    there). Taking the free run to record the decision is an ownership change like any
    other (a RUN_RESUMED with the reason).

    The first valid decision stands: if another one is in the log first, this raises
    ``DecisionConflict`` naming it, here, and a queued copy of this one is withdrawn. A
    queued decision is watched in the log for ``wait_s`` until it or another one stands;
    when the run becomes free meanwhile this caller takes it and records what the inbox
    holds (``"recorded"``).
    """
    # Signed here, by the decider, once: the same signature is recorded whether this call
    # appends the decision or the run's owner does from the inbox (it never signs).
    check_answer(approved, answer)
    signature = sign_decision(
        deps,
        tenant,
        run_id,
        approval_id,
        approved=approved,
        decided_by=decided_by,
        note=note,
        answer=answer,
    )
    fields: dict[str, object] = {
        "approval_id": approval_id,
        "approved": approved,
        "decided_by": decided_by,
        "note": note,
    }
    if answer is not None:
        fields["answer"] = answer
    if signature is not None:
        fields.update(signature.fields())
    refuse_forged(
        authority_for(deps.settings),
        tenant,
        run_id,
        approval_id,
        approved=approved,
        decided_by=decided_by,
        note=note,
        signature=signature,
        answer=answer,
    )
    entry = json.dumps(fields, sort_keys=True)
    reason = f"decision by {decided_by}"
    key = decisions_key(deps, tenant, run_id)

    def take() -> Engine | None:
        return take_if_free(
            deps, run_id, tenant=tenant, tools=tools, reason=reason, by=decided_by, settle=True
        )

    run = take()
    if run is not None:
        with run:
            run.decide(
                approval_id,
                approved=approved,
                decided_by=decided_by,
                note=note,
                signature=signature,
                answer=answer,
            )
        return "recorded"
    decision_inbox(deps, run_id, lambda: deps.redis.rpush(key, entry))
    how = "queued"
    deadline = time.monotonic() + wait_s
    while True:
        state = read_state(deps, tenant, run_id)
        if state.erased is not None:
            # Forgotten meanwhile: nobody will record it, and the inbox entry holds the
            # note in plaintext beside an erased log. Withdrawn (``forget`` deletes the
            # inbox too, and again after its purge, for an entry that raced its first pass).
            decision_inbox(deps, run_id, lambda: deps.redis.lrem(key, 1, entry))
            raise RunFinished(
                f"run {run_id} was erased (forgotten) before the decision was recorded",
                run_id=run_id,
                seq=state.seq,
            )
        if standing_decision(state, approval_id) is None:
            run = take()
            if run is not None:
                with run:  # the run is free now: record what its inbox holds, ours included
                    run.poll_decisions()
                    state, how = run.state, "recorded"
        standing = standing_decision(state, approval_id)
        if standing is not None:
            if (standing.decided_by, standing.approved, standing.note, standing.answer) == (
                decided_by,
                approved,
                note,
                answer,
            ):
                return how
            # Another decision stands: ours must not wait for an owner to drop it.
            decision_inbox(deps, run_id, lambda: deps.redis.lrem(key, 1, entry))
            raise approvals_conflict(run_id, standing)
        if time.monotonic() >= deadline:
            return "queued"
        time.sleep(0.1)


def take_if_free(
    deps: RunDeps,
    run_id: str,
    *,
    tenant: str,
    tools: Iterable[Tool] = (),
    reason: str,
    by: str,
    settle: bool = False,
) -> Engine | None:
    """The run, if no one holds it, taken by person ``by`` to record their act in its log
    (a decision, a cancellation): else None, and the act goes to the owner's inbox.

    Taking it is an ownership change like any other (a RUN_RESUMED with ``reason``), named
    as ``by``'s, so it is not counted as a resumption; nothing is recovered. ``settle``: a
    finished run with open calls is taken to settle them (``claim_settlement``), for a
    decision on an ended run's escalated call.
    """
    try:
        run = open_run_with(
            deps,
            run_id,
            tenant=tenant,
            tools=tools,
            wait_s=0,
            recover=False,
            create=False,
            reason=reason,
            operator=by,
        )
    except RunLocked:
        return None
    if settle and run.state.status == "finished" and run.state.open_calls:
        try:
            claim_settlement(run, by)
        except BaseException:
            run.close()
            raise
    return run


def decision_inbox(deps: RunDeps, run_id: str, op: Callable[[], object]) -> None:
    try:
        op()
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"decision inbox of {run_id}: {exc}") from exc


def read_state(deps: RunDeps, tenant: str, run_id: str) -> RunState:
    reader = deps.reader_factory()
    try:
        return read_run(reader, deps.redis, deps.settings, tenant, run_id).state
    finally:
        reader.close()
