"""Group commit across the runs of one event loop: the barriers that reach their ownership
check in the same tick share one Redis round trip, and each run still answers for itself.

Many runs are released from one barrier with their appends acknowledged: one of them was
taken over meanwhile (a real new owner's claim) and only it is refused, before the effect
its next call would have had; a batch whose Redis check cannot be made refuses every run
in it; a batch whose appends the broker never acknowledges tells every run its outcome is
unknown. Everything runs against the real Kafka and Redis; the ledger and the log are read
back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest
from workers.common import Ledger, read_log

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import AppendOutcomeUnknown
from runlog.log import _clients as clients
from runlog.log._clients import async_redis_client
from runlog.producers._async_run import AsyncRun, open_async
from runlog.producers._handle import engine_of
from runlog.producers._writer import EventWriter
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)

RUNS = 12


def _pay(ledger: Ledger) -> runlog.Tool:
    async def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return "paid"

    return runlog.tool("pay", risk="irreversible")(pay)


def _count_sends(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every command the loop's pipelined Redis connections write (Redis is real)."""
    sent: list[bytes] = []
    original = clients._Replies.send

    def send(self: clients._Replies, packed: bytes) -> asyncio.Future[Any]:
        sent.append(packed)
        return original(self, packed)

    monkeypatch.setattr(clients._Replies, "send", send)
    return sent


async def _at_one_barrier(runs: list[AsyncRun]) -> list[BaseException | None]:
    """Each run emits one record, the writer has them all acknowledged, then every run's
    barrier is released at once (in one tick of the loop)."""
    for i, r in enumerate(runs):
        r.emit(EventType.USER_MESSAGE, content=f"step {i}")
    engine_of(runs[0]).deps.writer.flush(10)
    return await asyncio.gather(*(r.barrier() for r in runs), return_exceptions=True)


def test_runs_at_one_barrier_share_one_redis_check_and_only_the_fenced_one_is_refused(
    fast: Settings, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = [_pay(ledger)]

    async def main() -> tuple[list[str], str]:
        runs = await asyncio.gather(
            *(runlog.aio.open_run(tools=tools, settings=fast) for _ in range(RUNS))
        )
        victim = runs[RUNS // 2]
        # A new owner claims one of them: its lease is another's from now on.
        usurper = await runlog.aio.open_run(victim.run_id, settings=fast, takeover=True)
        sent = _count_sends(monkeypatch)
        outcomes = await _at_one_barrier(runs)
        checks = len(sent)
        for r, out in zip(runs, outcomes, strict=True):
            if r is victim:
                assert isinstance(out, runlog.Fenced), f"the fenced run passed: {out!r}"
            else:
                assert out is None, f"{r.run_id} refused: {out!r}"
        assert checks == 1, f"{RUNS} barriers of one tick made {checks} Redis round trips"
        # The fenced run is refused before its irreversible call's effect; the others pay.
        with pytest.raises(runlog.Fenced):
            await victim.call_tool("pay", {"to": victim.run_id})
        paid = await asyncio.gather(
            *(r.call_tool("pay", {"to": r.run_id}) for r in runs if r is not victim)
        )
        assert paid == ["paid"] * (RUNS - 1)
        await asyncio.gather(*(r.finish("succeeded") for r in runs if r is not victim))
        await victim.close()
        await usurper.close()
        return [r.run_id for r in runs], victim.run_id

    run_ids, victim_id = asyncio.run(main())
    applied = {json.loads(v)["to"] for v in ledger.redis.hvals(ledger.args)}
    assert applied == set(run_ids) - {victim_id}, "a fenced run's effect happened"
    assert sorted(ledger.per_key().values()) == [1] * (RUNS - 1)
    # The victim's record is in the log before the new owner's claim: not valid there.
    victim_log = [rec.event for rec in read_log(fast, victim_id)]
    assert EventType.TOOL_CALL_STARTED not in {e.type for e in victim_log}


def test_a_batch_whose_redis_check_fails_refuses_every_run_in_it(
    fast: Settings, ledger: Ledger
) -> None:
    """The batch's one command cannot reach Redis: every run in it is fenced, none runs its
    tool (a failure of the shared check is every run's)."""
    unreachable = fast.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    deps = Services.shared(fast).run_deps()

    async def main() -> None:
        dead = async_redis_client(unreachable)
        runs = [
            await open_async(deps, dead, None, tools=[_pay(ledger)], recover=False)
            for _ in range(4)
        ]
        outcomes = await asyncio.gather(
            *(r.call_tool("pay", {"to": r.run_id}) for r in runs), return_exceptions=True
        )
        assert all(isinstance(o, runlog.Fenced) for o in outcomes), outcomes
        for r in runs:
            await r.close()
        await dead.aclose()

    asyncio.run(main())
    assert ledger.per_key() == {}, "an effect ran though ownership was never confirmed"


def test_a_batch_the_broker_never_acknowledges_tells_every_run_the_outcome_is_unknown(
    fast: Settings, ledger: Ledger
) -> None:
    """The runs' appends go to a producer whose broker is unreachable: none is acknowledged
    within the delivery timeout, so each run's barrier raises ``AppendOutcomeUnknown`` (its
    record may or may not be written) and no run runs its tool."""
    dead = EventWriter(
        fast.model_copy(update={"bootstrap_servers": "127.0.0.1:1", "delivery_timeout_ms": 1000})
    )
    tools = [_pay(ledger)]

    async def main() -> None:
        runs = await asyncio.gather(
            *(runlog.aio.open_run(tools=tools, settings=fast) for _ in range(4))
        )
        for r in runs:
            engine = engine_of(r)
            engine.deps = dataclasses.replace(engine.deps, writer=dead)
        outcomes = await asyncio.gather(
            *(r.call_tool("pay", {"to": r.run_id}) for r in runs), return_exceptions=True
        )
        assert all(isinstance(o, AppendOutcomeUnknown) for o in outcomes), outcomes
        for r in runs:
            await r.close()

    try:
        asyncio.run(main())
    finally:
        dead.close(timeout=1)
    assert ledger.per_key() == {}, "an effect ran though its STARTED was never acknowledged"
