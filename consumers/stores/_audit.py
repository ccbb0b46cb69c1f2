"""The audit projection: who did what and when, per run (the fold: ``projections/audit``),
stored as an append-only list of entries per run."""

from __future__ import annotations

from typing import Any

from runlog.consumers._store import Batch, Decoded, Handler, Projection, Rejected, dumps
from runlog.projections import _audit as audit
from runlog.projections._run_state import RunState, Step

NAME = "audit"


class AuditHandler(Handler[audit.AuditRun]):
    name = NAME

    def empty(self) -> audit.AuditRun:
        return audit.AuditRun()

    def validator(self, state: audit.AuditRun) -> RunState:
        return state.validator

    def share(self, state: audit.AuditRun, validator: RunState) -> None:
        state.validator = validator

    def own(self, state: audit.AuditRun) -> dict[str, Any]:
        # Only once a run has a decision: the views of other runs stay as they were.
        return {"decided_at": dict(sorted(state.decided_at.items()))} if state.decided_at else {}

    def restore(self, own: dict[str, Any], validator: RunState) -> audit.AuditRun:
        return audit.AuditRun(validator=validator, decided_at=dict(own.get("decided_at", {})))

    def _entries(self, batch: Batch[audit.AuditRun], run_id: str) -> list[audit.Entry]:
        per_run: dict[str, list[audit.Entry]] = batch.extra.setdefault("entries", {})
        return per_run.setdefault(run_id, [])

    def on_step(
        self, batch: Batch[audit.AuditRun], state: audit.AuditRun, rec: Decoded, step: Step
    ) -> None:
        found = audit.entries(
            state.validator, rec.event, step, rec.partition, rec.offset, state.decided_at
        )
        if found:
            self._entries(batch, rec.event.run_id).extend(found)

    def on_rejected(
        self, batch: Batch[audit.AuditRun], state: audit.AuditRun, rec: Rejected
    ) -> None:
        assert rec.run_id is not None
        entry = audit.quarantined_entry(rec.partition, rec.offset, rec.error, rec.message)
        self._entries(batch, rec.run_id).append(entry)

    def purge_keys(self, partition: int, run_id: str) -> list[tuple[str, str]]:
        # The run's own log: every entry (the erasure's own entry has no content field).
        return [*super().purge_keys(partition, run_id), (self.keys.log(partition, run_id), "")]

    def write_run(self, pipe: Any, batch: Batch[audit.AuditRun], run_id: str, state: Any) -> None:
        entries = batch.extra.get("entries", {}).get(run_id, [])
        if entries:
            pipe.rpush(self.keys.log(batch.partition, run_id), *[dumps(e) for e in entries])


PROJECTION = Projection(NAME, fold=audit, handler=AuditHandler)
