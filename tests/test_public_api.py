"""The public API has an edge: one table of names, pinned here, and public modules that say
what they export.

Adding or removing a public name fails ``test_public_names_are_pinned`` until the list below
is updated: a change to the API is made on purpose, in review, not by accident. None of
these tests needs the stack; they import in a fresh interpreter where it matters.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import runlog
import runlog.aio

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
    "Inconclusive",
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

# Old names kept one release: each warns on access and resolves to its new name.
EXPECTED_DEPRECATED = {"Unavailable": "Inconclusive"}

EXPECTED_AIO = [
    "AsyncRun",
    "cancel",
    "decide",
    "forget",
    "fork",
    "open_run",
    "question",
    "reconcile",
    "resume",
    "start",
    "terminate",
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


def test_deprecated_names_warn_and_resolve_to_their_new_names() -> None:
    assert {n: new for n, (new, _why) in runlog._DEPRECATED.items()} == EXPECTED_DEPRECATED
    for old, new in EXPECTED_DEPRECATED.items():
        assert old not in runlog.__all__ and new in runlog.__all__
        with pytest.warns(DeprecationWarning, match=f"runlog.{new}"):
            value = getattr(runlog, old)
        assert value is getattr(runlog, new)
        with pytest.warns(DeprecationWarning):  # every access warns, not only the first
            getattr(runlog, old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runlog.Inconclusive("the lookup timed out")  # the new name does not warn


# ``runlog`` and ``runlog.aio``, ``Run`` and ``AsyncRun``: the same names, except these.
AIO_SYNC_ONLY = {
    # process-local counters and an HTTP endpoint: nothing to wait for in a loop
    "append_metrics",
    "lease_metrics",
    "serve_metrics",
}
# The handles' members before they were split from their engine and documented nowhere:
# kept one release as aliases that warn (served by ``__getattr__``, so not members).
RUN_DEPRECATED = {
    "cancel_flag",
    "cancel_flag_key",
    "cancel_raised",
    "confirm_in_log",
    "confirmed_locally",
    "delivery_wait_s",
    "deps",
    "dispatched",
    "emit_confirmed",
    "ends_cancelled",
    "final_outcome",
    "first_offset",
    "hand_over",
    "idempotency_key",
    "key_scope",
    "last_offset",
    "lease",
    "partition",
    "position",
    "recover",
    "tools",
}
ASYNC_RUN_DEPRECATED = {"lease", "recover", "sync"}


def _public_names(cls: type) -> set[str]:
    """What a user can reach on an instance: attributes, methods, properties, and the
    fields and annotated attributes (``Run`` is a dataclass), without an instance."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return {n for n in names if not n.startswith("_")}


def test_run_and_async_run_have_the_same_public_names() -> None:
    sync = _public_names(runlog.Run)
    aio = _public_names(runlog.aio.AsyncRun)
    assert sync == aio, f"Run only: {sorted(sync - aio)}; AsyncRun only: {sorted(aio - sync)}"
    assert len(sync) <= 20, f"the handle has grown to {len(sync)} names: {sorted(sync)}"
    assert sync == _documented_members("runlog.Run"), "a member the API page does not show"


def test_the_engine_behind_a_handle_is_private_and_its_old_names_warn() -> None:
    """A handle's old engine members still answer, one release, with a warning; they are
    not members (``dir``), and what is neither a member nor deprecated is refused."""
    from runlog.producers._engine import Engine
    from runlog.producers._handle import DEPRECATED, engine_of

    assert DEPRECATED == RUN_DEPRECATED
    assert not RUN_DEPRECATED & _public_names(runlog.Run)
    assert not ASYNC_RUN_DEPRECATED & _public_names(runlog.aio.AsyncRun)
    engine = object.__new__(Engine)
    engine.position = 7
    run = runlog.Run(engine)
    with pytest.warns(DeprecationWarning, match="Run.position"):
        assert run.position == 7
    with pytest.raises(AttributeError):
        run.no_such_member  # noqa: B018 - the lookup is the test
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the package's own way to the engine does not warn
        assert engine_of(run) is engine
    arun = object.__new__(runlog.aio.AsyncRun)
    arun._engine = engine
    with pytest.warns(DeprecationWarning, match="AsyncRun.sync"):
        assert engine_of(arun.sync) is engine


def test_runlog_and_aio_export_the_same_calls() -> None:
    assert runlog.aio.__all__ == EXPECTED_AIO
    calls = {n for n, module in runlog._PUBLIC.items() if module == "runlog._api"}
    assert calls - set(runlog.aio.__all__) == AIO_SYNC_ONLY, "an I/O call has no aio form"
    assert set(runlog.aio.__all__) - calls == {"AsyncRun"}
    for name in calls - AIO_SYNC_ONLY:
        sync, aio = getattr(runlog, name), getattr(runlog.aio, name)
        if name != "open_run":  # its own wrapper; it binds ``runlog.open_run``'s signature
            assert aio.__wrapped__ is sync, name


def _documented_members(heading: str) -> set[str]:
    """The members the Python API page renders for ``::: heading``."""
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    m = re.search(rf"^::: {re.escape(heading)}\n(?:\s+.*\n)*?\s+members: \[([^\]]*)\]", page, re.M)
    assert m, f"docs/reference/api.md renders no member list for {heading}"
    return {n.strip() for n in m.group(1).split(",")}


def test_the_api_page_documents_the_same_handle_twice() -> None:
    sync, aio = _documented_members("runlog.Run"), _documented_members("runlog.aio.AsyncRun")
    assert sync == aio
    assert not sync & (RUN_DEPRECATED | ASYNC_RUN_DEPRECATED), "the docs show an engine name"
    assert sync <= _public_names(runlog.Run) and aio <= _public_names(runlog.aio.AsyncRun)
