"""The state projection: per run, its status, position in the log, conversation, usage,
cost and stored results (the fold: ``projections/_state_view``), stored as the run state's
parts plus the two that grow with every event, and the run index beside it.

The run index (what ``runlog runs`` and the console list, read by ``consumers._index``)
is written here, in the same MULTI/EXEC as the projection's position, so it is exactly as
current as the state view and a rebuild refolds it byte for byte.
Keys, beside the state projection's own under ``<prefix>:proj:state:{<topic>:<p>}``
(the partition's hash tag, so they commit with its position in one slot):

=========================  ==============================================================
``ix:tenants``             set of tenants with a run in the partition
``ix:t:<tenant>``          sorted set: run id scored by its last valid event (epoch ms)
``ix:s:<status>:<tenant>`` the same, for the runs currently in ``status``
``ix:subj:<tenant>:<sub>`` set of the runs of a data subject (RUN_STARTED's ``subject``,
                           else the run itself): what ``runlog forget --subject`` erases
``sum:<run>``              the state summary hash, plus ``ix_status``, ``started_at``,
                           ``last_type``, ``pending_approvals``, ``uncertain_calls``
=========================  ==============================================================

The tenant is the last part of each key, so no tenant name can spell another key
(a name with ``:`` is refused by writers anyway). Per changed run and batch the index
costs two ZADDs, one ZREM when the status changed, one SADD and one HSET of five
fields: O(log n) in the runs of its tenant and partition, never a rewrite of the index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from runlog.consumers._store import (
    Batch,
    Decoded,
    Handler,
    Projection,
    Rejected,
    dumps,
    message_json,
    text,
)
from runlog.projections import _state_view as state_view
from runlog.projections._run_state import RunState, Step
from runlog.projections._state_view import StateView
from runlog.schemas._models import Event, ForkEffectResolved, ToolCallCompleted, data_subject
from runlog.schemas._vocabulary import STARTS

# Fields the index adds to the state summary hash. Their names start apart from the
# summary's own so neither side can overwrite the other.
FIELDS = (
    "ix_status",
    "ix_since",
    "ix_until",
    "started_at",
    "last_type",
    "pending_approvals",
    "uncertain_calls",
)
LAST_TYPES = "ix_last_types"
SUBJECTS = "ix_subjects"
"""``Batch.extra`` entry: run id -> data subject, for a run whose first event the batch folded."""
"""``Batch.extra`` entry: run id -> type of the last valid event folded in this batch."""


def status_of(st: RunState) -> str:
    """The phase the index keeps a run under (``state_view.PHASES``): the log's part of its
    status, which ``state_view.status_from`` completes with the lease's holder."""
    return state_view.phase_of(st)


def score_of(at: datetime | None) -> float | None:
    """A run's score in the index's sorted sets: its last valid event, epoch ms."""
    return None if at is None else round(at.timestamp() * 1000, 3)


@dataclass(frozen=True)
class IndexKeys:
    """The index's keys in one partition of the state projection (``part`` is its root)."""

    part: str

    @property
    def tenants(self) -> str:
        return f"{self.part}:ix:tenants"

    def tenant(self, tenant: str) -> str:
        return f"{self.part}:ix:t:{tenant}"

    def status(self, status: str, tenant: str) -> str:
        return f"{self.part}:ix:s:{status}:{tenant}"

    def summary(self, run_id: str) -> str:
        return f"{self.part}:sum:{run_id}"

    def subject(self, tenant: str, subject: str) -> str:
        """The runs of data subject ``subject`` indexed in this partition (the tenant comes
        first here: it holds no ``:``, so the key names one tenant and one subject)."""
        return f"{self.part}:ix:subj:{tenant}:{subject}"

    def children(self, tenant: str, parent: str) -> str:
        """The forks of ``parent`` indexed in this partition (a fork lives where its own
        id hashes, so a parent's children are spread over the partitions)."""
        return f"{self.part}:ix:forks:{tenant}:{parent}"


def remember(view: StateView) -> str | None:
    """What the index needs of a run as loaded: its status, to move it between sets."""
    return status_of(view.state) if view.state.run_id else None


def observe(extra: dict[str, Any], view: StateView, ev: Event) -> None:
    """Called after each folded record: note the type of the run's last *valid* event."""
    st = view.state
    if st.seq == ev.seq and st.last_event_at == ev.occurred_at and st.run_id == ev.run_id:
        extra.setdefault(LAST_TYPES, {})[ev.run_id] = ev.type.value
        if ev.type in STARTS:
            # The default subject of a run is the run itself (RUN_STARTED names no other).
            extra.setdefault(SUBJECTS, {})[ev.run_id] = data_subject(ev.run_id, ev.payload)


def index_write(
    pipe: Any,
    keys: IndexKeys,
    run_id: str,
    view: StateView,
    before: str | None,
    extra: Mapping[str, Any],
    *,
    calls_changed: bool = True,
    fresh: bool = True,
    summary: Mapping[str, str] | None = None,
) -> None:
    """Queue the index writes for one changed run (inside the projection's MULTI).

    ``calls_changed``: whether the batch may have changed the run's open calls or
    approvals (else their counts are left as stored); ``fresh``: whether the run may be
    new to the index (else its tenant is already listed); ``summary``: the rest of the
    run's summary hash, written with the index's fields in one HSET."""
    st = view.state
    score = score_of(st.last_event_at)
    if not st.run_id or not st.tenant or score is None:
        # No valid event yet (only fenced or quarantined records): nothing to list.
        if summary:
            pipe.hset(keys.summary(run_id), mapping=dict(summary))
        return
    status = status_of(st)
    subject = extra.get(SUBJECTS, {}).get(run_id)
    if subject is not None:
        pipe.sadd(keys.subject(st.tenant, subject), run_id)
    if fresh:
        pipe.sadd(keys.tenants, st.tenant)
        if st.lineage is not None:
            pipe.sadd(keys.children(st.tenant, st.lineage.parent_run_id), run_id)
    pipe.zadd(keys.tenant(st.tenant), {run_id: score})
    if before is not None and before != status:
        pipe.zrem(keys.status(before, st.tenant), run_id)
    pipe.zadd(keys.status(status, st.tenant), {run_id: score})
    since = state_view.since_of(st)
    until = state_view.sleeping_until(st)
    fields = {
        **(summary or {}),
        "ix_status": status,
        "ix_since": since.isoformat() if since else "",
        "ix_until": until.isoformat() if until else "",
        "started_at": st.started_at.isoformat() if st.started_at else "",
    }
    if calls_changed:
        # Counting walks every open call and approval of the run: only when they changed.
        fields["pending_approvals"] = str(len(st.pending_approvals))
        fields["uncertain_calls"] = str(
            sum(1 for c in st.open_calls.values() if c.status != "started")
        )
    last = extra.get(LAST_TYPES, {}).get(run_id)
    if last is not None:
        fields["last_type"] = last
    pipe.hset(keys.summary(run_id), mapping=fields)


NAME = "state"


@dataclass(frozen=True)
class _Loaded:
    """What the state projection's ``remember`` keeps of a run as loaded."""

    status: str | None
    """Its run-index status (``remember``)."""
    messages: int
    """Messages already in its ``msgs`` list."""
    compactions: int
    """A compaction since rewrites the list instead of appending to it."""


class StateHandler(Handler[state_view.StateView]):
    """Stores a run's view apart: its own fields (where the run lives in the log), the run
    state's scalars, open calls and approvals (as every projection does), and the two parts
    that grow with every event: the conversation (``msgs:<id>``, a list appended to) and
    the stored results of completed calls (``done:<id>``, a hash written per completion)."""

    name = NAME
    full = True
    validator_key = "state"

    def empty(self) -> state_view.StateView:
        return state_view.StateView()

    def validator(self, state: state_view.StateView) -> RunState:
        return state.state

    def share(self, state: state_view.StateView, validator: RunState) -> None:
        state.state = validator

    def own(self, state: state_view.StateView) -> dict[str, Any]:
        return state.location_dict()

    def restore(self, own: dict[str, Any], validator: RunState) -> state_view.StateView:
        view = state_view.StateView.from_dict({**own, "state": {}})
        view.state = validator
        return view

    def load_extra(self, pipe: Any, partition: int, run_id: str) -> int:
        pipe.lrange(self.keys.messages(partition, run_id), 0, -1)
        pipe.hgetall(self.keys.completed(partition, run_id))
        return 2

    def restore_extra(
        self, partition: int, run_id: str, data: dict[str, Any], replies: list[Any]
    ) -> None:
        msgs, done = replies
        data["messages"] = [json.loads(m) for m in msgs]
        data["completed_calls"] = {text(k): text(v) for k, v in sorted(done.items())}

    def done(self, state: state_view.StateView) -> bool:
        return state.state.status == "finished"

    def remember(self, state: state_view.StateView) -> Any:
        st = state.state
        return _Loaded(remember(state), len(st.messages), st.compactions)

    def on_step(
        self,
        batch: Batch[state_view.StateView],
        state: state_view.StateView,
        rec: Decoded,
        step: Step,
    ) -> None:
        state_view.place(state, rec.partition, rec.offset)
        if not step.accepted:
            return
        ev = rec.event
        observe(batch.extra, state, ev)
        p = ev.payload
        if isinstance(p, ToolCallCompleted) and p.idempotency_key is not None:
            # Only this key's stored result changed; the others are already in Redis.
            batch.extra.setdefault("done", {}).setdefault(ev.run_id, set()).add(p.idempotency_key)
        elif isinstance(p, ForkEffectResolved) and p.resolution != "repeated":
            # A fork took another timeline's result (or a refusal) as this key's.
            batch.extra.setdefault("done", {}).setdefault(ev.run_id, set()).add(p.logical_key)

    def on_rejected(
        self, batch: Batch[state_view.StateView], state: state_view.StateView, rec: Rejected
    ) -> None:
        state_view.apply_quarantined(state, rec.partition, rec.offset, rec.error)

    def write_run(
        self, pipe: Any, batch: Batch[state_view.StateView], run_id: str, state: Any
    ) -> None:
        p, st = batch.partition, state.state
        was: _Loaded = batch.before[run_id]
        msgs = self.keys.messages(p, run_id)
        whole = (p, run_id) in self._whole
        if whole or st.compactions != was.compactions:
            # A view stored whole by an earlier store is split on its first write; a
            # compaction replaced the conversation (rare, and bounded by what it kept).
            # Should the EXEC fail, the runner forgets the partition and reloads.
            pipe.delete(msgs)
            new = st.messages
        else:
            new = st.messages[was.messages :]
        if new:
            pipe.rpush(msgs, *[dumps(message_json(m)) for m in new])
        keys_done = sorted(
            st.completed_calls if whole else batch.extra.get("done", {}).get(run_id, ())
        )
        if keys_done:
            pipe.hset(
                self.keys.completed(p, run_id),
                mapping={k: st.completed_calls[k] for k in keys_done},
            )
        changed = (
            whole
            or run_id in batch.fresh
            or bool(batch.calls.get(run_id))
            or bool(batch.approvals.get(run_id))
        )
        # The run index commits with the view and the position (same MULTI, same slot);
        # its fields go into the summary hash with the summary, one HSET.
        keys = IndexKeys(self.keys.part(p))
        index_write(
            pipe,
            keys,
            run_id,
            state,
            was.status,
            batch.extra,
            calls_changed=changed,
            fresh=whole or run_id in batch.fresh,
            summary=state.summary(),
        )


PROJECTION = Projection(NAME, fold=state_view, handler=StateHandler)
