"""A run's conversation as the fold keeps it: its shape is the stored shape of every
permanent fixture, each message owns its tool calls, and the module sits below the folds
that build messages.

Pure: the fixtures' recorded states are read from tests/fixtures; nothing is folded.
"""

from __future__ import annotations

import ast
import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from runlog.projections._messages import Message, ToolResult
from runlog.projections._run_state import jsonable

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _stored_messages() -> list[dict[str, Any]]:
    """Every message of every state recorded with the permanent fixtures (v1 onwards)."""
    found = []
    for path in sorted(FIXTURES.glob("*/states.json")):
        for state in json.loads(path.read_text())["states"].values():
            found += state["messages"]
    return found


def test_every_stored_message_reads_back_into_the_same_message() -> None:
    """The states of old logs compare equal to the states recorded when they were written:
    a message's fields (and a tool result's) are exactly the stored ones."""
    stored = _stored_messages()
    assert len(stored) > 100
    assert {m["role"] for m in stored} == {"user", "assistant", "tool"}
    assert {m["trust"] for m in stored} == {"user", "model", "tool", "untrusted"}
    assert any(m["tool_result"] for m in stored) and any(m["tool_calls"] for m in stored)
    for raw in stored:
        result = raw["tool_result"]
        msg = Message(**{**raw, "tool_result": ToolResult(**result) if result else None})
        assert jsonable(msg) == raw


def test_a_message_owns_its_tool_calls_and_defaults_to_plain_user_text() -> None:
    a, b = Message("assistant"), Message("assistant")
    a.tool_calls.append({"call_id": "c1", "name": "t", "args_json": "{}"})
    assert b.tool_calls == [], "a message's tool calls are its own (erasure rewrites them)"
    assert (b.content, b.trust, b.tool_result) == ("", "user", None)
    assert ToolResult("c1", "t", "ok").is_error is False


def test_the_conversation_sits_below_the_folds_that_build_it() -> None:
    """``run_state`` and ``lineage`` both build messages: this module imports neither (nor
    anything of runlog), so neither needs the other to make one."""
    spec = find_spec("runlog.projections._messages")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    imported = [
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0
    ] + [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative and not [n for n in imported if n.split(".")[0] == "runlog"], imported
