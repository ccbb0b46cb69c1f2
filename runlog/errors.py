"""One root exception, per-area subclasses, fields rather than prose.

Third-party errors are wrapped at the boundary (``raise X(...) from exc``) so callers
never need to import confluent_kafka or redis to handle a runlog failure.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

__all__ = [
    "AgentMismatch",
    "AppendOutcomeUnknown",
    "CallRejected",
    "CallUncertain",
    "Cancelled",
    "ConfigError",
    "CorruptRecord",
    "DecisionConflict",
    "Escalated",
    "Fenced",
    "ForkRefused",
    "InvalidRecordKey",
    "InvalidRunId",
    "InvalidTenant",
    "InvalidToolDeclaration",
    "KafkaUnavailable",
    "KeyUnavailable",
    "MissingExtra",
    "MissingUpcaster",
    "NewerSchemaVersion",
    "NoKeys",
    "NoLiveWorker",
    "NotADecider",
    "NotReconcilable",
    "NotSettledYet",
    "NotUndoable",
    "NotificationFailed",
    "RedisUnavailable",
    "RegistryUnavailable",
    "RunError",
    "RunFinished",
    "RunLocked",
    "RunlogError",
    "SchemaError",
    "StackError",
    "StartRefused",
    "SubjectHasOtherRuns",
    "TenantMismatch",
    "ToolArgumentsError",
    "ToolFailed",
    "UnknownApproval",
    "UnknownEventType",
    "UnknownFingerprint",
    "UnknownRun",
    "UnknownSchemaId",
    "UnknownTool",
    "UnreadableRecord",
    "UpcastFailed",
    "ValidationFailed",
]


def _rebuilt(cls: type[RunlogError], args: tuple[Any, ...], fields: dict[str, Any]) -> Any:
    """``cls``'s error with these ``args`` and fields, without its ``__init__`` (whose
    keyword-only fields pickle's default would not pass): ``RunlogError.__reduce__``."""
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(fields)
    return err


class RunlogError(Exception):
    """Root of every error runlog raises on purpose. Each pickles with its message and
    fields (a worker pool or a task queue hands it to another process whole)."""

    retryable: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


class ConfigError(RunlogError):
    """Settings or topic configuration are wrong or have drifted."""


class MissingExtra(ConfigError):
    """A runlog integration was imported without the framework it integrates: the package
    named by ``package`` is not installed; ``pip install 'runlog[<extra>]'`` installs it."""

    def __init__(self, *, integration: str, extra: str, package: str) -> None:
        super().__init__(
            f"{integration} needs the {package!r} package, which is not installed: "
            f"pip install 'runlog[{extra}]'"
        )
        self.integration, self.extra, self.package = integration, extra, package


class NoKeys(ConfigError):
    """A record holds sealed content and this reader or writer was given no keys
    (``RUNLOG_ENCRYPTION`` and ``RUNLOG_KEK``/``RUNLOG_KEK_FILE``): a setting to fix, never a
    bad record to quarantine."""


class KeyUnavailable(RunlogError):
    """The key store did not answer (its topic unreachable, its KEK missing a version)."""

    retryable = True


class StackError(RunlogError):
    """The embedded Kafka/Redis stack could not be brought up, named what is missing."""


class SchemaError(RunlogError):
    """An event could not be encoded or decoded."""


class UnknownFingerprint(SchemaError):
    """The record names a writer schema this reader does not know."""

    def __init__(self, fingerprint: bytes) -> None:
        super().__init__(f"unknown writer schema fingerprint {fingerprint.hex()}")
        self.fingerprint = fingerprint


class UnknownSchemaId(SchemaError):
    """A Confluent-framed record whose schema id is not one of runlog's released schemas."""


class RegistryUnavailable(RunlogError):
    """The schema registry did not answer; appends stop rather than change encoding."""

    retryable = True


class CorruptRecord(SchemaError):
    """The record's bytes are truncated, have a bad header or do not decode."""


class ValidationFailed(SchemaError):
    """The payload does not satisfy the event type's model."""


class UnreadableRecord(SchemaError):
    """A record of a run that cannot be decoded: readers refuse to fold past it."""

    def __init__(self, message: str, *, topic: str, partition: int, offset: int) -> None:
        super().__init__(message)
        self.topic, self.partition, self.offset = topic, partition, offset


class UnknownEventType(SchemaError):
    """An event type that is neither state-changing nor record-only."""


class NewerSchemaVersion(SchemaError):
    """The event was written by a newer release than this reader knows."""


class MissingUpcaster(SchemaError):
    """A change of meaning between versions has no upcaster; the reader refuses to guess."""


class RunError(RunlogError):
    """A failure tied to one run; carries its identity."""

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        epoch: int | None = None,
        seq: int | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.epoch = epoch
        self.seq = seq


class Fenced(RunError):
    """This writer no longer owns the run; it must not act on the append that raised."""


class RunLocked(RunError):
    """A live owner still holds the run after waiting."""

    holder_ttl_ms: int | None = None
    """How long the holder's lease still lives, when known (a dispatcher tries again then)."""


class AppendOutcomeUnknown(RunError):
    """The broker did not confirm an append in time: the event may or may not be in the log.

    Stop; the next ``open_run`` learns the truth from the log.
    """


class UnknownRun(RunError):
    """The run has no events in the log (or, as ``TenantMismatch``, none of this tenant)."""


class TenantMismatch(UnknownRun):
    """The run id already belongs to another tenant; this tenant may not open it.

    A subclass of ``UnknownRun``: to a tenant, another tenant's run does not exist, so a
    caller that catches ``UnknownRun`` is covered; the message never names the owner, and
    the CLI answers it exactly as an unknown run (exit 4).
    """


class StartRefused(RunError):
    """A start request (``runlog.start``) names a run id whose log says it cannot be this
    request's run: the id belongs to another tenant (the message never names it), or its
    ``RUN_STARTED`` recorded another agent (``AgentMismatch``). Nothing was written.

    ``agent``: the agent the request named; ``recorded_agent``: the one the log recorded
    (None when not told: another tenant's run, or a run not started by the registry)."""

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        agent: str = "",
        recorded_agent: str | None = None,
    ) -> None:
        super().__init__(message, run_id=run_id)
        self.agent, self.recorded_agent = agent, recorded_agent


class AgentMismatch(StartRefused):
    """The run's log recorded another agent than the one asked for: a start request for
    it is refused, and a worker opening it for that agent stands down (it dispatches the
    recorded agent instead). Names both agents."""


class NoLiveWorker(RunlogError):
    """No live worker announces the agent a request needs (``runlog workers``): a start
    with ``--require-worker`` or a reconcile request was not written, since nothing would
    serve it now. ``agent`` names it."""

    def __init__(self, message: str, *, agent: str) -> None:
        super().__init__(message)
        self.agent = agent


class ForkRefused(RunError):
    """A fork cannot be made as asked: a seq outside the parent's valid log, or a run id
    already used by another run (or another fork). Nothing was written."""


class SubjectHasOtherRuns(RunError):
    """``forget`` of one run whose data subject has other runs: they share the subject's
    key, so shredding it would erase them too, without stopping them or recording their
    erasure. Refused, nothing written; forget the whole subject instead."""

    def __init__(self, message: str, *, run_id: str, subject: str, others: list[str]) -> None:
        super().__init__(message, run_id=run_id)
        self.subject = subject
        self.others = others


class RunFinished(RunError):
    """The run has a terminal outcome; nothing more may be appended."""


class Cancelled(RunError):
    """A person cancelled the run (``runlog cancel``): raised into the agent at its next
    step, once. The agent may clean up (its steps run again after this); the run ends
    cancelled when it is closed or finished. ``requested_by`` and ``reason`` say who
    asked and why."""

    def __init__(self, message: str, *, requested_by: str = "", reason: str = "", **kw: object):
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.requested_by, self.reason = requested_by, reason


class Escalated(RunError):
    """A call needs a person's decision before the run may continue."""

    def __init__(self, message: str, *, approval_id: str | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.approval_id = approval_id


class CallUncertain(RunError):
    """A side effect's outcome is unknown and no evidence allows retrying it yet."""


class CallRejected(RunError):
    """A person decided a call must not be executed (again)."""


class ToolFailed(RunError):
    """The tool proved it failed; the failure is recorded and the call may be tried again."""


class ToolArgumentsError(RunlogError):
    """Tool arguments are not canonicalisable JSON or exceed limits; refused before STARTED."""


class InvalidToolDeclaration(RunlogError, ValueError):
    """A tool declares something runlog cannot honour (an unknown receiver guarantee, a
    commit window that is not positive): refused when the tool is made, before any call.
    ``tool``, ``field`` and ``value`` name what was wrong. Also a ``ValueError``."""

    def __init__(self, message: str, *, tool: str, field: str, value: object) -> None:
        super().__init__(message)
        self.tool, self.field, self.value = tool, field, value


class UnknownTool(RunlogError):
    """``call_tool`` named a tool the run was not opened with."""


class KafkaUnavailable(RunlogError):
    """The broker could not be reached or refused an operation."""

    retryable = True


class RedisUnavailable(RunlogError):
    """Redis could not be reached."""

    retryable = True


class InvalidRunId(RunlogError, ValueError):
    """A run id is empty, too long, or holds a character outside the documented set.

    Also a ``ValueError``, like a refused tenant name: both are bad arguments.
    """


class InvalidTenant(RunlogError, ValueError):
    """A tenant name runlog cannot keep apart from other tenants, the console's wildcard,
    or the Redis Cluster hash tag of its runs' keys; names the tenant and why.

    Also a ``ValueError``, like a refused run id: both are bad arguments.
    """


class InvalidRecordKey(SchemaError):
    """A record's Kafka key is missing, not UTF-8, or not a valid run id: it names no run."""


class UpcastFailed(SchemaError):
    """An upcaster raised on a record: the record cannot be brought to the current version."""


class UnknownApproval(RunError):
    """The run never issued the approval id a decision names."""


class NotADecider(RunError):
    """A decision this process cannot make: the readers trust decider keys, and it holds
    none of them (``RUNLOG_DECIDER_KEY_FILE``) or its key is not one they trust. Every
    reader would reject the decision as forged, so nothing is appended."""


class NotUndoable(RunError, ValueError):
    """ "Undo and retry" was asked of an approval it cannot answer: not about a call, or
    about a call whose tool declared no inverse (``compensate=``) on its STARTED. Nothing
    is appended or queued."""


class DecisionConflict(RunError):
    """The approval already has a decision, and the first valid decision in the log stands.

    Carries the standing decision: who, whether it approved, its note, and when and at
    which seq it was recorded (``None`` where the refusing reader did not see the record).
    """

    def __init__(
        self,
        message: str,
        *,
        approval_id: str,
        decided_by: str,
        approved: bool,
        note: str = "",
        decided_at: datetime | None = None,
        decided_seq: int | None = None,
        run_id: str | None = None,
        answer: str | None = None,
    ) -> None:
        super().__init__(message, run_id=run_id, seq=decided_seq)
        self.approval_id, self.decided_by, self.approved = approval_id, decided_by, approved
        self.note, self.decided_at, self.decided_seq = note, decided_at, decided_seq
        self.answer = answer
        """The standing decision's answer beyond approve/reject ("undo_and_retry"), else None."""


class NotificationFailed(RunlogError):
    """A notification hook did not take a notification. ``retryable``: a later attempt may
    succeed (a 5xx, a timeout, a refused connection); False: it never will (a 4xx)."""

    def __init__(self, message: str, *, retryable: bool = True, status: int | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status


class NotReconcilable(RunError):
    """A reconciliation was asked of a call it cannot settle: ``key`` is not an open call of
    the run, waits for a person's decision (it was escalated), or its tool declares no
    lookup (``reconcile=``) here. ``why`` says which. Nothing is appended."""

    def __init__(self, message: str, *, key: str | None, why: str, run_id: str | None = None):
        super().__init__(message, run_id=run_id)
        self.key, self.why = key, why


class NotSettledYet(RunlogError):
    """A reconcile request was recorded but no worker answered it within the wait: it stays
    queued (``request_id``), and a worker serving the agent runs it when it can (a live
    owner holding the run is waited for, never broken)."""

    def __init__(self, message: str, *, request_id: str, run_id: str) -> None:
        super().__init__(message)
        self.request_id, self.run_id = request_id, run_id
