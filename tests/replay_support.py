"""Helpers for the replay, snapshot and evolution tests: fixtures and synthetic logs."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from codec_support import make_event

from runlog._settings import Settings
from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._signing import DecisionAuthority, load_authority
from runlog.schemas._vocabulary import EventType

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_VERSIONS = sorted(p.name for p in FIXTURES.iterdir() if (p / "log.jsonl").exists())


@dataclass(frozen=True)
class FixtureRecord:
    key: bytes
    value: bytes
    headers: list[tuple[str, str | bytes | None]]
    seq: int
    epoch: int
    type: str
    schema_version: int


@dataclass(frozen=True)
class Fixture:
    version: str
    run_id: str
    tenant: str
    records: list[FixtureRecord]
    states: dict[int, dict[str, Any]]
    meta: dict[str, Any]
    deciders: Path | None = None
    """The decider keys its writer trusted (from v4): ``states`` is the fold under them."""

    @property
    def authority(self) -> DecisionAuthority:
        return load_authority(self.deciders)

    def settings(self, base: Settings) -> Settings:
        """``base`` trusting the fixture's decider keys, as its writer did."""
        if self.deciders is None:
            return base
        return base.model_copy(update={"decider_public_keys": str(self.deciders)})

    def events(self) -> list[Event]:
        """Decoded with the CURRENT code (upcasters and Avro resolution included)."""
        return [codec.decode(r.value) for r in self.records]


def load_fixture(version: str) -> Fixture:
    d = FIXTURES / version
    records = []
    for line in (d / "log.jsonl").read_text().splitlines():
        r = json.loads(line)
        records.append(
            FixtureRecord(
                key=r["key"].encode(),
                value=base64.b64decode(r["value_b64"]),
                headers=[(k, base64.b64decode(v)) for k, v in r["headers"]],
                seq=r["seq"],
                epoch=r["epoch"],
                type=r["type"],
                schema_version=r["schema_version"],
            )
        )
    states = json.loads((d / "states.json").read_text())
    return Fixture(
        version=version,
        run_id=states["run_id"],
        tenant=states["tenant"],
        records=records,
        states={int(k): v for k, v in states["states"].items()},
        meta=json.loads((d / "meta.json").read_text()),
        deciders=d / "deciders.pub" if (d / "deciders.pub").exists() else None,
    )


# --------------------------------------------------------------------------- synthetic logs

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class LogBuilder:
    """Builds a plausible event log of one run, including takeovers and fenced writes.

    ``step(op)`` appends what ``op`` names; the builder tracks the writer's view (seq,
    epoch, open calls) so valid events stay valid and fenced ones are fenced on purpose.
    """

    run_id: str = "r-synthetic"
    tenant: str = "t"
    seq: int = 0
    epoch: int = 1
    events: list[Event] = field(default_factory=list)
    open_keys: list[tuple[str, int]] = field(default_factory=list)
    approvals: list[str] = field(default_factory=list)
    n: int = 0
    finished: bool = False

    def _ev(self, et: EventType, payload: dict[str, Any], *, seq: int, epoch: int) -> Event:
        self.n += 1
        return make_event(
            et,
            payload,
            run_id=self.run_id,
            seq=seq,
            epoch=epoch,
            tenant=self.tenant,
            event_id=f"e{self.n}",
            occurred_at=T0 + timedelta(milliseconds=self.n),
        )

    def add(self, et: EventType, **payload: Any) -> Event:
        self.seq += 1
        ev = self._ev(et, payload, seq=self.seq, epoch=self.epoch)
        self.events.append(ev)
        return ev

    def start(self) -> LogBuilder:
        self.add(EventType.RUN_STARTED, agent="a", goal="g")
        return self

    def step(self, op: str, rnd: random.Random) -> None:
        if self.finished:
            op = "fenced_stale"
        if op == "user":
            self.add(EventType.USER_MESSAGE, content=f"u{self.n}")
        elif op == "turn":
            self.add(
                EventType.MODEL_TURN,
                text=f"m{self.n}",
                usage={"input_tokens": rnd.randint(0, 99), "output_tokens": 3},
                cost_usd=0.25,
            )
        elif op == "call":
            key = f"k{self.n}"
            started = self.add(
                EventType.TOOL_CALL_STARTED,
                call_id=f"c{self.n}",
                name="t",
                args_json="{}",
                idempotency_key=key,
                attempt=rnd.randint(1, 2),
            )
            self.open_keys.append((key, started.seq))
        elif op == "complete" and self.open_keys:
            key, sseq = self.open_keys.pop(rnd.randrange(len(self.open_keys)))
            ok = rnd.random() < 0.8
            self.add(
                EventType.TOOL_CALL_COMPLETED,
                call_id="c",
                name="t",
                started_seq=sseq,
                content=f"r{self.n}",
                is_error=not ok,
                idempotency_key=key if ok else None,
                duration_ms=rnd.choice([None, 5]),
            )
        elif op == "uncertain" and self.open_keys:
            key, sseq = rnd.choice(self.open_keys)
            self.add(
                EventType.TOOL_CALL_UNCERTAIN,
                started_seq=sseq,
                call_id="c",
                name="t",
                idempotency_key=key,
                error="TimeoutError",
                detected_by="live",
            )
            self.add(
                EventType.RECONCILIATION_ATTEMPTED,
                started_seq=sseq,
                idempotency_key=key,
                name="t",
                outcome=rnd.choice(["unavailable", "conflict", "absent"]),
                rule="r",
                action=rnd.choice(["keep_uncertain", "escalate", "retry"]),
            )
        elif op == "compact":
            if rnd.random() < 0.5:
                self.add(EventType.CONTEXT_COMPACTED, summary=f"s{self.n}", kept=rnd.randint(0, 4))
            else:
                self.add(
                    EventType.CONTEXT_COMPACTED,
                    summary=f"s{self.n}",
                    kept_turns=rnd.randint(0, 3),
                )
        elif op == "approval":
            aid = f"ap{self.n}"
            ref: str | None = None
            if self.open_keys and rnd.random() < 0.5:
                ref = self.open_keys[0][0]
            self.add(
                EventType.APPROVAL_REQUESTED,
                approval_id=aid,
                kind=rnd.choice(["action", "conflict", "uncertain_call"]),
                reason="r",
                idempotency_key=ref,
            )
            self.approvals.append(aid)
        elif op == "decide" and self.approvals:
            self.add(
                EventType.APPROVAL_DECIDED,
                approval_id=self.approvals.pop(0),
                approved=rnd.random() < 0.5,
                decided_by="p",
            )
        elif op == "record_only":
            if rnd.random() < 0.5:
                self.add(EventType.MEMORY_WRITTEN, key="k", value="v")
            else:
                self.add(EventType.GUARDRAIL_TRIGGERED, guardrail="g", severity="s", action="a")
        elif op == "takeover":
            prev, self.epoch = self.epoch, self.epoch + rnd.randint(1, 2)
            self.add(EventType.RUN_RESUMED, previous_epoch=prev, expected_prev_seq=self.seq)
        elif op == "fenced_stale" and self.epoch > 1:
            # A paused former owner's late write: stale epoch, a seq already taken.
            dup = rnd.randint(max(1, self.seq - 2), self.seq)
            ev = self._ev(EventType.USER_MESSAGE, {"content": "late"}, seq=dup, epoch=1)
            self.events.append(ev)
        elif op == "fenced_claim":
            # A would-be owner that claimed on an outdated view (wrong expected seq).
            ev = self._ev(
                EventType.RUN_RESUMED,
                {"previous_epoch": self.epoch, "expected_prev_seq": max(0, self.seq - 1)},
                seq=self.seq,
                epoch=self.epoch + 10,
            )
            self.events.append(ev)
        elif op == "finish":
            self.add(EventType.RUN_FINISHED, outcome="done")
            self.finished = True


OPS = (
    "user",
    "turn",
    "call",
    "complete",
    "uncertain",
    "compact",
    "approval",
    "decide",
    "record_only",
    "takeover",
    "fenced_stale",
    "fenced_claim",
    "finish",
)


def synthetic_log(ops: list[str], seed: int = 0, run_id: str = "r-synthetic") -> list[Event]:
    rnd = random.Random(seed)
    b = LogBuilder(run_id=run_id).start()
    for op in ops:
        b.step(op, rnd)
    return b.events
