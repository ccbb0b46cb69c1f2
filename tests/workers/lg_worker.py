"""A LangGraph graph on runlog, run in its own process so a test can SIGKILL it.

The graph is LangGraph's tool-calling loop: an agent node answering from a scripted fake chat
model (LangChain's ``FakeMessagesListChatModel``, no network), ``tools_condition``, and
``RunlogToolNode``; ``RunlogSaver`` is its checkpointer. The tool ``transfer`` is an effect on a
receiver that does not deduplicate: every request it gets moves money (a Redis counter per
amount), and it keeps a ledger by idempotency key that the tool's ``reconcile`` looks up.
It is fenced: it refuses a request whose token is below the highest it has seen for the
key, and the lookup raises that floor to the asking owner's token before it answers.

The worker holds at the transfer of ``--hold-amount``: it writes the flag ``at-<amount>``
and waits ``--hold-s`` (the test's window to kill it), right after the effect landed and
before its completion is recorded (``--hold-at after``), or once the tool was called (its
STARTED durable) and before the effect (``--hold-at before``). It writes ``result`` with
the final answer when the graph ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

import redis  # noqa: E402
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import tools_condition  # noqa: E402

import runlog  # noqa: E402
from runlog.integrations.langgraph import RunlogSaver, RunlogToolNode  # noqa: E402
from runlog.settings import Settings  # noqa: E402
from workers.common import fenced_effect, raise_floor  # noqa: E402

EXIT_ESCALATED = 5


def _call(i: int, amount: int) -> dict[str, Any]:
    return {"name": "transfer", "args": {"amount": amount}, "id": f"call-{i}"}


SCRIPT: list[AIMessage] = [
    AIMessage(content="", tool_calls=[_call(0, 1)]),
    AIMessage(content="", tool_calls=[_call(1, 2), _call(2, 3)]),
    AIMessage(content="done: moved 6"),
]
AMOUNTS = (1, 2, 3)


def effects_key(prefix: str, amount: int) -> str:
    return f"{prefix}lg:effects:{amount}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--thread", required=True)
    ap.add_argument("--hold-s", type=float, default=0.0)
    ap.add_argument("--hold-at", choices=("before", "after"), default="after")
    ap.add_argument("--hold-amount", type=int, default=0, help="hold only at this transfer")
    ap.add_argument("--takeover", action="store_true")
    ap.add_argument("--no-reconcile", action="store_true", help="transfer has no lookup")
    a = ap.parse_args()
    settings = Settings()
    flags = Path(a.dir)
    prefix = settings.redis_key_prefix
    r = redis.Redis.from_url(settings.redis_url)
    ledger = f"{prefix}lg:ledger"
    floors = f"{prefix}lg:floors"

    def transfer(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
        amount = int(args["amount"])
        result = f"moved {amount}"
        hold = amount == a.hold_amount
        if hold and a.hold_at == "before":
            (flags / f"{a.name}.at-{amount}").write_text(idempotency_key)
            time.sleep(a.hold_s)
        landed = fenced_effect(  # the receiver's effect and its ledger entry, fenced
            r,
            floors,
            idempotency_key,
            fencing_token,
            counter=effects_key(prefix, amount),
            by_key=False,
            results=ledger,
            result=result,
        )
        if not landed:
            raise runlog.ToolError(f"refused {idempotency_key}: a newer owner holds the run")
        (flags / f"{a.name}.ran-{amount}").write_text(idempotency_key)  # every effect
        if hold and a.hold_at == "after":
            (flags / f"{a.name}.at-{amount}").write_text(idempotency_key)
            time.sleep(a.hold_s)
        return result

    def lookup(
        args: dict[str, Any], *, idempotency_key: str, fencing_token: int
    ) -> runlog.Match | runlog.Absent:
        raise_floor(r, floors, idempotency_key, fencing_token)
        got = r.hget(ledger, idempotency_key)
        return runlog.Match(got.decode()) if got is not None else runlog.Absent("no entry")

    reconcile = None if a.no_reconcile else lookup
    tool = runlog.tool("transfer", risk="irreversible", reconcile=reconcile, receiver="fenced")(
        transfer
    )

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        turn = sum(isinstance(m, AIMessage) for m in state["messages"])
        model = FakeMessagesListChatModel(responses=[SCRIPT[turn]])
        return {"messages": [model.invoke(state["messages"])]}

    saver = RunlogSaver(settings=settings, takeover=a.takeover)
    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", RunlogToolNode([tool], saver))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": a.thread}}
    with saver:
        started = saver.get_tuple(config) is not None
        try:
            state = graph.invoke(
                None if started else {"messages": [HumanMessage("move 1, then 2 and 3")]},
                config,
                durability="sync",
            )
        except runlog.Escalated as exc:  # an uncertain effect waits for a person
            (flags / f"{a.name}.result").write_text(json.dumps({"escalated": str(exc)}))
            return EXIT_ESCALATED
    final = state["messages"][-1]
    (flags / f"{a.name}.result").write_text(json.dumps({"answer": final.content}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
