"""Agents registered by name: ``@runlog.agent("billing", tools=[...])``.

An agent is a function ``(run, input) -> summary``; an ``async def`` one receives an
``AsyncRun``. The registry is per process: a worker imports the modules named by
``--agents`` and executes the agents they registered.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runlog.errors import ConfigError
from runlog.producers._tools import Tool

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RetryPolicy:
    """How often a failed agent is tried again before its run ends failed: ``retries``
    durable retries, the n-th after ``delay_s * backoff**n`` seconds (a timer in the log,
    so a retry waits on no worker)."""

    retries: int = 0
    delay_s: float = 1.0
    backoff: float = 2.0

    def delay(self, used: int) -> float:
        return float(self.delay_s * self.backoff**used)


@dataclass(frozen=True)
class Agent:
    name: str
    fn: Callable[..., Any]
    tools: tuple[Tool, ...] = ()
    version: str = ""
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


_REGISTRY: dict[str, Agent] = {}


def _code_version(fn: Callable[..., Any]) -> str:
    """A digest of the function's source: changes when its code does."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        src = f"{fn.__module__}.{fn.__qualname__}"
    return "src-" + hashlib.sha256(src.encode()).hexdigest()[:12]


def agent(
    name: str,
    *,
    tools: Iterable[Tool] = (),
    version: str | None = None,
    retries: int = 0,
    retry_delay_s: float = 1.0,
    retry_backoff: float = 2.0,
) -> Callable[[F], F]:
    """Register ``fn(run, input) -> summary`` as the agent ``name`` of this process.

    ``version``: the code version recorded in each run it starts (default a digest of the
    function's source). Returning finishes the run ``succeeded`` with the summary;
    ``runlog.Escalated`` leaves it waiting for a person; another exception is recorded
    with its traceback and ends the run ``failed``, after ``retries`` durable retries.
    The function is executed again from the top whenever the run is dispatched again (a
    resume, a wake-up): completed tool calls return their recorded results.
    """
    if not name or len(name) > 200:
        raise ConfigError(f"agent name {name!r}: 1 to 200 characters")

    def register(fn: F) -> F:
        if not callable(fn):
            raise ConfigError(f"agent {name!r}: {fn!r} is not callable")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.fn.__qualname__ != fn.__qualname__:
            raise ConfigError(f"agent {name!r} is already registered ({existing.fn.__qualname__})")
        _REGISTRY[name] = Agent(
            name=name,
            fn=fn,
            tools=tuple(tools),
            version=version or _code_version(fn),
            retry=RetryPolicy(retries, retry_delay_s, retry_backoff),
        )
        return fn

    return register


def registered() -> dict[str, Agent]:
    return dict(_REGISTRY)


def get(name: str) -> Agent | None:
    return _REGISTRY.get(name)


def load(modules: Iterable[str]) -> dict[str, Agent]:
    """Import ``modules`` (dotted names); returns the agents registered afterwards."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            raise ConfigError(f"cannot import agents module {mod!r}: {exc}") from exc
    if not _REGISTRY:
        raise ConfigError(f"no agent registered by {', '.join(modules)} (use @runlog.agent)")
    return registered()
