"""Synthetic, valid-by-construction run logs for benchmarks and tests of the projections.

Writes events straight to the events topic with one idempotent producer (no leases, no
read-back): it exercises the consumers, not the writer path. Every run starts, talks,
calls tools, and some are resumed by a new epoch, receive a stale write from the old
epoch (a fenced write), compact, and finish. Deterministic for a given seed.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from confluent_kafka import Producer

from runlog._settings import Settings
from runlog.errors import KafkaUnavailable
from runlog.schemas import _codec as codec
from runlog.schemas._vocabulary import EventType


@dataclass
class _Run:
    run_id: str
    seq: int = 0
    epoch: int = 1
    turn: int = 0
    open_keys: list[tuple[str, int, str]] = field(default_factory=list)
    finished: bool = False


class LoadGenerator:
    def __init__(
        self,
        settings: Settings,
        *,
        seed: int = 1,
        tenant: str = "load",
        on_ack: Callable[[int, int], None] | None = None,
    ) -> None:
        conf = dict(settings.kafka_common())
        conf.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "partitioner": "murmur2_random",
            }
        )
        self.settings = settings
        self.topic = settings.events_topic
        self.tenant = tenant
        self.rng = random.Random(seed)
        self._producer = Producer(conf)
        self._errors: list[str] = []
        self._clock = datetime(2025, 1, 1, tzinfo=UTC)
        self.sent = 0
        self._on_ack = on_ack
        """Called with (partition, offset) of each acknowledged record (lag benchmarks)."""

    def _now(self) -> datetime:
        self._clock += timedelta(milliseconds=self.rng.randint(1, 50))
        return self._clock

    def _send(
        self,
        run: _Run,
        et: EventType,
        payload: dict[str, Any],
        *,
        epoch: int | None = None,
        seq: int | None = None,
    ) -> None:
        ev = codec.build_event(
            et,
            payload,
            event_id=uuid.uuid4().hex,
            run_id=run.run_id,
            tenant=self.tenant,
            seq=seq if seq is not None else run.seq + 1,
            epoch=epoch if epoch is not None else run.epoch,
            occurred_at=self._now(),
            writer_id=f"loadgen-{run.epoch if epoch is None else epoch}",
        )
        if seq is None:
            run.seq += 1

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None:
                self._errors.append(str(err))
            elif self._on_ack is not None:
                self._on_ack(msg.partition(), msg.offset())

        while True:
            try:
                self._producer.produce(
                    self.topic,
                    key=run.run_id.encode(),
                    value=codec.encode(ev),
                    headers=codec.headers(ev),
                    on_delivery=on_delivery,
                )
                break
            except BufferError:
                self._producer.poll(0.05)
        self._producer.poll(0)
        self.sent += 1

    def new_run(self) -> _Run:
        run = _Run(run_id=f"load-{uuid.uuid4().hex[:12]}")
        self._send(run, EventType.RUN_STARTED, {"agent": "loadgen", "goal": "g"})
        return run

    def step(self, run: _Run) -> None:
        """Append one plausible next event (sometimes two: a takeover and a stale write)."""
        r = self.rng.random()
        if run.open_keys and r < 0.4:
            key, started, name = run.open_keys.pop()
            self._send(
                run,
                EventType.TOOL_CALL_COMPLETED,
                {
                    "call_id": key[:8],
                    "name": name,
                    "started_seq": started,
                    "content": "ok",
                    "idempotency_key": key,
                },
            )
        elif r < 0.55:
            key = uuid.uuid4().hex
            self._send(
                run,
                EventType.TOOL_CALL_STARTED,
                {
                    "call_id": key[:8],
                    "name": "charge",
                    "args_json": '{"a":1}',
                    "idempotency_key": key,
                    "risk": self.rng.choice(["safe", "irreversible"]),
                },
            )
            run.open_keys.append((key, run.seq, "charge"))
        elif r < 0.6:
            old = run.epoch
            run.epoch += 1
            self._send(
                run,
                EventType.RUN_RESUMED,
                {"previous_epoch": old, "expected_prev_seq": run.seq, "gap_ms": 1234},
            )
            run.open_keys.clear()
            # The old owner's late append: fenced by the rule, kept in the log.
            self._send(
                run, EventType.USER_MESSAGE, {"content": "stale"}, epoch=old, seq=run.seq + 1
            )
        elif r < 0.63:
            self._send(
                run, EventType.CONTEXT_COMPACTED, {"summary": "s", "kept_turns": 2, "dropped": 3}
            )
        elif r < 0.66:
            self._send(
                run,
                EventType.GUARDRAIL_TRIGGERED,
                {"guardrail": "pii", "severity": "low", "action": "redact"},
            )
        elif r < 0.8:
            self._send(run, EventType.USER_MESSAGE, {"content": "hello " * 5})
        else:
            run.turn += 1
            self._send(
                run,
                EventType.MODEL_TURN,
                {
                    "text": "thinking",
                    "usage": {"input_tokens": 100, "output_tokens": 20},
                    "cost_usd": 0.001,
                },
            )

    def finish(self, run: _Run) -> None:
        self._send(run, EventType.RUN_FINISHED, {"outcome": "done"})
        run.finished = True

    def generate(self, runs: int, events_per_run: int) -> list[str]:
        """``runs`` runs of about ``events_per_run`` events each, interleaved; flushed."""
        live = [self.new_run() for _ in range(runs)]
        for _ in range(events_per_run - 2):
            for run in live:
                self.step(run)
        for run in live:
            self.finish(run)
        self.flush()
        return [r.run_id for r in live]

    def steady(
        self,
        rate_per_s: float,
        duration_s: float,
        runs: int = 50,
        stop: threading.Event | None = None,
    ) -> int:
        """Append at about ``rate_per_s`` events/s for ``duration_s`` or until ``stop`` is set;
        returns events sent."""
        live = [self.new_run() for _ in range(runs)]
        start = time.monotonic()
        sent0 = self.sent
        while (elapsed := time.monotonic() - start) < duration_s and not (stop and stop.is_set()):
            due = int(elapsed * rate_per_s) - (self.sent - sent0)
            for _ in range(max(0, due)):
                self.step(self.rng.choice(live))
            time.sleep(0.005)
        self.flush()
        return self.sent - sent0

    def flush(self) -> None:
        left = self._producer.flush(30)
        if left or self._errors:
            raise KafkaUnavailable(f"loadgen: {left} unacknowledged, errors {self._errors[:3]}")


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.loadgen [--runs N --events M | --rate R --duration S]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.loadgen", description=__doc__)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--events", type=int, default=50, help="events per run (batch mode)")
    parser.add_argument("--rate", type=float, default=None, help="events/s (steady mode)")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    gen = LoadGenerator(Settings(), seed=args.seed)
    started = time.monotonic()
    if args.rate is None:
        gen.generate(args.runs, args.events)
    else:
        gen.steady(args.rate, args.duration, runs=args.runs)
    took = time.monotonic() - started
    print(f"sent {gen.sent} events in {took:.1f}s ({gen.sent / took:.0f}/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
