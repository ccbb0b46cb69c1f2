"""runlog's errors (``runlog.errors``): one root, per-area subclasses, fields rather than prose
(docs/reference/api.md, "Errors").

* Every exception the module defines is a ``RunlogError``; the hierarchy is the documented
  one (``TenantMismatch`` is an ``UnknownRun``, ``AgentMismatch`` a ``StartRefused``, the
  schema errors ``SchemaError``s, bad arguments also ``ValueError``s...).
* ``retryable``: true of the unavailable services, false by default, per notification.
* The fields each error carries: a run's identity (``run_id``, ``epoch``, ``seq``) and
  what the docs name per error.
* The errors ``runlog`` exports are the same classes as ``runlog.errors``'s, and the
  public module lists them in its ``__all__``.

Which names ``runlog`` exports: tests/test_public_api.py.
"""

from __future__ import annotations

import inspect
from datetime import UTC, datetime

import pytest

import runlog
from runlog import errors
from runlog.errors import (
    AgentMismatch,
    CallUncertain,
    Cancelled,
    ConfigError,
    DecisionConflict,
    Escalated,
    Fenced,
    InvalidToolDeclaration,
    KafkaUnavailable,
    MissingExtra,
    NoLiveWorker,
    NotificationFailed,
    NotReconcilable,
    NotSettledYet,
    RedisUnavailable,
    RunLocked,
    RunlogError,
    SchemaError,
    StartRefused,
    SubjectHasOtherRuns,
    UnknownFingerprint,
    UnreadableRecord,
)

DEFINED = {
    name: cls
    for name, cls in vars(errors).items()
    if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__
}

# (error, what it is documented to be) per docs/reference/api.md and the errors' docstrings.
HIERARCHY = [
    *(
        (name, "RunError")
        for name in (
            "Fenced",
            "RunLocked",
            "AppendOutcomeUnknown",
            "RunFinished",
            "UnknownRun",
            "StartRefused",
            "UnknownApproval",
            "Escalated",
            "CallUncertain",
            "CallRejected",
            "ToolFailed",
            "Cancelled",
            "ForkRefused",
            "NotADecider",
            "DecisionConflict",
            "SubjectHasOtherRuns",
            "NotReconcilable",
            "NotUndoable",
        )
    ),
    ("TenantMismatch", "UnknownRun"),
    ("AgentMismatch", "StartRefused"),
    *(
        (name, "SchemaError")
        for name in (
            "CorruptRecord",
            "UnknownFingerprint",
            "UnknownSchemaId",
            "NewerSchemaVersion",
            "ValidationFailed",
            "MissingUpcaster",
            "UpcastFailed",
            "InvalidRecordKey",
            "UnreadableRecord",
            "UnknownEventType",
        )
    ),
    ("MissingExtra", "ConfigError"),
    ("NoKeys", "ConfigError"),
    *(
        (name, "RunlogError")
        for name in (
            "ConfigError",
            "SchemaError",
            "RunError",
            "NoLiveWorker",
            "ToolArgumentsError",
            "UnknownTool",
            "RegistryUnavailable",
            "KafkaUnavailable",
            "RedisUnavailable",
            "NotificationFailed",
            "NotSettledYet",
            "StackError",
        )
    ),
    *(
        (name, "ValueError")
        for name in ("InvalidRunId", "InvalidTenant", "InvalidToolDeclaration", "NotUndoable")
    ),
]


def test_every_error_of_the_module_is_a_runlog_error() -> None:
    assert issubclass(RunlogError, Exception)
    strays = sorted(n for n, cls in DEFINED.items() if not issubclass(cls, RunlogError))
    assert not strays, f"errors outside the RunlogError tree: {strays}"


@pytest.mark.parametrize(("name", "base"), HIERARCHY, ids=[f"{n}<{b}" for n, b in HIERARCHY])
def test_the_documented_hierarchy(name: str, base: str) -> None:
    cls = DEFINED[name]
    parent = ValueError if base == "ValueError" else DEFINED[base]
    assert issubclass(cls, parent) and issubclass(cls, RunlogError)


def test_retryable_marks_the_unavailable_services_only() -> None:
    for cls in (KafkaUnavailable, RedisUnavailable, errors.KeyUnavailable):
        assert cls("down").retryable is True
    for cls in (RunlogError, ConfigError, SchemaError, errors.ToolArgumentsError):
        assert cls("no").retryable is False
    assert Fenced("fenced", run_id="r").retryable is False
    # A notification says it per instance: a 4xx will never succeed.
    refused = NotificationFailed("400 from the hook", retryable=False, status=400)
    assert refused.retryable is False and refused.status == 400
    assert NotificationFailed("timeout").retryable is True
    assert NotificationFailed.retryable is False  # the class default is untouched


def test_a_run_error_carries_the_runs_identity() -> None:
    err = Fenced("fenced at seq 7", run_id="r-1", epoch=3, seq=7)
    assert (err.run_id, err.epoch, err.seq) == ("r-1", 3, 7)
    assert str(err) == "fenced at seq 7"
    bare = CallUncertain("unknown")
    assert (bare.run_id, bare.epoch, bare.seq) == (None, None, None)
    assert RunLocked("held", run_id="r-1").holder_ttl_ms is None
    esc = Escalated("needs a person", approval_id="ap-1", run_id="r-1", seq=4)
    assert (esc.approval_id, esc.run_id, esc.seq) == ("ap-1", "r-1", 4)
    stop = Cancelled("cancelled", requested_by="ann", reason="wrong customer", run_id="r-1")
    assert (stop.requested_by, stop.reason, stop.run_id) == ("ann", "wrong customer", "r-1")


def test_each_error_carries_the_fields_the_docs_name() -> None:
    refused = AgentMismatch("other agent", run_id="r-1", agent="a", recorded_agent="b")
    assert isinstance(refused, StartRefused)
    assert (refused.run_id, refused.agent, refused.recorded_agent) == ("r-1", "a", "b")
    assert StartRefused("another tenant's", run_id="r-1").recorded_agent is None
    assert NoLiveWorker("nobody serves it", agent="a").agent == "a"

    bad = UnreadableRecord("cannot decode", topic="runlog.events", partition=2, offset=41)
    assert (bad.topic, bad.partition, bad.offset) == ("runlog.events", 2, 41)
    unknown = UnknownFingerprint(b"\x01\x02\x03\x04\x05\x06\x07\x08")
    assert unknown.fingerprint == b"\x01\x02\x03\x04\x05\x06\x07\x08"
    assert "0102030405060708" in str(unknown)

    at = datetime(2026, 12, 1, tzinfo=UTC)
    standing = DecisionConflict(
        "already decided",
        approval_id="ap-1",
        decided_by="alice",
        approved=False,
        note="no",
        decided_at=at,
        decided_seq=9,
        run_id="r-1",
        answer="undo_and_retry",
    )
    assert (standing.approval_id, standing.decided_by, standing.approved) == (
        "ap-1",
        "alice",
        False,
    )
    assert (standing.note, standing.decided_at, standing.decided_seq) == ("no", at, 9)
    assert (standing.run_id, standing.seq, standing.answer) == ("r-1", 9, "undo_and_retry")

    decl = InvalidToolDeclaration("bad window", tool="pay", field="commit_window_s", value=0)
    assert (decl.tool, decl.field, decl.value) == ("pay", "commit_window_s", 0)
    extra = MissingExtra(integration="langgraph", extra="langgraph", package="langgraph")
    assert "pip install 'runlog[langgraph]'" in str(extra) and extra.package == "langgraph"
    shared = SubjectHasOtherRuns("shared key", run_id="r-1", subject="u-1", others=["r-2"])
    assert (shared.run_id, shared.subject, shared.others) == ("r-1", "u-1", ["r-2"])
    nope = NotReconcilable("no lookup", key="k-1", why="no_lookup", run_id="r-1")
    assert (nope.key, nope.why, nope.run_id) == ("k-1", "no_lookup", "r-1")
    queued = NotSettledYet("queued", request_id="q-1", run_id="r-1")
    assert (queued.request_id, queued.run_id) == ("q-1", "r-1")


def test_the_errors_runlog_exports_are_the_modules_own() -> None:
    exported = [n for n, module in runlog._PUBLIC.items() if module == "runlog.errors"]
    assert {"RunlogError", "RunError", "SchemaError", "ConfigError", "Fenced"} <= set(exported)
    for name in exported:
        assert getattr(runlog, name) is DEFINED[name]
    for name in errors.__all__:
        assert name in DEFINED, f"runlog.errors.__all__ names {name}, which it does not define"
    assert issubclass(runlog.RunError, runlog.RunlogError)


def test_every_error_runlog_exports_is_in_the_public_modules_all() -> None:
    exported = {n for n, module in runlog._PUBLIC.items() if module == "runlog.errors"}
    assert not exported - set(errors.__all__), sorted(exported - set(errors.__all__))
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.RunlogError)
    }
    assert defined <= set(errors.__all__), sorted(defined - set(errors.__all__))


def _instances() -> list[RunlogError]:
    """One instance of every error of the module, each with its fields set: those whose
    constructor takes more than a message as their docs name it, the rest with a message
    and, for a run's error, its identity."""
    at = datetime(2026, 12, 1, tzinfo=UTC)
    made: list[RunlogError] = [
        AgentMismatch("other agent", run_id="r-1", agent="a", recorded_agent="b"),
        NoLiveWorker("nobody serves it", agent="a"),
        UnreadableRecord("cannot decode", topic="runlog.events", partition=2, offset=41),
        UnknownFingerprint(b"\x01\x02\x03\x04\x05\x06\x07\x08"),
        DecisionConflict(
            "already decided",
            approval_id="ap-1",
            decided_by="alice",
            approved=False,
            decided_at=at,
            decided_seq=9,
            run_id="r-1",
        ),
        InvalidToolDeclaration("bad window", tool="pay", field="commit_window_s", value=0),
        MissingExtra(integration="langgraph", extra="langgraph", package="langgraph"),
        SubjectHasOtherRuns("shared key", run_id="r-1", subject="u-1", others=["r-2"]),
        NotReconcilable("no lookup", key="k-1", why="no_lookup", run_id="r-1"),
        NotSettledYet("queued", request_id="q-1", run_id="r-1"),
        NotificationFailed("400 from the hook", retryable=False, status=400),
        Cancelled("cancelled", requested_by="ann", reason="wrong customer", run_id="r-1"),
        Escalated("needs a person", approval_id="ap-1", run_id="r-1", seq=4),
    ]
    locked = RunLocked("held", run_id="r-1")
    locked.holder_ttl_ms = 900  # set where the holder's lease is known
    made.append(locked)
    covered = {type(e) for e in made}
    identity = {"run_id": "r-1", "epoch": 2, "seq": 3}
    for cls in DEFINED.values():
        if cls not in covered:
            takes = inspect.signature(cls.__init__).parameters
            made.append(cls("why", **{k: v for k, v in identity.items() if k in takes}))
    return made


@pytest.mark.parametrize("err", _instances(), ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_message_and_fields(err: RunlogError) -> None:
    """A worker pool or a task queue hands an error to another process by pickling it; an
    error whose constructor takes keyword-only fields must come back whole, not fail with a
    ``TypeError`` in the receiving process."""
    import pickle

    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err) and back.args == err.args
    assert vars(back) == vars(err)
    assert back.retryable == err.retryable
