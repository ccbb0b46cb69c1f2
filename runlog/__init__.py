"""runlog: durable, fenced, replayable event logs for AI-agent runs on Kafka and Redis.

Users import ``runlog`` only. Errors and settings load eagerly; the worker API loads on
first use so that ``schemas`` and ``projections`` (which use ``runlog.errors``) never
import Kafka or Redis clients.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from runlog.errors import (
    AppendOutcomeUnknown,
    CallRejected,
    CallUncertain,
    ConfigError,
    Escalated,
    Fenced,
    KafkaUnavailable,
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
from runlog.settings import Settings

if TYPE_CHECKING:
    from producers.agent import (
        AgentLoop,
        ApprovalStep,
        Call,
        CompactStep,
        FinishStep,
        ModelStep,
        ScriptedModel,
    )
    from producers.context import CallContext, current_call
    from producers.run import Run
    from producers.tools import Absent, Conflict, Match, Tool, ToolError, Unavailable, tool
    from runlog.api import decide, lease_metrics, open_run
    from schemas.codec import decode, encode
    from schemas.models import Event
    from schemas.vocabulary import EventType

_LAZY = {
    "open_run": "runlog.api",
    "current_call": "producers.context",
    "decode": "schemas.codec",
    "encode": "schemas.codec",
    "lease_metrics": "runlog.api",
    "CallContext": "producers.context",
    "decide": "runlog.api",
    "AgentLoop": "producers.agent",
    "ScriptedModel": "producers.agent",
    "ModelStep": "producers.agent",
    "Call": "producers.agent",
    "CompactStep": "producers.agent",
    "ApprovalStep": "producers.agent",
    "FinishStep": "producers.agent",
    "Run": "producers.run",
    "tool": "producers.tools",
    "Tool": "producers.tools",
    "ToolError": "producers.tools",
    "Match": "producers.tools",
    "Absent": "producers.tools",
    "Conflict": "producers.tools",
    "Unavailable": "producers.tools",
    "Event": "schemas.models",
    "EventType": "schemas.vocabulary",
}


def __getattr__(name: str) -> Any:
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
    "Escalated",
    "Event",
    "EventType",
    "Fenced",
    "FinishStep",
    "KafkaUnavailable",
    "Match",
    "ModelStep",
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
    "current_call",
    "decide",
    "decode",
    "encode",
    "lease_metrics",
    "open_run",
    "tool",
]
