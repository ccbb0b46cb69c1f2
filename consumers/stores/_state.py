"""The state projection: per run, its status, position in the log, conversation, usage,
cost and stored results (the fold: ``projections/state_view``), stored as the run state's
parts plus the two that grow with every event, and the run index beside it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from runlog.consumers import _index as index
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
from runlog.schemas._models import ForkEffectResolved, ToolCallCompleted

NAME = "state"


@dataclass(frozen=True)
class _Loaded:
    """What the state projection's ``remember`` keeps of a run as loaded."""

    status: str | None
    """Its run-index status (``index.remember``)."""
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
        return _Loaded(index.remember(state), len(st.messages), st.compactions)

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
        index.observe(batch.extra, state, ev)
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
        keys = index.IndexKeys(self.keys.part(p))
        index.write(
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
