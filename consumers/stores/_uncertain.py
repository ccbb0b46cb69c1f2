"""The uncertain-calls projection: the queue of calls whose outcome is unknown, their
reconciliation and escalation (the fold: ``projections/uncertain``), stored as one hash
of open calls per partition and its counters."""

from __future__ import annotations

import json
from typing import Any

import redis

from runlog.consumers._store import SEP, Batch, Decoded, Handler, Projection, dumps
from runlog.projections import _uncertain as uncertain
from runlog.projections._run_state import RunState, Step

NAME = "uncertain"


class UncertainHandler(Handler[uncertain.UncertainRun]):
    """The open uncertain calls live in the partition's ``open`` hash (the queue the
    queries read); a run's tracked calls are loaded back from it."""

    name = NAME

    def empty(self) -> uncertain.UncertainRun:
        return uncertain.UncertainRun()

    def validator(self, state: uncertain.UncertainRun) -> RunState:
        return state.validator

    def share(self, state: uncertain.UncertainRun, validator: RunState) -> None:
        state.validator = validator

    def own(self, state: uncertain.UncertainRun) -> dict[str, Any]:
        return {"counters": dict(state.counters)}

    def restore(self, own: dict[str, Any], validator: RunState) -> uncertain.UncertainRun:
        run = uncertain.UncertainRun(validator=validator)
        run.counters.update(own.get("counters", {}))
        return run

    def load_runs(
        self, client: redis.Redis, partition: int, run_ids: list[str]
    ) -> dict[str, tuple[uncertain.UncertainRun, int]]:
        out = super().load_runs(client, partition, run_ids)
        # Tracked calls are open calls of the run state: ask the queue for exactly those.
        wanted = [
            (rid, key) for rid, (run, _) in out.items() for key in sorted(run.validator.open_calls)
        ]
        if wanted:
            raws = client.hmget(self.keys.open(partition), [f"{r}{SEP}{k}" for r, k in wanted])
            for (rid, key), raw in zip(wanted, raws, strict=True):
                if raw is not None:
                    out[rid][0].calls[key] = uncertain.UncertainCall(**json.loads(raw))
        return out

    def on_step(
        self,
        batch: Batch[uncertain.UncertainRun],
        state: uncertain.UncertainRun,
        rec: Decoded,
        step: Step,
    ) -> None:
        changed: dict[str, set[str]] = batch.extra.setdefault("changed", {})
        ev = rec.event
        delta = uncertain.apply_step(
            state, state.validator, ev, step, changed.setdefault(ev.run_id, set())
        )
        totals: dict[str, int] = batch.extra.setdefault("counters", {})
        for name, n in delta.items():
            totals[name] = totals.get(name, 0) + n

    def write_run(
        self, pipe: Any, batch: Batch[uncertain.UncertainRun], run_id: str, state: Any
    ) -> None:
        # Only the calls this batch's events touched: the others are already in Redis.
        changed = batch.extra.get("changed", {}).get(run_id, set())
        key = self.keys.open(batch.partition)
        gone = sorted(f"{run_id}{SEP}{k}" for k in changed if k not in state.calls)
        if gone:
            pipe.hdel(key, *gone)
        kept = {
            f"{run_id}{SEP}{k}": dumps(state.calls[k].to_dict())
            for k in sorted(changed)
            if k in state.calls
        }
        if kept:
            pipe.hset(key, mapping=kept)

    def purge_keys(self, partition: int, run_id: str) -> list[tuple[str, str]]:
        # The queue's entries of the run (an erased run's open calls stay open, scrubbed).
        return [*super().purge_keys(partition, run_id), (self.keys.open(partition), run_id)]

    def write_batch(self, pipe: Any, batch: Batch[uncertain.UncertainRun]) -> None:
        for name, n in sorted(batch.extra.get("counters", {}).items()):
            if n:
                pipe.hincrby(self.keys.counters(batch.partition), name, n)


PROJECTION = Projection(NAME, fold=uncertain, handler=UncertainHandler)
