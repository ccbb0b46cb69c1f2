"""runlog: durable, fenced, replayable event logs for AI-agent runs on Kafka and Redis.

Users import ``runlog`` only. Every subpackage lives inside this package, so importing any
of them (``runlog.projections._run_state``, say) runs this file first: it therefore loads
nothing but the errors, and each public name below loads on first use. That keeps the
pure fold importable without Kafka, Redis, fastavro or pydantic-settings.

The public API is written once, in ``_PUBLIC`` (name -> the module that defines it):
``__all__`` and the lazy loading both come from it, and ``tests/test_public_api.py`` pins
it (adding or removing a public name fails that test until its list is updated). The
``TYPE_CHECKING`` imports below repeat it for type checkers; the same test checks they
agree. The public modules are ``_PUBLIC_MODULES``: each declares its ``__all__``; every
other module of the package is internal and may change in any release.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import TYPE_CHECKING, Any

from runlog.errors import (
    AgentMismatch as AgentMismatch,
)
from runlog.errors import (
    AppendOutcomeUnknown as AppendOutcomeUnknown,
)
from runlog.errors import (
    CallRejected as CallRejected,
)
from runlog.errors import (
    CallUncertain as CallUncertain,
)
from runlog.errors import (
    Cancelled as Cancelled,
)
from runlog.errors import (
    ConfigError as ConfigError,
)
from runlog.errors import (
    DecisionConflict as DecisionConflict,
)
from runlog.errors import (
    Escalated as Escalated,
)
from runlog.errors import (
    Fenced as Fenced,
)
from runlog.errors import (
    ForkRefused as ForkRefused,
)
from runlog.errors import (
    KafkaUnavailable as KafkaUnavailable,
)
from runlog.errors import (
    NoLiveWorker as NoLiveWorker,
)
from runlog.errors import (
    NotADecider as NotADecider,
)
from runlog.errors import (
    NotReconcilable as NotReconcilable,
)
from runlog.errors import (
    NotSettledYet as NotSettledYet,
)
from runlog.errors import (
    NotUndoable as NotUndoable,
)
from runlog.errors import (
    RedisUnavailable as RedisUnavailable,
)
from runlog.errors import (
    RunError as RunError,
)
from runlog.errors import (
    RunFinished as RunFinished,
)
from runlog.errors import (
    RunLocked as RunLocked,
)
from runlog.errors import (
    RunlogError as RunlogError,
)
from runlog.errors import (
    SchemaError as SchemaError,
)
from runlog.errors import (
    StartRefused as StartRefused,
)
from runlog.errors import (
    SubjectHasOtherRuns as SubjectHasOtherRuns,
)
from runlog.errors import (
    TenantMismatch as TenantMismatch,
)
from runlog.errors import (
    ToolArgumentsError as ToolArgumentsError,
)
from runlog.errors import (
    ToolFailed as ToolFailed,
)
from runlog.errors import (
    UnknownRun as UnknownRun,
)
from runlog.errors import (
    UnknownTool as UnknownTool,
)

# A library's loggers are the application's to show: without a handler of its own there,
# Python's last-resort handler would print runlog's (and librdkafka's) warnings to stderr.
logging.getLogger("runlog").addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from runlog import aio as aio
    from runlog import testing as testing
    from runlog._api import append_metrics as append_metrics
    from runlog._api import cancel as cancel
    from runlog._api import decide as decide
    from runlog._api import forget as forget
    from runlog._api import fork as fork
    from runlog._api import lease_metrics as lease_metrics
    from runlog._api import open_run as open_run
    from runlog._api import question as question
    from runlog._api import reconcile as reconcile
    from runlog._api import resume as resume
    from runlog._api import serve_metrics as serve_metrics
    from runlog._api import start as start
    from runlog._api import terminate as terminate
    from runlog._settings import Settings as Settings
    from runlog.consumers._question import Question as Question
    from runlog.fleet._registry import agent as agent
    from runlog.producers._context import CallContext as CallContext
    from runlog.producers._context import current_call as current_call
    from runlog.producers._forks import Fork as Fork
    from runlog.producers._handle import Run as Run
    from runlog.producers._reconcile import Reconciliation as Reconciliation
    from runlog.producers._tools import Absent as Absent
    from runlog.producers._tools import Conflict as Conflict
    from runlog.producers._tools import Inconclusive as Inconclusive
    from runlog.producers._tools import Match as Match
    from runlog.producers._tools import Tool as Tool
    from runlog.producers._tools import ToolError as ToolError
    from runlog.producers._tools import tool as tool
    from runlog.schemas._codec import decode as decode
    from runlog.schemas._codec import encode as encode
    from runlog.schemas._models import Event as Event
    from runlog.schemas._vocabulary import EventType as EventType

_ERRORS = "runlog.errors"

# THE list of public names: name -> the module it is loaded from on first use. A module
# listed under its own name (``aio``, ``testing``) is a public submodule.
_PUBLIC: dict[str, str] = {
    # runs, decisions, the question a person answers
    "open_run": "runlog._api",
    "Run": "runlog.producers._handle",
    "decide": "runlog._api",
    "cancel": "runlog._api",
    "terminate": "runlog._api",
    "reconcile": "runlog._api",
    "Reconciliation": "runlog.producers._reconcile",
    "forget": "runlog._api",
    "fork": "runlog._api",
    "Fork": "runlog.producers._forks",
    "question": "runlog._api",
    "Question": "runlog.consumers._question",
    # the fleet: agents by name, durable start requests, dispatch now
    "agent": "runlog.fleet._registry",
    "start": "runlog._api",
    "resume": "runlog._api",
    # tools
    "tool": "runlog.producers._tools",
    "Tool": "runlog.producers._tools",
    "ToolError": "runlog.producers._tools",
    "Match": "runlog.producers._tools",
    "Absent": "runlog.producers._tools",
    "Conflict": "runlog.producers._tools",
    "Inconclusive": "runlog.producers._tools",
    "current_call": "runlog.producers._context",
    "CallContext": "runlog.producers._context",
    # events and settings
    "Event": "runlog.schemas._models",
    "EventType": "runlog.schemas._vocabulary",
    "encode": "runlog.schemas._codec",
    "decode": "runlog.schemas._codec",
    "Settings": "runlog._settings",
    # telemetry
    "lease_metrics": "runlog._api",
    "append_metrics": "runlog._api",
    "serve_metrics": "runlog._api",
    # public submodules
    "aio": "runlog.aio",
    "testing": "runlog.testing",
    # errors (loaded with this file: they are light and every caller catches them)
    "RunlogError": _ERRORS,
    "ConfigError": _ERRORS,
    "SchemaError": _ERRORS,
    "RunError": _ERRORS,
    "Fenced": _ERRORS,
    "ForkRefused": _ERRORS,
    "SubjectHasOtherRuns": _ERRORS,
    "RunLocked": _ERRORS,
    "AppendOutcomeUnknown": _ERRORS,
    "TenantMismatch": _ERRORS,
    "StartRefused": _ERRORS,
    "AgentMismatch": _ERRORS,
    "UnknownRun": _ERRORS,
    "RunFinished": _ERRORS,
    "Escalated": _ERRORS,
    "Cancelled": _ERRORS,
    "CallUncertain": _ERRORS,
    "CallRejected": _ERRORS,
    "ToolFailed": _ERRORS,
    "ToolArgumentsError": _ERRORS,
    "UnknownTool": _ERRORS,
    "DecisionConflict": _ERRORS,
    "NotADecider": _ERRORS,
    "NotUndoable": _ERRORS,
    "NotReconcilable": _ERRORS,
    "NoLiveWorker": _ERRORS,
    "NotSettledYet": _ERRORS,
    "KafkaUnavailable": _ERRORS,
    "RedisUnavailable": _ERRORS,
}

# The public modules: each declares ``__all__`` (tests/test_public_api.py checks it), and
# the code examples in README.md and docs/ import from these only (tests/test_docs.py).
_PUBLIC_MODULES = (
    "runlog",
    "runlog.aio",
    "runlog.testing",
    "runlog.errors",
    "runlog.integrations.pydantic_ai",
    "runlog.integrations.langgraph",
    "runlog.integrations.openai_agents",
    "runlog.integrations.pydantic_ai_capability",
)


# Old public names, kept one release: each still works and warns (DeprecationWarning) on
# access. Not in ``__all__``; tests/test_public_api.py pins this table too.
_DEPRECATED: dict[str, tuple[str, str]] = {
    # name -> (its new name, why it was renamed)
    "Unavailable": (
        "Inconclusive",
        "it is a reconciler's evidence (the lookup could not tell), not an error",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, why = _DEPRECATED[name]
        warnings.warn(
            f"runlog.{name} is deprecated: use runlog.{new} ({why})",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__(new)
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'runlog' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if module == f"runlog.{name}" else getattr(loaded, name)
    globals()[name] = value
    return value


__all__ = sorted(_PUBLIC)
