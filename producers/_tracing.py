"""OpenTelemetry spans, when the 'otel' extra is installed; nothing at all otherwise.

A run shows up in the tracing a team already uses: ``runlog.open_run`` (start or resume),
``runlog.decide``, ``runlog.tool_call`` (every invocation of a tool, live or a retry during
recovery) and ``runlog.reconcile`` (every reconciliation lookup recovery makes), with the
run id, tenant, epoch, seq and idempotency key as ``runlog.*`` attributes. Spans go to
whatever tracer provider the application configured (none: OpenTelemetry's no-op).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import trace as _otel
except ImportError:  # the 'otel' extra is not installed: every span below is a no-op
    _otel = None  # type: ignore[assignment]

Attr = str | int | float | bool


class _NoSpan:
    """Stands in for a span when OpenTelemetry is absent."""

    def set_attribute(self, key: str, value: Attr) -> None:
        """Nothing to record."""


_UNSET = ("ProxyTracerProvider", "NoOpTracerProvider")


def enabled() -> bool:
    """A tracer provider is configured: without one every span would be OpenTelemetry's
    no-op, and building it costs a tool call more than the rest of its bookkeeping."""
    return _otel is not None and type(_otel.get_tracer_provider()).__name__ not in _UNSET


def _attrs(attrs: dict[str, Attr | None]) -> dict[str, Attr]:
    return {f"runlog.{k}": v for k, v in attrs.items() if v is not None}


@contextmanager
def span(name: str, **attrs: Attr | None) -> Iterator[Any]:
    """A span named ``runlog.<name>`` around the block; exceptions are recorded on it."""
    if not enabled():
        yield _NoSpan()
        return
    tracer = _otel.get_tracer("runlog")
    with tracer.start_as_current_span(f"runlog.{name}", attributes=_attrs(attrs)) as current:
        yield current


def annotate(current: Any, **attrs: Attr | None) -> None:
    """Attributes learnt inside the block (a new run's id, the epoch it got)."""
    for key, value in _attrs(attrs).items():
        current.set_attribute(key, value)
