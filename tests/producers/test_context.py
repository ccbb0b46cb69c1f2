"""``runlog.current_call()``: the call a tool is executing, for code deeper down.

``runlog.producers._context``: None outside a tool invocation, the call's context inside
``call_context(ctx)``, restored when the block ends however it ends; ``fencing_token`` is the
epoch (docs/concepts/guarantees.md, docs/reference/api.md).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

import runlog
from runlog.producers._context import CallContext, call_context, current_call


def _ctx(key: str = "k2_a", epoch: int = 3) -> CallContext:
    return CallContext(
        run_id="run-1",
        tenant="acme",
        epoch=epoch,
        idempotency_key=key,
        attempt=1,
        started_seq=7,
        commit_deadline=datetime(2030, 1, 1, tzinfo=UTC),
    )


def test_the_call_is_known_inside_its_block_only() -> None:
    assert runlog.current_call is current_call  # the public name is this one
    assert current_call() is None  # outside a tool invocation
    ctx = _ctx()
    with call_context(ctx) as entered:
        assert entered is ctx
        assert current_call() is ctx
    assert current_call() is None


def test_the_fencing_token_is_the_epoch_and_a_reconcilers_context_has_no_deadline() -> None:
    ctx = _ctx(epoch=42)
    assert ctx.fencing_token == 42
    asked = CallContext("run-1", "acme", 43, "k2_a", 1, 7)  # recovery's lookup: no deadline
    assert asked.commit_deadline is None and asked.fencing_token == 43


def test_a_nested_call_restores_the_outer_one_even_when_it_raises() -> None:
    outer, inner = _ctx("k2_outer"), _ctx("k2_inner")
    with call_context(outer):
        with pytest.raises(RuntimeError), call_context(inner):
            assert current_call() is inner
            raise RuntimeError("the tool failed")
        assert current_call() is outer
    assert current_call() is None


def test_concurrent_tool_calls_each_see_their_own_call() -> None:
    """The async driver runs the tools of several runs in one event loop."""

    async def tool(ctx: CallContext) -> list[str | None]:
        seen = []
        with call_context(ctx):
            for _ in range(3):
                await asyncio.sleep(0)  # the other task runs here
                c = current_call()
                seen.append(c.idempotency_key if c else None)
        return seen

    async def both() -> list[list[str | None]]:
        return list(await asyncio.gather(tool(_ctx("k2_a")), tool(_ctx("k2_b"))))

    assert asyncio.run(both()) == [["k2_a"] * 3, ["k2_b"] * 3]
