"""Declaring tools: what a tool's function and its reconciler are passed, its inverse, refusals.

``runlog.producers._tools`` (docs/reference/api.md, ``runlog.tool``): the fence's arguments
(``fencing_token``, ``commit_deadline``) go only to a function that names them, a reconciler
gets the asking owner's token only if it names it, a reversible tool's ``compensate`` becomes
the irreversible tool ``<name>/compensate``, and a declaration runlog cannot honour or a
reserved name is refused when the tool is made. The receiver and commit-window refusals are
in tests/producers/test_calls_receiver_fence.py.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

import runlog
from runlog.errors import InvalidToolDeclaration
from runlog.producers._tools import Absent, Match, Tool, is_async

DEADLINE = datetime(2030, 1, 1, tzinfo=UTC)


def test_the_fence_goes_only_to_a_function_that_names_it() -> None:
    got: dict[str, dict[str, Any]] = {}

    def key_only(args: dict[str, Any], *, idempotency_key: str) -> str:
        got["key_only"] = {"idempotency_key": idempotency_key}
        return "a"

    def token(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
        got["token"] = {"idempotency_key": idempotency_key, "fencing_token": fencing_token}
        return "b"

    def both(
        args: dict[str, Any], *, idempotency_key: str, fencing_token: int, commit_deadline: datetime
    ) -> str:
        got["both"] = {"fencing_token": fencing_token, "commit_deadline": commit_deadline}
        return "c"

    def anything(args: dict[str, Any], **kw: Any) -> str:
        got["anything"] = kw
        return "d"

    for fn in (key_only, token, both, anything):
        tool = runlog.tool(risk="irreversible")(fn)
        assert tool.name == fn.__name__  # the name defaults to the function's
        tool({"x": 1}, idempotency_key="k2_k", fencing_token=5, commit_deadline=DEADLINE)
    assert got == {
        "key_only": {"idempotency_key": "k2_k"},
        "token": {"idempotency_key": "k2_k", "fencing_token": 5},
        "both": {"fencing_token": 5, "commit_deadline": DEADLINE},
        "anything": {"idempotency_key": "k2_k", "fencing_token": 5, "commit_deadline": DEADLINE},
    }


def test_a_reconciler_gets_the_asking_owners_token_only_if_it_names_it() -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def fenced_lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Any:
        asked.append(("fenced", {"key": idempotency_key, "token": fencing_token}))
        return Match("done")

    def plain_lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        asked.append(("plain", {"key": idempotency_key}))
        return Absent("not there")

    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        return "paid"

    fenced = runlog.tool("pay", risk="irreversible", reconcile=fenced_lookup)(pay)
    plain = runlog.tool("pay", risk="irreversible", reconcile=plain_lookup)(pay)
    assert fenced.lookup({}, idempotency_key="k2_p", fencing_token=9) == Match("done")
    assert plain.lookup({}, idempotency_key="k2_p", fencing_token=9) == Absent("not there")
    assert asked == [("fenced", {"key": "k2_p", "token": 9}), ("plain", {"key": "k2_p"})]


def test_a_reversible_tools_inverse_is_an_irreversible_tool_of_its_own() -> None:
    undone: list[tuple[dict[str, Any], str, str, int]] = []

    def book(args: dict[str, Any], *, idempotency_key: str) -> str:
        return "booked"

    def cancel(
        args: dict[str, Any], *, idempotency_key: str, original_key: str, fencing_token: int
    ) -> str:
        undone.append((args, idempotency_key, original_key, fencing_token))
        return "cancelled"

    original = runlog.tool("book", risk="reversible", compensate=cancel)(book)
    inverse = original.compensation()
    assert inverse is not None
    assert (inverse.name, inverse.risk, inverse.reconcile) == (
        "book/compensate",
        "irreversible",
        None,
    )
    out = inverse(
        {"args": {"room": 4}, "of": "k2_original"},
        idempotency_key="k2_inverse",
        fencing_token=6,
        commit_deadline=DEADLINE,  # the inverse does not name it: not passed
    )
    assert out == "cancelled"
    assert undone == [({"room": 4}, "k2_inverse", "k2_original", 6)]
    assert runlog.tool("book", risk="reversible")(book).compensation() is None


def test_async_tools_and_reconcilers_are_recognised_and_awaited() -> None:
    async def fetch(args: dict[str, Any], *, idempotency_key: str) -> str:
        return f"fetched {idempotency_key}"

    async def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        return Match("fetched")

    async def undo(args: dict[str, Any], *, idempotency_key: str, original_key: str) -> str:
        return f"undone {original_key}"

    def sync(args: dict[str, Any], *, idempotency_key: str) -> str:
        return "sync"

    tool = runlog.tool("fetch", risk="reversible", reconcile=lookup, compensate=undo)(fetch)
    assert is_async(tool) and is_async(tool.fn) and is_async(tool.reconcile)
    inverse = tool.compensation()
    assert inverse is not None and is_async(inverse)
    plain = runlog.tool("sync", reconcile=lambda a, **k: Absent())(sync)
    assert not is_async(plain) and not is_async(plain.reconcile)

    async def call_all() -> tuple[Any, Any, Any]:
        return (
            await tool({}, idempotency_key="k2_f"),  # type: ignore[misc]
            await tool.lookup({}, idempotency_key="k2_f", fencing_token=1),  # type: ignore[misc]
            await inverse({"args": {}, "of": "k2_f"}, idempotency_key="k2_u"),  # type: ignore[misc]
        )

    assert asyncio.run(call_all()) == ("fetched k2_f", Match("fetched"), "undone k2_f")


@pytest.mark.parametrize(
    ("declare", "field", "named"),
    [
        (lambda: runlog.tool("t", risk="harmless"), "risk", ["risk", "harmless"]),  # type: ignore[arg-type]
        (
            lambda: runlog.tool("t", risk="irreversible", compensate=lambda a, **k: ""),
            "compensate",
            ["compensate"],
        ),
        (
            lambda: runlog.tool("t", risk="safe", compensate=lambda a, **k: ""),
            "compensate",
            ["compensate"],
        ),
        (lambda: runlog.tool("refund/compensate", risk="reversible"), "name", ["/compensate"]),
    ],
)
def test_a_declaration_that_cannot_be_honoured_or_a_reserved_name_is_refused(
    declare: Any, field: str, named: list[str]
) -> None:
    """``InvalidToolDeclaration`` (also a ``ValueError``) naming the tool, the field and
    the value, as the reference says: when the tool is made, before any call."""

    def fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        return ""

    with pytest.raises(InvalidToolDeclaration) as err:
        declare()(fn)
    assert isinstance(err.value, ValueError) and err.value.field == field
    for word in named:
        assert word in str(err.value)


def test_a_tool_made_directly_is_held_to_the_same_declaration() -> None:
    with pytest.raises(InvalidToolDeclaration) as err:
        Tool(name="t", fn=lambda a, **k: "", risk="harmless")  # type: ignore[arg-type]
    assert (err.value.tool, err.value.field, err.value.value) == ("t", "risk", "harmless")


def test_a_tool_declares_no_guarantee_and_a_30_second_window_by_default() -> None:
    tool = Tool(name="t", fn=lambda a, **k: "")
    assert tool.receiver is None and tool.guarantees == frozenset()
    assert not tool.dedupes_by_key
    assert tool.commit_window_s == 30
