"""runlog: durable, fenced, replayable event logs for AI-agent runs on Kafka and Redis.

Users import ``runlog`` only. Every subpackage lives inside this package, so importing any
of them (``runlog.projections.run_state``, say) runs this file first: it therefore loads
nothing but the errors, and each public name below loads on first use. That keeps the
pure fold importable without Kafka, Redis, fastavro or pydantic-settings.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from runlog.errors import (
    AppendOutcomeUnknown,
    CallRejected,
    CallUncertain,
    ConfigError,
    DecisionConflict,
    Escalated,
    Fenced,
    KafkaUnavailable,
    NotADecider,
    RedisUnavailable,
    RunError,
    RunFinished,
    RunLocked,
    RunlogError,
    SchemaError,
    TenantMismatch,
    ToolArgumentsError,
    ToolFailed,
    UnknownRun,
    UnknownTool,
)

# A library's loggers are the application's to show: without a handler of its own there,
# Python's last-resort handler would print runlog's (and librdkafka's) warnings to stderr.
logging.getLogger("runlog").addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from runlog.api import append_metrics, decide, lease_metrics, open_run, serve_metrics
    from runlog.producers.agent import (
        AgentLoop,
        ApprovalStep,
        Call,
        CompactStep,
        FinishStep,
        ModelStep,
        ScriptedModel,
    )
    from runlog.producers.context import CallContext, current_call
    from runlog.producers.run import Run
    from runlog.producers.tools import Absent, Conflict, Match, Tool, ToolError, Unavailable, tool
    from runlog.schemas.codec import decode, encode
    from runlog.schemas.models import Event
    from runlog.schemas.vocabulary import EventType
    from runlog.settings import Settings

_LAZY = {
    "Settings": "runlog.settings",
    "open_run": "runlog.api",
    "current_call": "runlog.producers.context",
    "decode": "runlog.schemas.codec",
    "encode": "runlog.schemas.codec",
    "lease_metrics": "runlog.api",
    "append_metrics": "runlog.api",
    "serve_metrics": "runlog.api",
    "CallContext": "runlog.producers.context",
    "decide": "runlog.api",
    "AgentLoop": "runlog.producers.agent",
    "ScriptedModel": "runlog.producers.agent",
    "ModelStep": "runlog.producers.agent",
    "Call": "runlog.producers.agent",
    "CompactStep": "runlog.producers.agent",
    "ApprovalStep": "runlog.producers.agent",
    "FinishStep": "runlog.producers.agent",
    "Run": "runlog.producers.run",
    "tool": "runlog.producers.tools",
    "Tool": "runlog.producers.tools",
    "ToolError": "runlog.producers.tools",
    "Match": "runlog.producers.tools",
    "Absent": "runlog.producers.tools",
    "Conflict": "runlog.producers.tools",
    "Unavailable": "runlog.producers.tools",
    "Event": "runlog.schemas.models",
    "EventType": "runlog.schemas.vocabulary",
}


def __getattr__(name: str) -> Any:
    if name == "aio":  # the asyncio API, a module of its own
        return importlib.import_module("runlog.aio")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runlog' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Absent",
    "AgentLoop",
    "AppendOutcomeUnknown",
    "ApprovalStep",
    "Call",
    "CallContext",
    "CallRejected",
    "CallUncertain",
    "CompactStep",
    "ConfigError",
    "Conflict",
    "DecisionConflict",
    "Escalated",
    "Event",
    "EventType",
    "Fenced",
    "FinishStep",
    "KafkaUnavailable",
    "Match",
    "ModelStep",
    "NotADecider",
    "RedisUnavailable",
    "Run",
    "RunError",
    "RunFinished",
    "RunLocked",
    "RunlogError",
    "SchemaError",
    "ScriptedModel",
    "Settings",
    "TenantMismatch",
    "Tool",
    "ToolArgumentsError",
    "ToolError",
    "ToolFailed",
    "Unavailable",
    "UnknownRun",
    "UnknownTool",
    "append_metrics",
    "current_call",
    "decide",
    "decode",
    "encode",
    "lease_metrics",
    "open_run",
    "serve_metrics",
    "tool",
]
