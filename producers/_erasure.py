"""Forgetting a data subject: record the erasure in each run's log, shred the keys, purge.

``forget`` works in an order that a kill -9 at any point leaves completable by running it
again (every step is idempotent):

1. **Stop** a run still in progress: ``control.terminate`` takes it with a higher epoch, so
   its owner is fenced at its next append and never invokes another tool; it ends
   ``terminated`` (its open calls stay open, for reconciliation, as after any terminate).
   A run is never erased while it can still write: a new key would only postpone the
   question of what the old content was.
2. **Intent, in the log**: CONTENT_ERASED (subject, key ids, who, why; when is its time) is
   appended to each run, by a writer that took the run with a higher epoch (the fold accepts
   it only on a finished run, above the current epoch). From then on every reader of the
   run folds its content as erased, and every projection runner purges its copies when it
   folds the record (``consumers._erasure``), so the purge of the projections is driven by
   the log: a runner killed before it committed the purge purges on restart.
3. **Shred** the subject's data keys through ``KeyShredder`` (idempotent).
4. **Purge** the copies outside the projections that ``log.copies`` lists: the run's
   inbox (queued cancellations and decisions, with their reasons and notes), the entries
   set aside from it, its cancel flag and its snapshots.

A re-run finds CONTENT_ERASED in the log, skips step 2 and redoes 3 and 4. The facade
(``runlog.forget``) then waits for the projections to fold the erasures and rewrites
Redis's persistence files.

What is *not* here: the encryption itself (``KeyShredder`` is the key store's destroying
side), and set-aside decisions (``log.setaside``), which hold an operator's words about a
record, never the record's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from runlog.errors import Fenced, RedisUnavailable, RunFinished
from runlog.log import _copies as copies
from runlog.log._clients import REDIS_ERRORS
from runlog.log._fold import read_run
from runlog.log._keys import keys_for
from runlog.producers import _control as control
from runlog.producers._engine import RunDeps
from runlog.producers._opening import open_run_with
from runlog.projections._run_state import RunState
from runlog.schemas._models import Payload, data_subject
from runlog.schemas._sealing import readable_fields
from runlog.schemas._vocabulary import STARTS, EventType

log = logging.getLogger(__name__)


class KeyShredder(Protocol):
    """Destroys a data subject's keys for good (the key store's shredding side)."""

    def shred(self, tenant: str, subject: str) -> list[str]:
        """Destroy every data key of ``subject`` in ``tenant``; return the ids destroyed.
        Idempotent: a subject already shredded returns []."""
        ...


class KeyLister(Protocol):
    """Optionally, a shredder also lists a subject's key ids before it destroys them: the
    CONTENT_ERASED then names the keys it is about to destroy (it is appended first)."""

    def key_ids(self, tenant: str, subject: str) -> list[str]: ...


def _listed(shredder: KeyShredder, tenant: str, subject: str) -> list[str]:
    lister = getattr(shredder, "key_ids", None)
    return list(lister(tenant, subject)) if callable(lister) else []


class NoKeys:
    """The shredder of a deployment without encrypted payloads: there is no key to
    destroy (the purge of the plaintext copies is then the whole erasure)."""

    def shred(self, tenant: str, subject: str) -> list[str]:
        return []


NO_KEYS = NoKeys()


def known(deps: RunDeps, tenant: str, run_id: str) -> RunState:
    """The run's state from its log; ``UnknownRun`` for a run this tenant does not have."""
    return control.known_state(deps, tenant, run_id)


subject_of = data_subject
"""A run's data subject (``models.data_subject``)."""


@dataclass(frozen=True)
class ErasedRun:
    """One run's erasure as ``forget`` found or made it."""

    run_id: str
    subject: str
    seq: int
    """Seq of its CONTENT_ERASED."""
    partition: int
    offset: int | None
    """Offset of its CONTENT_ERASED when this call appended it (None: it was there)."""
    terminated: bool = False
    """The run was in progress: this call terminated it first."""
    already: bool = False
    """An earlier forget had recorded the erasure; this one redid the shred and purge."""


@dataclass
class ForgetReport:
    """What ``forget`` did: the runs, the subjects, the keys destroyed, the purges."""

    tenant: str
    reason: str
    by: str
    runs: list[ErasedRun] = field(default_factory=list)
    subjects: list[str] = field(default_factory=list)
    keys_shredded: list[str] = field(default_factory=list)
    copies_deleted: int = 0
    """Keys of the runs' own copies deleted (``log.copies``: inboxes, cancel flags,
    snapshots)."""
    projections_purged: bool | None = None
    """Every projection runner folded the erasures (None: not waited for)."""
    projections_behind: list[str] = field(default_factory=list)
    """The projections that had not purged when the wait ended (their service is stopped or
    behind: it purges when it folds the erasure; run ``forget`` again to see it done)."""
    checked: str = ""
    """Where the runs were looked for: the run index (when it was current) or the events
    topic itself, and why."""
    persistence_rewritten: bool | None = None
    """Redis rewrote its AOF and RDB after the purge (None: not asked)."""
    requests_dropped: list[str] = field(default_factory=list)
    """Start requests of the subject no worker had started (their lifecycle records hold
    the run's input): tombstoned, so no worker starts the forgotten person's run."""
    log_plaintext_kept: bool = False
    """The events topic still holds content of these runs in clear: it was written with
    encryption off (``RUNLOG_ENCRYPTION``), so no key shred can erase it; only the topic's
    own retention deletes it. runlog's copies (projections, snapshots) are purged."""
    log_plaintext_runs: list[str] = field(default_factory=list)
    """The runs whose log records still read in clear after the shred."""
    log_plaintext_note: str = ""
    """One line saying so, and what fixes it for future runs (empty when nothing is kept)."""


PLAINTEXT_NOTE = (
    "the events topic still holds these runs' content in clear: they were written with "
    "encryption off, and a record of the log cannot be rewritten, so it stays there until "
    "the topic's retention deletes it (runlog's own copies are purged); set "
    "RUNLOG_ENCRYPTION=on with RUNLOG_KEK for future runs, so that forget shreds their key"
)


def _started(deps: RunDeps, tenant: str, run_id: str) -> tuple[RunState, Payload | None, int]:
    """The run's state, its first event's payload and its partition, from the log."""
    reader = deps.reader_factory()
    try:
        got = read_run(reader, deps.redis, deps.settings, tenant, run_id, keep=True)
    finally:
        reader.close()
    first = next((r.event for r in got.folded.kept if r.event.type in STARTS), None)
    return got.state, None if first is None else first.payload, got.partition


def plaintext_left(deps: RunDeps, tenant: str, run_id: str) -> bool:
    """Whether the run's log still reads any content in clear (after its subject's keys are
    shredded: a content field that holds text other than ``ERASED``)."""
    reader = deps.reader_factory()
    try:
        got = read_run(reader, deps.redis, deps.settings, tenant, run_id, keep=True)
    finally:
        reader.close()
    return any(readable_fields(r.event) for r in got.folded.kept)


def run_subject(deps: RunDeps, tenant: str, run_id: str) -> str:
    """The data subject of ``run_id``, from its first event."""
    _, started, _ = _started(deps, tenant, run_id)
    return subject_of(run_id, started)


def erase_run(
    deps: RunDeps, tenant: str, run_id: str, *, reason: str, by: str, key_ids: Iterable[str] = ()
) -> ErasedRun:
    """Stop ``run_id`` if it is in progress and append its CONTENT_ERASED (steps 1 and 2);
    an erasure already in the log is returned as it is."""
    control.check_words(reason, by)
    state = control.known_state(deps, tenant, run_id)
    terminated = False
    if state.erased is None and state.status != "finished":
        try:
            control.terminate(deps, run_id, tenant=tenant, reason=f"forget: {reason}", by=by)
            terminated = True
        except RunFinished:
            pass  # it ended meanwhile: erase it as it ended
    state, started, partition = _started(deps, tenant, run_id)
    subject = subject_of(run_id, started)
    if state.erased is not None:
        return ErasedRun(run_id, subject, state.erased.erased_seq, partition, None, already=True)
    run = open_run_with(deps, run_id, tenant=tenant, recover=False, create=False)
    with run:
        if run.state.erased is not None:  # another forget won the lease first
            e = run.state.erased
            return ErasedRun(run_id, subject, e.erased_seq, partition, None, already=True)
        if run.state.status != "finished":
            raise Fenced(f"run {run_id} was resumed while being erased", run_id=run_id)
        payload = {"subject": subject, "key_ids": list(key_ids), "erased_by": by, "reason": reason}
        with run.lock:
            # The writer's usual path refuses a finished run: this is the one event that
            # comes after the finish, at the next seq, under the eraser's higher epoch.
            ev = run.send(EventType.CONTENT_ERASED, payload, local=False)
            (delivered,) = run.barrier()
        reader = deps.reader_factory()
        try:
            accepted = run.read_back(reader, delivered.offset + 1)
        finally:
            reader.close()
        if ev.event_id not in accepted:
            raise run.fenced(f"the erasure of {run_id} at seq {ev.seq} lost to another writer")
        log.warning("run %s: content erased by %s (%s), subject %s", run_id, by, reason, subject)
        return ErasedRun(
            run_id, subject, ev.seq, delivered.partition, delivered.offset, terminated=terminated
        )


def purge_copies(deps: RunDeps, tenant: str, run_id: str) -> int:
    """Delete the run's own keys that hold content outside its log (``log.copies``: its
    inbox, the inbox entries set aside, the cancel flag, its snapshots, advertised or
    orphaned); returns how many keys went. The projections' copies are their runners'."""
    prefix = deps.settings.redis_key_prefix
    try:
        n = int(deps.redis.delete(*copies.run_keys(prefix, tenant, run_id)))
        for pattern in copies.run_key_patterns(prefix, tenant, run_id):
            for key in deps.redis.scan_iter(match=pattern, count=500):
                n += int(deps.redis.delete(key))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"deleting the copies of {run_id}: {exc}") from exc
    return n


def forget(
    deps: RunDeps,
    tenant: str,
    run_ids: Iterable[str],
    *,
    reason: str,
    by: str,
    shredder: KeyShredder = NO_KEYS,
) -> ForgetReport:
    """Erase the content of ``run_ids`` (steps 1 to 4 of the module docstring): intent in
    each run's log first, then the subjects' keys shredded, then the snapshots purged."""
    control.check_words(reason, by)
    report = ForgetReport(tenant, reason, by)
    for rid in dict.fromkeys(run_ids):
        keys = _listed(shredder, tenant, run_subject(deps, tenant, rid))
        report.runs.append(erase_run(deps, tenant, rid, reason=reason, by=by, key_ids=keys))
    report.subjects = sorted({r.subject for r in report.runs})
    for subject in report.subjects:
        report.keys_shredded.extend(shredder.shred(tenant, subject))
    drop_cached_keys(deps, report.keys_shredded)
    for r in report.runs:
        report.copies_deleted += purge_copies(deps, tenant, r.run_id)
    report.log_plaintext_runs = [
        r.run_id for r in report.runs if plaintext_left(deps, tenant, r.run_id)
    ]
    report.log_plaintext_kept = bool(report.log_plaintext_runs)
    report.log_plaintext_note = PLAINTEXT_NOTE if report.log_plaintext_kept else ""
    return report


def drop_cached_keys(deps: RunDeps, key_ids: Iterable[str]) -> None:
    """This process's key store forgets the shredded keys at once (a shredder other than
    the process's own store, e.g. a KMS adapter, leaves them cached until its refresh)."""
    ids = list(key_ids)
    store = keys_for(deps.settings)
    if ids and store is not None:
        store.drop_cached(ids)
