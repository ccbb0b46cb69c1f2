"""The public API has an edge: one table of names, pinned here, and public modules that say
what they export.

Adding or removing a public name fails ``test_public_names_are_pinned`` until the list below
is updated: a change to the API is made on purpose, in review, not by accident. None of
these tests needs the stack; they import in a fresh interpreter where it matters.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import runlog

ROOT = Path(__file__).resolve().parent.parent

EXPECTED_RUNLOG = [
    "Absent",
    "AgentMismatch",
    "AppendOutcomeUnknown",
    "CallContext",
    "CallRejected",
    "CallUncertain",
    "Cancelled",
    "ConfigError",
    "Conflict",
    "DecisionConflict",
    "Escalated",
    "Event",
    "EventType",
    "Fenced",
    "Fork",
    "ForkRefused",
    "KafkaUnavailable",
    "Match",
    "NoLiveWorker",
    "NotADecider",
    "NotReconcilable",
    "NotSettledYet",
    "NotUndoable",
    "Question",
    "Reconciliation",
    "RedisUnavailable",
    "Run",
    "RunError",
    "RunFinished",
    "RunLocked",
    "RunlogError",
    "SchemaError",
    "Settings",
    "StartRefused",
    "SubjectHasOtherRuns",
    "TenantMismatch",
    "Tool",
    "ToolArgumentsError",
    "ToolError",
    "ToolFailed",
    "Unavailable",
    "UnknownRun",
    "UnknownTool",
    "agent",
    "aio",
    "append_metrics",
    "cancel",
    "current_call",
    "decide",
    "decode",
    "encode",
    "forget",
    "fork",
    "lease_metrics",
    "open_run",
    "question",
    "reconcile",
    "resume",
    "serve_metrics",
    "start",
    "terminate",
    "testing",
    "tool",
]

EXPECTED_TESTING = [
    "AgentLoop",
    "ApprovalStep",
    "Call",
    "CompactStep",
    "FinishStep",
    "ModelStep",
    "ScriptedModel",
    "Step",
]

EXPECTED_MODULES = (
    "runlog",
    "runlog.aio",
    "runlog.testing",
    "runlog.errors",
    "runlog.integrations.pydantic_ai",
    "runlog.integrations.langgraph",
    "runlog.integrations.openai_agents",
    "runlog.integrations.pydantic_ai_capability",
)

TEST_DOUBLES = ("AgentLoop", "ScriptedModel", "ModelStep", "Call", "CompactStep")


def test_public_names_are_pinned() -> None:
    assert sorted(runlog.__all__) == EXPECTED_RUNLOG
    assert runlog.__all__ == sorted(runlog._PUBLIC), "__all__ is derived from the one table"


def test_testing_names_are_pinned_and_not_in_runlog() -> None:
    import runlog.testing

    assert sorted(runlog.testing.__all__) == EXPECTED_TESTING
    for name in TEST_DOUBLES:
        assert not hasattr(runlog, name), f"runlog.{name}: test doubles live in runlog.testing"


def test_public_modules_are_listed_once_and_declare_all() -> None:
    assert runlog._PUBLIC_MODULES == EXPECTED_MODULES
    for name in EXPECTED_MODULES:
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert isinstance(exported, list) and exported, f"{name} declares no __all__"
        assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
        missing = [n for n in exported if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it does not have: {missing}"


def test_every_public_name_resolves_in_a_fresh_interpreter() -> None:
    """Each name of the table loads from the module the table says (lazily)."""
    code = (
        "import runlog, importlib, types\n"
        "for n, m in runlog._PUBLIC.items():\n"
        "    v = getattr(runlog, n)\n"
        "    if isinstance(v, types.ModuleType):\n"
        "        assert v.__name__ == m, (n, m)\n"
        "    else:\n"
        "        assert getattr(importlib.import_module(m), n) is v, (n, m)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _type_checking_imports() -> dict[str, str]:
    """name -> module of every ``from M import X as X`` in runlog/__init__.py, at top level
    or under ``if TYPE_CHECKING:`` (what type checkers see)."""
    tree = ast.parse((ROOT / "runlog" / "__init__.py").read_text())
    nodes: list[ast.stmt] = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            nodes += node.body
    found: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runlog"):
            for alias in node.names:
                if alias.name in ("annotations",):
                    continue
                assert alias.asname == alias.name, f"{alias.name}: re-export it as itself"
                submodule = f"{node.module}.{alias.name}"
                found[alias.name] = submodule if node.module == "runlog" else node.module
    return found


def test_type_checking_imports_agree_with_the_table() -> None:
    assert _type_checking_imports() == runlog._PUBLIC
