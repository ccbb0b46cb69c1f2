"""The public worker API, wired through the composition root."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import (
    DecisionConflict,
    NotReconcilable,
    NotSettledYet,
    NotUndoable,
    RedisUnavailable,
    SubjectHasOtherRuns,
    UnknownApproval,
    UnknownRun,
)
from runlog.fleet._reconciling import read_reply
from runlog.fleet._requests import forget as forget_dispatch
from runlog.fleet._requests import (
    pending_starts,
    request_dispatch,
    request_reconcile,
    request_start,
    wake,
)
from runlog.log._fold import read_run
from runlog.log._keys import keys_for
from runlog.log._reader import LogReader
from runlog.log._replay import replay
from runlog.log._subjects import SubjectScan, scan_subjects
from runlog.producers import _telemetry as telemetry
from runlog.producers import _tracing as tracing
from runlog.producers._control import CANCEL_WAIT_S, Termination, request_cancel
from runlog.producers._control import terminate as terminate_run
from runlog.producers._engine import valid_kept
from runlog.producers._erasure import (
    NO_KEYS,
    ForgetReport,
    KeyShredder,
    purge_copies,
    run_subject,
)
from runlog.producers._erasure import forget as forget_runs
from runlog.producers._erasure import known as erasure_known
from runlog.producers._forks import Fork, fork_run_with
from runlog.producers._handle import Run
from runlog.producers._lease import METRICS
from runlog.producers._opening import DECISION_WAIT_S, open_run_with, submit_decision
from runlog.producers._reconcile import Reconciliation, settled
from runlog.producers._reconcile import reconcile as reconcile_here
from runlog.producers._tools import Tool
from runlog.producers._writer import APPENDS, BARRIERS
from runlog.schemas._keys import check_run_id, check_tenant
from runlog.schemas._models import UNDO_AND_RETRY

# Opening and using a run loads the writer and log access only: the read side that decide,
# question and serve_metrics share with the projection services (the run's timeline, the
# question put to a person, the metrics server) is imported when one of them is called.
# tests/test_layout.py checks that importing this module loads no ``runlog.consumers``.
if TYPE_CHECKING:
    from runlog.consumers._index import RunIndex
    from runlog.consumers._question import Question
    from runlog.consumers._timeline import Timeline
    from runlog.producers._engine import RunDeps
    from runlog.producers._tools import Tool


def open_run(
    run_id: str | None = None,
    *,
    tenant: str = "default",
    tools: Iterable[Tool] = (),
    settings: Settings | None = None,
    wait_s: float | None = None,
    agent: str = "",
    goal: str = "",
    reason: str = "",
    recover: bool = True,
    takeover: bool = False,
    subject: str | None = None,
) -> Run:
    """Start a new run (``run_id=None``) or resume one: the same call either way.

    Acquires the run's lease (waiting up to ``wait_s``, default one lease TTL, for a live
    owner; then ``RunLocked``), replays the run's valid log, appends RUN_STARTED or
    RUN_RESUMED, settles uncertain calls, and returns the run with its state.

    ``takeover=True`` does not wait for a live owner's lease: it takes the run at once
    with a higher epoch. Use it when you know the owner is dead (a supervisor that saw its
    process exit); if it was only paused, fencing stops it at its next append, but a tool
    call it had already started may still reach its receiver (the key deduplicates it
    there, and the new owner treats the call as uncertain).

    ``subject``: the data subject (a person or account id) whose key seals the run's
    content when ``RUNLOG_ENCRYPTION=on``; recorded in the RUN_STARTED (ignored when the run
    exists). Default: the run is its own subject. Shredding the subject's key
    (``KeyStore.shred``) erases the content of every run that names it.
    """

    if run_id is not None:
        check_run_id(run_id)
    services = Services.shared(settings or Settings())
    with tracing.span("open_run", run_id=run_id, tenant=tenant, takeover=takeover) as span:
        run = Run(
            open_run_with(
                services.run_deps(),
                run_id,
                tenant=tenant,
                tools=tools,
                wait_s=wait_s,
                agent=agent,
                goal=goal,
                reason=reason,
                recover=recover,
                takeover=takeover,
                subject=subject,
            )
        )
        tracing.annotate(
            span,
            run_id=run.run_id,
            epoch=run.epoch,
            seq=run.state.seq,
            resumed=run.state.resumptions > 0,
        )
        return run


def fork(
    run_id: str,
    *,
    at_seq: int,
    tenant: str = "default",
    new_run_id: str | None = None,
    input: str | None = None,
    effects: str = "inherit",
    forked_by: str = "",
    reason: str = "",
    settings: Settings | None = None,
) -> Fork:
    """Fork ``run_id`` after its ``at_seq``-th valid event into a new run; returns the fork.

    The fork begins with one record, RUN_FORKED: the parent, ``at_seq``, the digest of the
    parent's state there, who forked (``forked_by``) and why, and that state itself, so the
    fork replays from its own log alone. Open it like any run (``open_run(fork.run_id,
    tools=...)``) to go on from there. ``effects`` says what a call the fork makes does when
    the parent's timeline already completed the same logical action after ``at_seq``:
    ``inherit`` returns the parent's result, ``ask`` stops for a person, ``execute`` repeats
    it under a key bound to the fork. ``input``: JSON for the fork's agent (recorded).

    Asked again with the same ``new_run_id`` (after a crash), returns the fork already made
    (``created`` False). Refused: another tenant's run or an unknown run (``UnknownRun``),
    a seq outside the parent's valid log or a run id already used (``ForkRefused``).
    """

    check_run_id(run_id)
    check_tenant(tenant)
    services = Services.shared(settings or Settings())
    with tracing.span("fork", run_id=run_id, tenant=tenant, at_seq=at_seq) as span:
        made = fork_run_with(
            services.run_deps(),
            run_id,
            tenant=tenant,
            at_seq=at_seq,
            run_id=new_run_id,
            input_json=input,
            effects=effects,
            forked_by=forked_by,
            reason=reason,
        )
        tracing.annotate(span, fork_run_id=made.run_id, created=made.created)
        if made.agent is not None:
            # A fork of a run of the fleet is dispatched like a started run (also when
            # asked again after a crash: the record may not have been written).
            wake(services.settings, made.run_id, tenant=tenant, agent=made.agent)
        return made


def decide(
    run_id: str,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str = "",
    tenant: str = "default",
    tools: Iterable[Tool] = (),
    settings: Settings | None = None,
    wait_s: float = DECISION_WAIT_S,
    undo_and_retry: bool = False,
) -> str:
    """Record a person's decision on an approval request of ``run_id``.

    ``undo_and_retry`` (with ``approved=True``): the third answer about an uncertain or
    conflicting call of a tool that declared an inverse (``compensate=``): the inverse runs
    first (its own key), and only once it is recorded completed the call runs again under a
    fresh key; an inverse that fails or is lost goes back to a person. Elsewhere it is
    refused with ``NotUndoable`` (``question(...).undoable`` says where it is offered).

    If no worker holds the run, the decision is appended at once (``"recorded"``);
    otherwise it waits in the run's inbox for its owner (``"queued"``), and this call
    watches the log for up to ``wait_s`` seconds, so that a decision another person made
    first is refused here too; one still in the inbox after that stays there until an
    owner records it (or finds it decided: then it is dropped, as the first stands).

    The run's log is read first: a run of another tenant (``TenantMismatch``), a run
    without events (``UnknownRun``) and an approval id the run never issued
    (``UnknownApproval``) are refused before anything is queued or appended, so a typo
    never waits in an inbox as if a person had answered.

    A person's decision is final: the first valid decision in the log stands. A decision on
    an approval that already has one is refused with ``DecisionConflict``, which names the
    standing decision (who, when, approve or reject, note); nothing is appended or queued.

    The decision is signed with the decider key of ``settings`` (``RUNLOG_DECIDER_KEY_FILE``).
    When the readers trust decider keys (``RUNLOG_DECIDER_PUBLIC_KEYS``), a decision without
    a trusted signature is refused with ``NotADecider``: nothing is appended or queued.
    """

    check_run_id(run_id)
    check_tenant(tenant)
    services = Services.shared(settings or Settings())
    with tracing.span(
        "decide", run_id=run_id, tenant=tenant, approval_id=approval_id, approved=approved
    ) as span:
        tl = _timeline(services, tenant, run_id)
        state = tl.state
        if approval_id not in state.approvals:
            pending = ", ".join(sorted(state.pending_approvals)) or "none"
            raise UnknownApproval(
                f"run {run_id} never requested approval {approval_id!r} "
                f"(pending approval ids: {pending})",
                run_id=run_id,
            )
        standing = tl.decision_conflict(approval_id)
        if standing is not None:
            tracing.annotate(span, outcome="refused")
            raise standing
        answer = None
        if undo_and_retry:
            if not approved:
                raise NotUndoable(
                    "undo and retry approves a retry (after the undo): pass approved=True",
                    run_id=run_id,
                )
            from runlog.consumers._question import question as ask

            q = ask(tl, approval_id)
            if not q.undoable:
                what = (
                    f"{q.tool} declared no inverse (compensate=)"
                    if q.about_a_call
                    else ("it is not about a call")
                )
                raise NotUndoable(
                    f"approval {approval_id} of run {run_id} cannot be answered with undo "
                    f"and retry: {what}; approve retries with the same key, reject closes",
                    run_id=run_id,
                )
            answer = UNDO_AND_RETRY
        try:
            how = submit_decision(
                services.run_deps(),
                run_id,
                approval_id,
                approved=approved,
                decided_by=decided_by,
                note=note,
                tenant=tenant,
                tools=tools,
                wait_s=wait_s,
                answer=answer,
            )
        except DecisionConflict as exc:
            # Another decision won the race: name it with its time, read from the log.
            tracing.annotate(span, outcome="refused")
            fresh = _timeline(services, tenant, run_id).decision_conflict(approval_id)
            if fresh is None:
                raise
            raise fresh from exc
        tracing.annotate(span, outcome=how)
        if state.agent_name is not None:
            # A run of the fleet waits for this decision holding no worker: dispatch it.
            wake(services.settings, run_id, tenant=tenant, agent=state.agent_name)
        return how


def cancel(
    run_id: str,
    *,
    reason: str,
    by: str,
    tenant: str = "default",
    settings: Settings | None = None,
    wait_s: float = CANCEL_WAIT_S,
) -> str:
    """Ask ``run_id`` to stop, cooperatively; the request is recorded in its log (who, when,
    why).

    The run's owner sees it at its first step (a model turn or tool call; an ``AsyncRun``
    at an await of runlog's) that begins 50 ms or more after the request: its next step,
    unless its steps come faster (the flag a step checks may come from a read of the last
    50 ms, a barrier's ownership check or an earlier step's) and raises ``runlog.Cancelled``
    into the agent, which may clean up; the run then ends ``cancelled``. A run nobody holds
    is recorded as cancelling and cancelled when next opened; a run of the fleet that
    waits (for a person, or asleep on a durable timer) or that nobody holds is dispatched
    at once, so its agent sees ``Cancelled`` at its first step (a sleep does not wait for
    its timer). Open calls are not closed: the
    recovery rules still settle them.

    Returns ``"recorded"`` (in the log), ``"queued"`` (in the owner's inbox after
    ``wait_s``) or ``"already"`` (an earlier cancellation stands). Raises ``RunFinished``
    if the run has ended, ``UnknownRun`` if this tenant has no such run, ``ValueError``
    without a reason or a ``by``.
    """
    services = Services.shared(settings or Settings())
    with tracing.span("cancel", run_id=run_id, tenant=tenant) as span:
        how = request_cancel(
            services.run_deps(),
            run_id,
            tenant=tenant,
            reason=reason,
            by=by,
            wait_s=wait_s,
            # A run of the fleet that waits (for a person, a time) or that nobody holds is
            # dispatched, so its agent sees ``Cancelled`` at its first step; a sleep does
            # not wait for its timer.
            wake=lambda st: wake(
                services.settings, run_id, tenant=tenant, agent=st.agent_name or ""
            ),
        )
        tracing.annotate(span, outcome=how)
        return how


def terminate(
    run_id: str,
    *,
    reason: str,
    by: str,
    tenant: str = "default",
    settings: Settings | None = None,
) -> Termination:
    """End ``run_id`` now, without its owner: a takeover with a higher epoch fences the
    owner (its next append is refused, it invokes no further tool) and the run is recorded
    as ended ``terminated`` (who, why). Its open calls are returned and stay open, for
    reconciliation. Raises ``RunFinished`` if the run has already ended."""
    services = Services.shared(settings or Settings())
    with tracing.span("terminate", run_id=run_id, tenant=tenant) as span:
        done = terminate_run(services.run_deps(), run_id, tenant=tenant, reason=reason, by=by)
        if done.agent is not None:
            # The run of the fleet has ended: its lifecycle record goes (a tombstone), so no
            # worker keeps it in its table or dispatches it again. Its fenced worker stops
            # at its next append.
            forget_dispatch(services.settings, run_id)
        tracing.annotate(span, epoch=done.epoch, open_calls=len(done.open_calls))
        return done


def _with_forks(
    index: RunIndex, tenant: str, runs: list[str], forks: dict[str, list[str]] | None = None
) -> list[str]:
    """``runs`` and the forks of each, and theirs (the run index's lineage, and ``forks``
    found in the log when the index is not current), in order: a fork carries its parent's
    content (its RUN_FORKED holds the parent's state), so what forgets a run (``forget``,
    the retention job) forgets its forks with it."""
    todo, out = list(runs), []
    while todo:
        rid = todo.pop(0)
        if rid not in out:
            out.append(rid)
            todo += [c.run_id for c in index.children(tenant, rid)]
            todo += (forks or {}).get(rid, [])
    return out


def forget(
    *,
    tenant: str,
    reason: str,
    by: str,
    subject: str | None = None,
    run_id: str | None = None,
    whole_subject: bool = False,
    shredder: KeyShredder | None = None,
    wait_s: float = 60.0,
    settings: Settings | None = None,
) -> ForgetReport:
    """Erase the content of a data subject's runs (``subject``: every run of it in
    ``tenant``, plus a run whose id it is) or of one run (``run_id``), and the forks of
    each (they carry its content): a run in progress is terminated first (its owner is
    fenced), each run's log records CONTENT_ERASED (who, why; when), the subject's keys are
    shredded, the run's own copies (``runlog.log._copies``: inbox, cancel flag, snapshots)
    deleted; the projection runners purge their copies when they fold the erasure. Waits up
    to ``wait_s`` for them, then rewrites Redis's AOF and RDB. Idempotent: run it again
    after a crash and it completes what is left.

    The subject's runs come from the run index when it is current, else from the events
    topic itself (``report.checked`` says which, and why). ``run_id`` of a subject that has
    other runs is refused (``SubjectHasOtherRuns``, naming them: the subject's key is theirs
    too) unless ``whole_subject``, which forgets every run of the subject.

    ``shredder``: the key store's destroying side (``producers._erasure.KeyShredder``);
    the composition root's by default (none: there are no keys to destroy)."""
    from runlog.consumers._index import RunIndex

    if (subject is None) == (run_id is None):
        raise ValueError("name exactly one of subject or run_id")
    if whole_subject and run_id is None:
        raise ValueError("whole_subject goes with run_id (a subject is forgotten whole)")
    services = Services.shared(settings or Settings())
    s = services.settings
    check_tenant(tenant)
    deps = services.run_deps()
    index = RunIndex(services.redis, s)
    if run_id is not None:
        rid = check_run_id(run_id)
        erasure_known(deps, tenant, rid)
        of_run = run_subject(deps, tenant, rid)
        found = _SubjectRuns(services, index)(tenant, of_run)
        runs = _with_forks(index, tenant, [rid], found.forks)
        others = _left_out(deps, tenant, found.runs, runs)
        if others and not whole_subject:
            raise SubjectHasOtherRuns(
                f"run {rid} belongs to data subject {of_run}, who has {len(others)} other "
                f"run(s): {', '.join(others)}. They share the subject's key: forgetting "
                f"{rid} alone would erase them too, unstopped and unmarked. Forget the whole "
                f"subject (--subject {of_run}, or --whole-subject); nothing was done "
                f"(looked in {found.checked})",
                run_id=rid,
                subject=of_run,
                others=others,
            )
        if whole_subject:
            subject = of_run
            runs = [rid, *found.runs]
    else:
        assert subject is not None
        if not subject.strip():
            raise ValueError("the subject is empty")
        found = _SubjectRuns(services, index)(tenant, subject)
        runs = list(found.runs)
        with contextlib.suppress(ValueError):
            runs.append(check_run_id(subject))  # the default subject of a run is itself
    runs = _with_forks(index, tenant, runs, found.forks)
    # Start requests no worker took yet hold the run's input and would start the forgotten
    # subject's run: dropped (tombstoned; compaction then removes the input from the topic).
    requests = [] if subject is None else pending_starts(s, tenant, subject)
    for rid in requests:
        if rid not in runs:
            forget_dispatch(s, rid)
    with tracing.span("forget", tenant=tenant) as span:
        existing: list[str] = []
        for rid in dict.fromkeys(runs):
            try:
                erasure_known(deps, tenant, rid)
                existing.append(rid)
            except UnknownRun:
                if run_id is not None:
                    raise
        report = forget_runs(
            deps, tenant, existing, reason=reason, by=by, shredder=shredder or shredder_for(s)
        )
        report.checked = found.checked
        report.requests_dropped = [rid for rid in requests if rid not in runs]
        for r in report.runs:
            if r.terminated:
                forget_dispatch(s, r.run_id)  # a run of the fleet: no worker dispatches it again
        _settle_purge(services, report, wait_s)
        tracing.annotate(span, runs=len(report.runs), keys=len(report.keys_shredded))
        return report


def _settle_purge(services: Services, report: ForgetReport, wait_s: float) -> None:
    """Wait for the projections' purge, delete the runs' own copies once more (an item
    queued while the erasure was being recorded, by a caller that had not read it yet), and
    have Redis rewrite its files."""
    from runlog.consumers import _erasure as purge
    from runlog.consumers import stores

    s = services.settings
    report.projections_behind = stores.wait_purged(
        services.redis, s, [(r.partition, r.run_id) for r in report.runs], wait_s
    )
    report.projections_purged = not report.projections_behind
    deps = services.run_deps()
    for r in report.runs:
        report.copies_deleted += purge_copies(deps, report.tenant, r.run_id)
    report.persistence_rewritten = purge.rewrite_persistence(services.redis, wait_s)


@dataclass(frozen=True)
class _Found:
    runs: list[str]
    checked: str
    """Where they were looked for, and why there."""
    forks: dict[str, list[str]] = field(default_factory=dict)
    """Forks met in the log, by parent (empty when the index answered: it has them)."""


def _left_out(
    deps: RunDeps, tenant: str, subject_runs: Iterable[str], runs: Iterable[str]
) -> list[str]:
    """The runs of a subject that erasing ``runs`` would leave behind, their erasure not
    recorded yet. They share the subject's key, so its shred erases them too, unstopped and
    with no erasure in their log: a run of a named subject is forgotten only together with
    all of them (``forget`` refuses, the retention job keeps the covered ones until the rest
    are covered too). One already erased shares nothing that is still readable."""
    rest = sorted(set(subject_runs) - set(runs))
    return [rid for rid in rest if erasure_known(deps, tenant, rid).erased is None]


def _index_untrusted(services: Services) -> str | None:
    """Why the run index cannot answer for the log now (None: it can): the state projection
    is behind the end of the log (its service stopped or slow), half rebuilt, or folded
    runs without a key."""
    from runlog.consumers import _projection_metrics as projection_metrics

    s = services.settings
    marks = projection_metrics.Watermarks(s)
    try:
        snap = projection_metrics.collect(services.redis, s, ("state",), marks.high)
    finally:
        marks.close()
    state = snap["projections"]["state"]
    if state["rebuild_incomplete"]:
        return "the state projection's rebuild did not finish"
    if state["lag"]:
        return f"the state projection is {state['lag']} record(s) behind the log"
    if state["sealed_runs"]:
        return f"the state projection folded {state['sealed_runs']} run(s) without a key"
    return None


class _SubjectRuns:
    """Answers "which runs has this subject" for one call of ``forget`` or the retention job:
    from the run index when it is current, else from the events topic (``log.subjects``),
    read once per tenant however many subjects are asked about, and the index together."""

    def __init__(self, services: Services, index: RunIndex) -> None:
        self.services = services
        self.index = index
        self.why: str | None = None
        self.asked = False
        self.scans: dict[str, SubjectScan] = {}

    def __call__(self, tenant: str, subject: str) -> _Found:
        if not self.asked:  # once per call of forget or the job: the first question
            self.why, self.asked = _index_untrusted(self.services), True
        indexed = self.index.runs_of_subject(tenant, subject)
        if self.why is None:
            return _Found(indexed, "the run index (the state projection is at the end of the log)")
        scan = self.scans.get(tenant)
        if scan is None:
            scan = self.scans[tenant] = scan_subjects(self.services.settings, tenant)
        checked = (
            f"the events topic ({scan.records} record(s) of {scan.partitions} partition(s)), "
            f"because the run index is not current: {self.why}"
        )
        return _Found(sorted({*scan.subjects.get(subject, []), *indexed}), checked, scan.forks)


@dataclass
class RetentionRun:
    """What ``apply_retention`` did for one tenant's policy."""

    tenant: str
    finished_older_than: str
    cutoff: str
    """Runs that ended before this time are covered."""
    dry_run: bool
    runs: list[str] = field(default_factory=list)
    """The runs it forgot (with ``dry_run``: would forget)."""
    subjects: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    """Covered runs it left, and why (a subject with runs the policy does not cover yet)."""
    report: ForgetReport | None = None


def apply_retention(
    *,
    tenant: str | None = None,
    finished_older_than: str | None = None,
    dry_run: bool = False,
    by: str = "retention",
    shredder: KeyShredder | None = None,
    now: datetime | None = None,
    wait_s: float = 60.0,
    settings: Settings | None = None,
) -> list[RetentionRun]:
    """Forget every run that ended longer ago than its tenant's policy (``runlog retention
    set``), or than ``finished_older_than`` for ``tenant`` (no stored policy needed: for a
    job that keeps its policy as configuration). A run of a named data subject is forgotten
    only with all of the subject's runs (they share its key): while one of them is newer,
    the covered ones are kept and said so. ``dry_run``: report, change nothing."""
    from runlog.consumers._index import RunIndex
    from runlog.log import _retention as retention

    services = Services.shared(settings or Settings())
    s = services.settings
    at = now or datetime.now(UTC)
    if finished_older_than is not None:
        if tenant is None:
            raise ValueError("--finished-older-than applies to one --tenant")
        check_tenant(tenant)
        todo = [(tenant, finished_older_than, retention.parse_age(finished_older_than))]
    else:
        todo = [
            (p.tenant, p.finished_older_than, p.seconds)
            for p in retention.policies(services.redis, s)
            if tenant is None or p.tenant == tenant
        ]
    index = RunIndex(services.redis, s)
    subject_runs = _SubjectRuns(services, index)
    deps = services.run_deps()
    out: list[RetentionRun] = []
    for t, age, seconds in todo:
        cutoff = at - timedelta(seconds=seconds)
        job = RetentionRun(t, age, cutoff.isoformat(), dry_run)
        covered = index.ended_before(t, cutoff)
        by_subject: dict[str, list[str]] = {}
        for rid in covered:
            by_subject.setdefault(run_subject(deps, t, rid), []).append(rid)
        for subject, rids in sorted(by_subject.items()):
            # The forks of a covered run carry its content (and share its subject): they
            # are forgotten with it, as ``forget`` does, whenever they ended (a fork in
            # progress is stopped first), and never keep it from being covered.
            found = subject_runs(t, subject)
            with_forks = _with_forks(index, t, rids, found.forks)
            newer = _left_out(deps, t, found.runs, [*covered, *with_forks])
            if newer:
                for rid in rids:
                    job.kept[rid] = f"subject {subject} has {len(newer)} run(s) not covered yet"
                continue
            job.runs += [rid for rid in with_forks if rid not in job.runs]
            job.subjects.append(subject)
        if job.runs and not dry_run:
            reason = f"retention: ended more than {age} ago (before {cutoff.isoformat()})"
            job.report = forget_runs(
                deps, t, job.runs, reason=reason, by=by, shredder=shredder or shredder_for(s)
            )
            _settle_purge(services, job.report, wait_s)
        out.append(job)
    return out


def shredder_for(settings: Settings) -> KeyShredder:
    """The key store's shredding side ``forget`` uses by default: the key store of
    ``settings`` (``runlog.log._keys.keys_for``: a KEK configured or encryption on), else
    nothing to shred (content written in plaintext is purged from every copy runlog
    keeps, but the events topic holds it until its retention deletes it)."""
    return keys_for(settings) or NO_KEYS


def start(
    agent: str,
    input: Any = None,
    *,
    tenant: str = "default",
    run_id: str | None = None,
    settings: Settings | None = None,
    subject: str | None = None,
) -> str:
    """Request a run of the registered agent ``agent`` with ``input``; returns its run id.

    A durable request, not a process: it returns once the broker acknowledged it, and
    whichever ``runlog worker`` owns the run's partition starts it. A given ``run_id`` that
    already has a log is answered from that log: the same agent's is one run (already
    started, or finished: nothing runs again), another agent's is refused
    (``AgentMismatch``, naming both), another tenant's too (``StartRefused``); nothing is
    written then. ``input`` must be JSON (it is recorded in the run's RUN_STARTED).
    ``subject``: the data subject whose key seals the run's content (as ``open_run``'s).
    """

    services = Services.shared(settings or Settings())
    return request_start(
        services.settings,
        services.redis,
        agent,
        input,
        tenant=tenant,
        run_id=run_id,
        subject=subject,
    ).run_id


def resume(run_id: str, *, tenant: str = "default", settings: Settings | None = None) -> str:
    """Ask the fleet to dispatch ``run_id`` now (e.g. after a fix was deployed); returns
    the run's status. Refused for a finished run (``RunFinished``), one of another tenant
    (``TenantMismatch``), or one not started through ``runlog.start`` (``UnknownRun``)."""

    services = Services.shared(settings or Settings())
    state = request_dispatch(services.settings, services.redis, run_id, tenant=tenant)
    return state.status


RECONCILE_WAIT_S = 60.0
"""How long ``reconcile`` waits for a worker of the fleet to answer its request."""


def reconcile(
    run_id: str,
    key: str | None = None,
    *,
    by: str,
    tenant: str = "default",
    tools: Iterable[Tool] | None = None,
    wait_s: float = RECONCILE_WAIT_S,
    queue: bool = False,
    settings: Settings | None = None,
) -> Reconciliation:
    """Run the declared lookup (``reconcile=``) of the uncertain call ``key`` of ``run_id``
    (None: of every open call a lookup can settle) and record the outcome as recovery does:
    RECONCILIATION_ATTEMPTED, a completion with ``source=reconciliation`` on a match, an
    escalation on a conflict, the call left uncertain without evidence. A terminated run is
    settled without being resumed; a run in progress is not executed either.

    With ``tools``, here, in this process (``wait_s``: for a live owner's lease). Without,
    by the fleet (a durable request a worker with the run's agent serves): the outcome is
    read from the run's log once the worker answered, within ``wait_s``; else
    ``NotSettledYet`` (the request stays queued). ``NoLiveWorker`` when no live worker
    serves the agent (unless ``queue``), ``NotReconcilable`` for a key that is not open,
    waits for a person, or whose tool declares no lookup; nothing is appended then."""
    services = Services.shared(settings or Settings())
    keys = () if key is None else (key,)
    if tools is not None:
        return reconcile_here(
            services.run_deps(), run_id, tenant=tenant, tools=tools, keys=keys, by=by, wait_s=wait_s
        )
    req, _ = request_reconcile(
        services.settings, services.redis, run_id, tenant=tenant, keys=keys, by=by, queue=queue
    )
    deadline = time.monotonic() + wait_s
    while True:
        reply = read_reply(services.redis, services.settings, req.request_id)
        if reply is not None:
            break
        if time.monotonic() >= deadline:
            raise NotSettledYet(
                f"reconcile request {req.request_id} of {run_id} was not answered in "
                f"{wait_s:g}s: {_holder(services, tenant, run_id)}; it stays queued for a "
                f"worker serving {req.agent!r}",
                request_id=req.request_id,
                run_id=run_id,
            )
        time.sleep(0.1)
    if reply.get("status") == "refused":
        if reply.get("why") == "unknown_run":
            raise UnknownRun(reply.get("message", ""), run_id=run_id)
        raise NotReconcilable(
            f"{reply.get('message', '')} (worker {reply.get('worker', '?')})",
            key=reply.get("key") or None,
            why=reply.get("why", ""),
            run_id=run_id,
        )
    reader = LogReader(services.settings)
    try:
        got = read_run(reader, services.redis, services.settings, tenant, run_id, keep=True)
    finally:
        reader.close()
    events = valid_kept(got.folded)
    done = [k for k in reply.get("keys", "").split(",") if k]
    return Reconciliation(
        run_id,
        int(reply.get("epoch", "0")),
        [settled(got.state, events, k) for k in done],
        got.state.status == "finished",
    )


def _holder(services: Services, tenant: str, run_id: str) -> str:
    """Who holds the run's lease now, in words (a reconcile waits for a live owner)."""
    try:
        holder = services.leases.current(tenant, run_id)
    except RedisUnavailable:
        return "its lease holder is unknown (Redis does not answer)"
    return "no one holds its lease" if holder is None else f"its lease is held by {holder}"


def question(
    run_id: str,
    approval_id: str,
    *,
    tenant: str = "default",
    settings: Settings | None = None,
) -> Question:
    """The question a person answers with ``decide``: read it first.

    For an uncertain call (kinds ``uncertain_call`` and ``conflict``): the tool, its
    canonical arguments (redacted), the idempotency key, when the call started and each
    attempt with its error, the last error, every reconciliation step with its evidence, and
    what each answer does: ``approve`` retries with the same key (``dedupes_by_key`` says
    whether the receiver is declared to deduplicate by it, else a retry may REPEAT an effect
    that landed), ``reject`` closes it without retrying (after undoing it, when the tool
    declared an inverse). ``confirmation(approved)`` is that consequence as one sentence.
    Read from the log alone; refused like ``decide`` (``TenantMismatch``, ``UnknownRun``,
    ``UnknownApproval``). A decided approval's question names the decision that stands.
    """

    from runlog.consumers._question import question as ask

    check_run_id(run_id)
    check_tenant(tenant)
    services = Services.shared(settings or Settings())
    return ask(_timeline(services, tenant, run_id), approval_id)


def _timeline(services: Services, tenant: str, run_id: str) -> Timeline:
    """The run's story as ``tenant`` sees it; another tenant's run is ``TenantMismatch``."""
    from runlog.consumers._queries import refuse_other_tenant
    from runlog.consumers._timeline import run_timeline

    state = replay(services.settings, services.redis, run_id, tenant=tenant).state
    if state.status == "new":
        raise UnknownRun(f"run {run_id} has no events", run_id=run_id)
    refuse_other_tenant(state.tenant, tenant, run_id)
    with LogReader(services.settings) as reader:
        return run_timeline(reader, services.redis, services.settings, tenant, run_id)


def lease_metrics() -> dict[str, int]:
    """This process's ownership counters: acquired, takeovers, claims_lost, renewed,
    renew_lost, released, fenced. Operational telemetry, never written to the log."""

    return dict(METRICS)


def append_metrics() -> dict[str, float]:
    """This process's append counters: acknowledged, failed, unknown, and ack_seconds (the
    sum of produce-to-acknowledgement times), and its barriers by how their acknowledgements
    came (barriers_served, barriers_followed). Operational telemetry, never in the log."""

    got = {k: APPENDS.get(k, 0) for k in (*telemetry.APPEND_RESULTS, "ack_seconds")}
    return got | {f"barriers_{how}": float(n) for how, n in BARRIERS.items()}


def serve_metrics(port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Serve this worker's lease and append metrics (and its CPU and memory) for
    Prometheus at ``http://host:port/metrics``; returns a function that stops the server."""

    from runlog.consumers._projection_metrics import serve

    server, _ = serve(port, telemetry.families, host)
    return server.shutdown
