"""One event's path through the code, as it runs: the files it passes through.

The trace follows one ``USER_MESSAGE`` from ``Run.append`` to its acknowledgement (before
Kafka) and from the projection runner's batch to the state projection's Redis write
(after), on the real stack, and records every runlog file a Python function of it runs in.
Each of those files must be a station that ``docs/architecture.md`` names in its table of
one event's stations, and there may be no more of them than ``LIMIT``.

What runs once per run or per process (opening the run, the runner's first assignment,
compiling a schema's encoder) is warmed up first: the trace is of the steady state, the
cost every later event pays.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

import runlog
from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner
from runlog.schemas._vocabulary import EventType

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(runlog.__file__).resolve().parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

GOAL = 7
"""Files one event passes through, both sides together: issue 43's goal."""
LIMIT = 13
"""Today's bound: the trace fails above it. Lower it as stations merge; the goal is GOAL."""


def _repo_path(filename: str) -> str | None:
    """``filename`` relative to the repository when it is one of runlog's files (the
    owner's folders are symlinked into the package: both spellings name one file)."""
    path = Path(filename).resolve()
    for base in (ROOT, PACKAGE.parent):
        try:
            rel = path.relative_to(base)
        except ValueError:
            continue
        top = rel.parts[0] if rel.parts else ""
        if top in ("runlog", "producers", "consumers", "projections", "schemas"):
            return rel.as_posix()
    return None


def traced(fn: Callable[[], Any]) -> set[str]:
    """The runlog files in which a Python function was called while ``fn`` ran, in this
    thread and in threads it started."""
    seen: set[str] = set()
    names: dict[str, str | None] = {}

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if filename not in names:
            names[filename] = _repo_path(filename)
        rel = names[filename]
        if rel is not None:
            seen.add(rel)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return seen


def stations() -> set[str]:
    """The files docs/architecture.md names as one event's stations (its table's first
    column, under "One event's stations")."""
    text = ARCHITECTURE.read_text()
    start = text.index("One event's stations")
    table = text[start:].split("\n\n", 2)[1]
    found = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([\w/.]+\.py)`", cells[0]) if cells else None
        if m:
            found.add(m.group(1))
    return found


def _one_event(settings: Settings, client: redis.Redis) -> tuple[set[str], set[str]]:
    with runlog.open_run(tenant="t", settings=settings) as run:
        for i in range(5):
            run.append(EventType.USER_MESSAGE, content=f"warm {i}")
        runner = ProjectionRunner(settings, client, ["state"])
        runner.catch_up()
        before = traced(lambda: run.append(EventType.USER_MESSAGE, content="one"))
        handle = runner._handle
        after: set[str] = set()
        batches: list[int] = []

        def traced_handle(msgs: list[Any]) -> None:
            batches.append(len(msgs))
            after.update(traced(lambda: handle(msgs)))

        runner._handle = traced_handle  # type: ignore[method-assign]
        runner.catch_up()
    assert sum(batches) >= 1, "the runner never handled the traced event"
    return before, after


def test_one_event_passes_only_through_the_stations_the_architecture_page_names(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    before, after = _one_event(test_settings, redis_client)
    files = before | after
    named = stations()
    assert named, "docs/architecture.md has no table of one event's stations"
    unnamed = sorted(files - named)
    assert not unnamed, f"the event passes through files the architecture page omits: {unnamed}"
    report = (
        f"{len(files)} files (goal {GOAL}, limit {LIMIT}); before Kafka: {sorted(before)}; "
        f"after: {sorted(after)}"
    )
    assert len(files) <= LIMIT, report
    assert "producers/_handle.py" in before and "projections/_run_state.py" in after, report


def test_the_trace_sees_a_file_the_event_passes_through(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """The tracer itself: a station that is certainly on the path is recorded, and a
    file that is not (the CLI) is not."""
    with runlog.open_run(tenant="t", settings=test_settings) as run:
        run.append(EventType.USER_MESSAGE, content="warm")
        seen = traced(lambda: run.append(EventType.USER_MESSAGE, content="one"))
    assert "producers/_engine.py" in seen
    assert not any(f.startswith("runlog/cli/") for f in seen)
