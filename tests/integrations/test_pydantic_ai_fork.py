"""What-if on a Pydantic AI agent: a fork at a model turn, another prompt, another model.

The parent is a ``RunlogAgent`` run on the real stack (Pydantic AI's ``FunctionModel``,
offline); its forks are driven by the same agent with another ``FunctionModel`` that
records every message list it is sent. The fork's model must be shown exactly the parent's
conversation up to the fork point (a compaction in the log included) and the new prompt,
and the parent's effects after the fork point are the fork's to inherit, never repeated.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from workers.common import read_log

import runlog
from runlog import aio
from runlog._settings import Settings
from runlog.integrations.pydantic_ai import RunlogAgent, ToolPolicy
from runlog.projections._lineage import logical_of
from runlog.schemas._vocabulary import EventType

PROMPT = "refund orders 7 and 8"


def _flat(messages: list[ModelMessage]) -> list[tuple[Any, ...]]:
    """What a model is shown, part by part, without the timestamps of the execution that
    built it (consecutive requests are one turn of the conversation: their parts in order)."""
    out: list[tuple[Any, ...]] = []
    for msg in messages:
        for p in msg.parts:
            kind = "request" if isinstance(msg, ModelRequest) else "response"
            if isinstance(p, ToolCallPart):
                out.append((kind, "call", p.tool_name, p.args_as_dict(), p.tool_call_id))
            else:
                tool = (getattr(p, "tool_name", None), getattr(p, "tool_call_id", None))
                out.append((kind, type(p).__name__, getattr(p, "content", None), *tool))
    return out


class Recorder:
    """A scripted model that keeps every message list it is sent."""

    def __init__(self, *responses: ModelResponse) -> None:
        self.responses = list(responses)
        self.seen: list[list[ModelMessage]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.seen.append(list(messages))
        return self.responses[len(self.seen) - 1]

    def model(self) -> FunctionModel:
        return FunctionModel(self)


def _call(order: int, call_id: str) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart("refund", {"order": order}, tool_call_id=call_id)])


def _agent(fast: Settings, refunds: list[int], model: FunctionModel) -> RunlogAgent[None, str]:
    agent: Agent[None, str] = Agent(model, name="refunder")

    @agent.tool_plain
    def refund(order: int) -> str:
        refunds.append(order)
        return f"refunded {order}"

    return RunlogAgent(agent, tools={"refund": ToolPolicy("irreversible")}, settings=fast)


def _seq_of(fast: Settings, run_id: str, et: EventType, nth: int = 0) -> int:
    return [r.event.seq for r in read_log(fast, run_id) if r.event.type is et][nth]


def test_a_fork_at_a_model_turn_shows_another_model_the_parents_history_and_the_new_prompt(
    fast: Settings,
) -> None:
    refunds: list[int] = []
    parent_model = Recorder(_call(7, "c1"), _call(8, "c2"), ModelResponse([TextPart("done")]))
    durable = _agent(fast, refunds, parent_model.model())
    parent = asyncio.run(durable.run(PROMPT))
    assert refunds == [7, 8] and len(parent_model.seen) == 3

    # Forked once refund 7's result is in: the parent's model was then shown exactly this.
    at = _seq_of(fast, parent.run_id, EventType.TOOL_CALL_COMPLETED)
    fork = runlog.fork(parent.run_id, at_seq=at, settings=fast)
    # The new model proposes refund 8 again (the parent's action after the fork point: the
    # fork inherits its result) and refund 9 (the fork's own new action).
    other = Recorder(_call(8, "c2"), _call(9, "c3"), ModelResponse([TextPart("8 and 9")]))
    what_if = "refund 8 and 9 instead"
    got = asyncio.run(durable.run(what_if, run_id=fork.run_id, model=other.model()))
    assert got.output == "8 and 9"
    assert _flat(other.seen[0]) == [
        *_flat(parent_model.seen[1]),
        ("request", "UserPromptPart", what_if, None, None),
    ]
    assert refunds == [7, 8, 9]  # 8 was inherited, not refunded again; 9 is new
    resolved = [
        r.event.payload.resolution  # type: ignore[union-attr]
        for r in read_log(fast, fork.run_id)
        if r.event.type is EventType.FORK_EFFECT_RESOLVED
    ]
    assert resolved == ["inherited"]
    assert len(parent_model.seen) == 3  # the parent's model was asked nothing more
    # Each call a fork's MODEL_TURN proposes records a key of the logical action it ran as:
    # the fork's new call 9 its STARTED key's, the inherited call 8 the parent's.
    ran_under: dict[str, str] = {}
    proposed: dict[str, str] = {}
    for r in read_log(fast, fork.run_id):
        p: Any = r.event.payload
        if r.event.type is EventType.TOOL_CALL_STARTED:
            ran_under[p.call_id] = p.idempotency_key
        elif r.event.type is EventType.FORK_EFFECT_RESOLVED:
            ran_under[p.call_id] = p.logical_key
        elif r.event.type is EventType.MODEL_TURN:
            proposed |= {c.call_id: logical_of(c.idempotency_key) for c in p.tool_calls}
    assert set(proposed) == {"c2", "c3"}
    assert proposed == {c: logical_of(k) for c, k in ran_under.items()}

    # Resumed (a worker re-executing it): the fork's turns are replayed, nothing is asked.
    again = asyncio.run(durable.run(run_id=fork.run_id, model=other.model()))
    assert again.output == "8 and 9" and again.requested_turns == 0
    assert refunds == [7, 8, 9] and len(other.seen) == 3


def test_a_fork_of_a_compacted_conversation_is_shown_the_compaction(fast: Settings) -> None:
    """The parent's log holds a compaction before the fork point: the fork's model is shown
    the conversation as the log has it then (the first message, the summary, the kept
    tail), then the new prompt; a fork without a new prompt goes on from the history."""
    refunds: list[int] = []
    parent_model = Recorder(_call(7, "c1"), ModelResponse([TextPart("refunded 7")]))
    durable = _agent(fast, refunds, parent_model.model())
    parent = asyncio.run(durable.run(PROMPT))
    # The parent's conversation, compacted: a fork of it at its last turn, compacted in its
    # log (what an agent's compaction step records), then forked at the compaction.
    last_turn = _seq_of(fast, parent.run_id, EventType.MODEL_TURN, 1)
    first = runlog.fork(parent.run_id, at_seq=last_turn, settings=fast)

    async def compact() -> int:
        async with aio.open_run(first.run_id, settings=fast) as run:
            run.emit(
                EventType.CONTEXT_COMPACTED, summary="refunded order 7", kept_turns=1, dropped=0
            )
            await run.barrier()
            return run.state.seq

    at = asyncio.run(compact())
    fork = runlog.fork(first.run_id, at_seq=at, settings=fast)
    other = Recorder(ModelResponse([TextPart("nothing else to refund")]))
    asyncio.run(durable.run("anything else?", run_id=fork.run_id, model=other.model()))
    assert _flat(other.seen[0]) == [
        ("request", "UserPromptPart", PROMPT, None, None),
        ("request", "UserPromptPart", "refunded order 7", None, None),
        ("response", "TextPart", "refunded 7", None, None),
        ("request", "UserPromptPart", "anything else?", None, None),
    ]
    assert refunds == [7]

    # No new prompt: the fork at the parent's first turn runs that turn's call (the
    # parent's: inherited) and asks its model from there.
    at_first = _seq_of(fast, parent.run_id, EventType.MODEL_TURN)
    plain = runlog.fork(parent.run_id, at_seq=at_first, settings=fast)
    third = Recorder(ModelResponse([TextPart("as before")]))
    got = asyncio.run(durable.run(run_id=plain.run_id, model=third.model()))
    assert got.output == "as before" and refunds == [7]
    assert _flat(third.seen[0]) == _flat(parent_model.seen[1])


def test_a_fork_through_the_capability_shows_its_model_the_parents_history(
    fast: Settings,
) -> None:
    """``Agent(capabilities=[RunlogDurability()])``: ``agent.run(prompt, run_id=FORK,
    model=...)`` goes on from the parent's conversation at the fork point (the model is
    shown it before the agent's own messages) and repeats none of the parent's refunds."""
    import uuid

    from runlog.integrations.pydantic_ai_capability import RunlogDurability

    refunds: list[int] = []
    parent_model = Recorder(_call(7, "c1"), _call(8, "c2"), ModelResponse([TextPart("done")]))
    cap = RunlogDurability(tools={"refund": ToolPolicy("irreversible")}, settings=fast)
    agent: Agent[None, str] = Agent(parent_model.model(), capabilities=[cap], name="refunder")

    @agent.tool_plain
    def refund(order: int) -> str:
        refunds.append(order)
        return f"refunded {order}"

    rid = f"pcap-{uuid.uuid4().hex[:12]}"
    assert asyncio.run(agent.run(PROMPT, run_id=rid)).output == "done"
    at = _seq_of(fast, rid, EventType.TOOL_CALL_COMPLETED)
    fork = runlog.fork(rid, at_seq=at, settings=fast)
    other = Recorder(_call(8, "c2"), ModelResponse([TextPart("only 8")]))
    got = asyncio.run(agent.run("just 8", run_id=fork.run_id, model=other.model()))
    assert got.output == "only 8"
    assert _flat(other.seen[0]) == [
        *_flat(parent_model.seen[1]),
        ("request", "UserPromptPart", "just 8", None, None),
    ]
    assert refunds == [7, 8]  # 8 inherited from the parent, not refunded again
    # Resumed with the same prompt: replayed, nothing asked, nothing refunded.
    again = asyncio.run(agent.run("just 8", run_id=fork.run_id, model=other.model()))
    assert again.output == "only 8" and len(other.seen) == 2 and refunds == [7, 8]
