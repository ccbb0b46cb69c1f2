"""Verification of the replay contract for one run (or all): what ``runlog verify`` runs.

Checks:

* ``determinism``: folding the run's log twice gives identical state (digest);
* ``vocabulary``: every event type is classified (state-changing or record-only) and has
  a fold rule, and every event in the log has a classified type;
* ``gaps``: valid events have seqs 1..N without a hole, and every record the fold rejected
  is explained: a stale epoch after a takeover (``stale_epoch``, with or without a
  duplicate seq) or a lost ownership claim (``lost_claim``). Anything else is unexplained;
* ``started_once``: the run has one RUN_STARTED, besides starts that lost a start race
  (a claim on an outdated view, or a writer taken over before its start landed);
* ``tenants``: every record of a tenant that has a MAC key (``RUNLOG_TENANT_KEYS``) is
  authenticated by it; a record another tenant's writer forged fails it, named (the other
  checks see the log as readers do, without it);
* ``decisions``: every decision the ownership rule accepts is signed by a trusted decider
  (``RUNLOG_DECIDER_PUBLIC_KEYS``); a forged one (unsigned, an unknown key, a signature
  of another decision) fails it, named. With no keys trusted it passes and says how many
  decisions are unsigned;
* ``lineage``: a fork's first record carries the state its ``parent_digest`` names, and
  the parent's log, where it can be read, folds to that digest at the fork point;
* an erased run (CONTENT_ERASED: its content shredded and purged) is reported ``erased``
  with who, when and why, not as a failure: its structure is checked as any run's, and the
  lineage of a fork whose parent (or itself) was erased is not compared by digest, since
  the erased content no longer folds to the digest recorded before the erasure;
* ``snapshot_equivalence``: every stored snapshot plus its tail equals the full replay,
  and so does an in-memory snapshot (``to_dict``/``from_dict`` round trip) at sampled cut
  points of the log. A mismatch counts ``full_replay_equivalence_failures``.

Pure functions take decoded records; ``verify_run`` reads them from Kafka.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from confluent_kafka import Consumer, KafkaException, TopicPartition

from runlog._settings import Settings
from runlog.errors import InvalidRunId, KafkaUnavailable, SchemaError, UnreadableRecord
from runlog.log import _metrics as metrics
from runlog.log._authority import authority_for
from runlog.log._fold import fold_range
from runlog.log._kafka import reader_config
from runlog.log._keys import keys_for
from runlog.log._reader import LogReader, LogRecord
from runlog.log._registry import ids_for
from runlog.log._setaside import set_aside_offsets
from runlog.log._snapshots import SnapshotInvalid
from runlog.projections._lineage import unpack_state
from runlog.projections._run_state import (
    RULES,
    RunState,
    accept,
    decision_verdict,
    fold,
    is_valid,
    rejection,
)
from runlog.schemas._codec import decode
from runlog.schemas._keys import check_run_id
from runlog.schemas._models import ApprovalDecided, Event, RunForked
from runlog.schemas._sealing import ERASED
from runlog.schemas._signing import NO_AUTHORITY, DecisionAuthority
from runlog.schemas._vocabulary import RECORD_ONLY, STARTS, STATE_CHANGING, EventType, classify

if TYPE_CHECKING:
    from runlog.log._snapshots import SnapshotStore

EXPLAINED = frozenset({"stale_epoch", "stale_epoch_duplicate_seq", "lost_claim"})
FORGED = "forged_decision"
"""Rejected by the decision check, which names it (``check_decisions``), not by ``gaps``."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "counts": self.counts}


@dataclass
class Report:
    run_id: str
    tenant: str
    records: int = 0
    seq: int = 0
    checks: list[Check] = field(default_factory=list)
    error: str | None = None
    missing: bool = False
    """No records of the run, or the run is another tenant's: to this tenant, not found."""
    erased: dict[str, Any] | None = None
    """The run's content was erased (CONTENT_ERASED): by, at, reason, subject."""

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.checks)

    @property
    def verdict(self) -> str:
        """``ok``, ``erased`` (its checks pass and its content was erased) or ``failed``."""
        if not self.ok:
            return "failed"
        return "erased" if self.erased is not None else "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "tenant": self.tenant,
            "ok": self.ok,
            "records": self.records,
            "seq": self.seq,
            "error": self.error,
            "checks": [c.to_dict() for c in self.checks],
            "verdict": self.verdict,
            **({} if self.erased is None else {"erased": self.erased}),
        }

    def text(self) -> str:
        head = {"ok": "OK  ", "erased": "ERASED", "failed": "FAIL"}[self.verdict]
        lines = [f"{head} {self.tenant}/{self.run_id}: {self.records} records, seq {self.seq}"]
        if self.erased is not None:
            e = self.erased
            lines.append(f"  content erased by {e['by']} at {e['at']}: {e['reason']}")
        if self.error:
            lines.append(f"  error: {self.error}")
        for c in self.checks:
            mark = "ok  " if c.ok else "FAIL"
            extra = f" {c.counts}" if c.counts else ""
            lines.append(f"  {mark} {c.name}: {c.detail}{extra}")
        return "\n".join(lines)


# ------------------------------------------------------------------------- pure checks


def _fold(
    events: Iterable[Event], authority: DecisionAuthority, state: RunState | None = None
) -> RunState:
    st = RunState(authority=authority) if state is None else state
    st.authority = authority
    return fold(events, st)


def check_determinism(
    events: Sequence[Event], authority: DecisionAuthority = NO_AUTHORITY
) -> Check:
    a, b = _fold(events, authority), _fold(events, authority)
    same = a.digest() == b.digest() and a.to_dict() == b.to_dict()
    return Check("determinism", same, f"digest {a.digest()[:16]}" if same else "two folds differ")


def check_vocabulary(events: Iterable[Event] = ()) -> Check:
    problems: list[str] = []
    for et in EventType:
        try:
            classify(et)
        except SchemaError as exc:
            problems.append(str(exc))
        if et not in RULES:
            problems.append(f"{et.value} has no fold rule")
    if STATE_CHANGING & RECORD_ONLY:
        problems.append(f"both state-changing and record-only: {STATE_CHANGING & RECORD_ONLY}")
    seen: Counter[str] = Counter()
    for ev in events:
        seen[ev.type.value] += 1
        if ev.type not in STATE_CHANGING | RECORD_ONLY:
            problems.append(f"{ev.type.value} in the log is not classified")
    detail = "; ".join(problems) if problems else f"{len(EventType)} types classified with rules"
    return Check("vocabulary", not problems, detail, dict(sorted(seen.items())))


def check_gaps(events: Sequence[Event], authority: DecisionAuthority = NO_AUTHORITY) -> Check:
    st = RunState(authority=authority)
    reasons: Counter[str] = Counter()
    valid_seqs: list[int] = []
    where: list[str] = []
    for ev in events:
        why = rejection(st, ev)
        if why is None:
            valid_seqs.append(ev.seq)
        else:
            reasons[why] += 1
            if why not in EXPLAINED and why != FORGED:
                where.append(f"seq {ev.seq} epoch {ev.epoch} {ev.type.value}: {why}")
        accept(st, ev)
    contiguous = valid_seqs == list(range(1, len(valid_seqs) + 1))
    ok = contiguous and not where
    if not contiguous:
        where.insert(0, "valid seqs are not 1..N")
    detail = (
        f"{len(valid_seqs)} valid, {sum(reasons.values())} fenced, all explained"
        if ok
        else "; ".join(where)
    )
    return Check("gaps", ok, detail, dict(sorted(reasons.items())))


def check_tenants(forged: Sequence[LogRecord]) -> Check:
    """Records the readers rejected as not authenticated by their tenant's writers."""
    if not forged:
        return Check("tenants", True, "no record fails its tenant's MAC")
    where = [
        f"offset {r.offset} seq {r.event.seq} {r.event.type.value} by writer "
        f"{r.event.writer_id}: {r.forged}"
        for r in forged
    ]
    return Check("tenants", False, "; ".join(where), {"forged_tenant": len(forged)})


def check_decisions(events: Sequence[Event], authority: DecisionAuthority = NO_AUTHORITY) -> Check:
    """Every decision the ownership rule lets in is a trusted decider's (see module doc)."""
    st = RunState(authority=authority)
    counts: Counter[str] = Counter()
    forged: list[str] = []
    for ev in events:
        if ev.type is EventType.APPROVAL_DECIDED:
            why = rejection(st, ev)
            if why is None or why == FORGED:
                verdict = decision_verdict(st, ev)
                p = ev.payload
                assert isinstance(p, ApprovalDecided)
                if not verdict.accepted:
                    counts["forged"] += 1
                    forged.append(
                        f"seq {ev.seq} epoch {ev.epoch} by writer {ev.writer_id}: approval "
                        f"{p.approval_id} {'approved' if p.approved else 'rejected'} as "
                        f"{p.decided_by!r}: {verdict.why}"
                    )
                elif verdict.key_id:
                    counts["signed"] += 1
                else:
                    counts["unsigned"] += 1
        accept(st, ev)
    if forged:
        return Check("decisions", False, "; ".join(forged), dict(sorted(counts.items())))
    if not authority.enforcing:
        detail = (
            f"{counts['unsigned']} decision(s) unsigned: no decider keys trusted "
            "(RUNLOG_DECIDER_PUBLIC_KEYS)"
        )
    else:
        detail = f"{counts['signed']} decision(s) signed by trusted deciders"
    return Check("decisions", True, detail, dict(sorted(counts.items())))


def check_started_once(
    events: Sequence[Event], authority: DecisionAuthority = NO_AUTHORITY
) -> Check:
    """The run was started once: every RUN_STARTED after the valid one lost a start race.

    A start race is lost two ways: a claim on an outdated view (``lost_claim``, a higher
    epoch), or a writer whose lease was taken over before its start landed (an epoch below
    the valid start's: it held the run before the winner did, when the log had no start;
    the takeover fenced it). Any other RUN_STARTED after the valid one (at or above the
    valid start's epoch: a writer that counted epochs again or took a run with history
    for a new one) means it located the run wrongly and may have repeated its effects.
    """
    st = RunState(authority=authority)
    starts = 0
    started_at_epoch: int | None = None
    again: list[str] = []
    for ev in events:
        why = rejection(st, ev)
        if ev.type in STARTS:
            starts += 1
            if why is None and started_at_epoch is None:
                started_at_epoch = ev.epoch
            fenced_before = (
                why == "stale_epoch_duplicate_seq"
                and started_at_epoch is not None
                and ev.epoch < started_at_epoch
            )
            if starts > 1 and why != "lost_claim" and not fenced_before:
                verdict = why or "accepted"
                again.append(f"seq {ev.seq} epoch {ev.epoch} by {ev.writer_id} ({verdict})")
        accept(st, ev)
    if again:
        detail = "run_started again after the run started: " + "; ".join(again)
    else:
        detail = f"{starts} run_started, {max(starts - 1, 0)} lost start race(s)"
    return Check("started_once", not again, detail, {"run_started": starts})


def check_lineage(
    events: Sequence[Event],
    authority: DecisionAuthority = NO_AUTHORITY,
    reader: LogReader | None = None,
) -> Check:
    """A fork's lineage holds: the state it begins with is the one its digest names, and
    (with a reader, when the parent's records are still in the log) the parent's own log
    folds to that digest at the fork point. A started run passes ("not a fork")."""
    first = next((ev for ev in events if ev.seq == 1 and ev.type in STARTS), None)
    if first is None or not isinstance(first.payload, RunForked):
        return Check("lineage", True, "not a fork")
    p = first.payload
    where = f"{p.parent_run_id} at seq {p.at_seq}"
    if p.state == ERASED:
        # The carried state was sealed under the subject's key, since destroyed: there is
        # no content left to hold to the digest. Erased, not corrupt.
        detail = f"forked from {where}; the carried state is erased (its subject forgotten)"
        return Check("lineage", True, detail, {"erased": 1})
    if any(ev.type is EventType.CONTENT_ERASED for ev in events):
        # Its content (the carried state included) is erased: no digest to compare.
        return Check("lineage", True, f"forked from {p.parent_run_id}; content erased")
    carried = RunState.from_dict(unpack_state(p.state), authority).digest()
    if carried != p.parent_digest:
        detail = f"the state the fork carries has digest {carried[:16]}, not {p.parent_digest[:16]}"
        return Check("lineage", False, detail, {"digest_mismatch": 1})
    if reader is None:
        return Check("lineage", True, f"forked from {where}; carried state matches its digest")
    partition = reader.partition_of(p.parent_run_id)
    parent = fold_range(
        reader,
        p.parent_run_id,
        partition,
        None,
        reader.high_watermark(partition),
        to_seq=p.at_seq,
    )
    if parent is None or parent.state.seq < p.at_seq or parent.state.tenant != first.tenant:
        detail = f"forked from {where}; the parent's log is not readable here (self-contained)"
        return Check("lineage", True, detail)
    if parent.state.digest() != p.parent_digest:
        whole = fold_range(
            reader, p.parent_run_id, partition, None, reader.high_watermark(partition)
        )
        if whole is not None and whole.state.erased is not None:
            detail = f"forked from {where}; the parent's content was erased since"
            return Check("lineage", True, detail)
        detail = f"the parent's log folds to {parent.state.digest()[:16]} at seq {p.at_seq}"
        return Check("lineage", False, detail, {"parent_mismatch": 1})
    return Check("lineage", True, f"forked from {where}; digest matches the parent's log")


def cut_points(n: int, samples: int = 16) -> list[int]:
    if n <= samples:
        return list(range(n + 1))
    step = n / samples
    return sorted({0, n, *(int(i * step) for i in range(samples))})


def check_cut_points(
    events: Sequence[Event], samples: int = 16, authority: DecisionAuthority = NO_AUTHORITY
) -> Check:
    """Snapshot (to_dict -> from_dict) at cut points + fold of the tail == full fold."""
    full = _fold(events, authority).digest()
    bad: list[int] = []
    for cut in cut_points(len(events), samples):
        snap = RunState.from_dict(_fold(events[:cut], authority).to_dict(), authority)
        if fold(events[cut:], snap).digest() != full:
            bad.append(cut)
    if bad:
        metrics.incr("full_replay_equivalence_failures", len(bad))
    return Check(
        "cut_points",
        not bad,
        f"{len(cut_points(len(events), samples))} cut points agree"
        if not bad
        else f"snapshot+tail differs at cuts {bad}",
    )


def check_stored_snapshots(
    records: Sequence[LogRecord], full: RunState, store: SnapshotStore, tenant: str, run_id: str
) -> Check:
    """Every stored snapshot + the records after its offset == the full replay."""

    if not records:
        return Check("stored_snapshots", True, "no records")
    partition = records[0].partition
    results: Counter[str] = Counter()
    notes: list[str] = []
    ok = True
    for cand in store.candidates(tenant, run_id, partition=partition):
        if isinstance(cand, SnapshotInvalid):
            results[f"miss_{cand.reason}"] += 1  # a cache miss, never a correctness failure
            notes.append(f"unusable ({cand})")
            continue
        tail = [r.event for r in records if r.offset >= cand.offset]
        state = RunState.from_dict(cand.state.to_dict(), full.authority)
        if tail and not is_valid(state, tail[0]):
            results["discontinuous"] += 1
            notes.append(f"seq {cand.seq}: tail starts at seq {tail[0].seq} (cache miss)")
            continue
        if fold(tail, state).digest() == full.digest():
            results["equal"] += 1
        else:
            ok = False
            results["mismatch"] += 1
            metrics.incr("full_replay_equivalence_failures")
            notes.append(f"seq {cand.seq} ({cand.key}) + tail differs from full replay")
    detail = "; ".join(notes) if notes else f"{results['equal']} stored snapshot(s) agree"
    if not results:
        detail = "no stored snapshots"
    return Check("stored_snapshots", ok, detail, dict(results))


def verify_events(
    events: Sequence[Event], authority: DecisionAuthority = NO_AUTHORITY
) -> list[Check]:
    """The log-only checks (no snapshot store), trusting ``authority``'s decider keys."""
    return [
        check_determinism(events, authority),
        check_vocabulary(events),
        check_gaps(events, authority),
        check_decisions(events, authority),
        check_started_once(events, authority),
        check_cut_points(events, authority=authority),
    ]


# ------------------------------------------------------------------------- against Kafka


def verify_run(
    settings: Settings,
    client: redis.Redis,
    run_id: str,
    *,
    tenant: str = "default",
    snapshots: SnapshotStore | None = None,
    reader: LogReader | None = None,
    first_offset: int | None = None,
) -> Report:
    """Check the replay contract on the run's whole log.

    Verify trusts the log only: it reads from ``first_offset`` (where a scan of the topic
    found the run's first record, ``run_starts``) or else from the partition's beginning,
    never from Redis' start index or the run id's time, so records a located read would
    skip (a run started twice after Redis lost its keys) are checked too.
    """
    report = Report(run_id=run_id, tenant=tenant)
    own = reader is None
    rd = LogReader(settings) if reader is None else reader
    t0 = time.perf_counter()
    try:
        partition = rd.partition_of(run_id)
        end = rd.high_watermark(partition)
        start = first_offset
        try:
            folded = fold_range(rd, run_id, partition, start, end, keep=True)
        except UnreadableRecord as exc:
            # Report what could be read, up to the record that stopped the read.
            before = fold_range(rd, run_id, partition, start, exc.offset, keep=True)
            assert before is not None
            report.records, report.seq = len(before.kept), before.state.seq
            report.error = (
                f"read {len(before.kept)} records (seq {before.state.seq}), then stopped at "
                f"{exc.topic}[{exc.partition}]@{exc.offset}: {exc}"
            )
            return report
        assert folded is not None
        records = folded.kept
        events = [r.event for r in records]
        report.records, report.seq = len(records), folded.state.seq
        if not records:
            report.error = f"no records of run {run_id} in {settings.events_topic}[{partition}]"
            report.missing = True
            return report
        if events[0].tenant != tenant:
            report.error = f"run {run_id} belongs to another tenant, not to {tenant!r}"
            report.missing = True  # to this tenant, the run does not exist
            return report
        forged = [r for r in records if r.forged is not None]
        report.checks.append(check_tenants(forged))
        authentic = [r.event for r in records if r.forged is None]
        report.checks.extend(verify_events(authentic, authority_for(settings)))
        report.checks.append(check_lineage(authentic, authority_for(settings), rd))
        erased = folded.state.erased
        if erased is not None:
            report.erased = {
                "by": erased.erased_by,
                "at": erased.erased_at.isoformat(),
                "reason": erased.reason,
                "subject": erased.subject,
                "key_ids": list(erased.key_ids),
                "seq": erased.erased_seq,
            }
        if snapshots is not None:
            report.checks.append(
                check_stored_snapshots(records, folded.state, snapshots, tenant, run_id)
            )
        metrics.incr("events_replayed", len(records))
        metrics.timing("replay_duration_ms", (time.perf_counter() - t0) * 1000)
        return report
    finally:
        if own:
            rd.close()


def _run_key(raw: bytes | None) -> str | None:
    """The run a record's key names, or None: a key that is missing, not UTF-8 or not a
    valid run id belongs to no run (some other producer wrote it; the projections
    quarantine it), so there is no run to verify and nothing to fail."""
    try:
        return check_run_id((raw or b"").decode())
    except (UnicodeDecodeError, InvalidRunId):
        return None


def list_runs(
    settings: Settings, *, progress: Any = None, client: redis.Redis | None = None
) -> list[tuple[str, str]]:
    """``(tenant, run_id)`` of every run in the events topic, by scanning its keys
    (``run_starts`` without the offsets)."""
    return [(t, r) for t, r, _ in run_starts(settings, progress=progress, client=client)]


def run_starts(
    settings: Settings, *, progress: Any = None, client: redis.Redis | None = None
) -> list[tuple[str, str, int]]:
    """``(tenant, run_id, offset of its first record)`` of every run in the events topic,
    by scanning its keys.

    Decodes only the first record of each key (for its tenant). Cost: one pass over the
    topic; a state-projection index would avoid it. With ``client``, records an operator
    set aside are skipped as every reader skips them: a key whose only records were set
    aside names no run left to verify.
    """
    consumer = Consumer(reader_config(settings))
    ids = ids_for(settings)
    keys = keys_for(settings)
    found: dict[str, tuple[str, int]] = {}
    try:
        reader = LogReader(settings)
        try:
            parts = reader.partition_count()
            highs = [reader.high_watermark(p) for p in range(parts)]
        finally:
            reader.close()
        total = sum(highs)
        done = 0
        for p, high in enumerate(highs):
            if high == 0:
                continue
            aside = set_aside_offsets(client, settings, p) if client is not None else frozenset()
            consumer.assign([TopicPartition(settings.events_topic, p, 0)])
            pos = 0
            while pos < high:
                for msg in consumer.consume(1000, timeout=1.0):
                    if msg.error() is not None:
                        continue
                    pos = (msg.offset() or 0) + 1
                    done += 1
                    key = _run_key(msg.key())
                    off = msg.offset() or 0
                    if key is not None and key not in found and off not in aside:
                        try:
                            found[key] = (decode(msg.value() or b"", ids, keys).tenant, off)
                        except SchemaError:
                            found[key] = ("?", off)
                    if progress is not None:
                        progress(done - 1, total)
            consumer.unassign()
    except KafkaException as exc:
        raise KafkaUnavailable(f"scanning {settings.events_topic}: {exc}") from exc
    finally:
        consumer.close()
    return sorted((tenant, rid, off) for rid, (tenant, off) in found.items())
