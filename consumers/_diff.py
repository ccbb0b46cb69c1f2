"""Where two runs diverge, and the effects each made that the other did not (``runlog diff``).

A run's history is its valid events, without the records that only move ownership (a
start, a resumption, a fork's lineage record); a fork's history is its parent's up to the
fork point (recursively) followed by its own. Two histories are compared event by event
(type, tool, arguments, content, text); the first pair that differs is where the runs
diverge. Effects are compared by the key they completed under: one completed in one run's state
and not in the other's is that run's alone (a fork's repeat, ``LOGICAL@FORK``, is its own;
an inherited result is not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from runlog._settings import Settings
from runlog.consumers._timeline import run_timeline
from runlog.errors import UnknownRun
from runlog.log._reader import LogReader
from runlog.projections._lineage import logical_of
from runlog.projections._run_state import RunState

SKIP = frozenset({"run_started", "run_resumed", "run_forked"})
"""Records about who owns the run, not about what it did."""

Entry = dict[str, Any]


def _sig(e: Entry) -> tuple[Any, ...]:
    return (
        e["type"],
        e.get("tool"),
        e.get("args_json"),
        e.get("content"),
        e.get("result"),
        e.get("text") if e["type"] in ("model_turn", "user_message") else None,
    )


@dataclass
class History:
    run_id: str
    state: RunState
    events: list[tuple[str, Entry]] = field(default_factory=list)
    """(run that wrote it, its timeline entry), oldest first."""


def history(
    reader: LogReader, client: redis.Redis, settings: Settings, tenant: str, run_id: str
) -> History:
    """The run's history, its parents' prefixes included (as far as the log holds them)."""
    tl = run_timeline(reader, client, settings, tenant, run_id)
    own = [(run_id, e) for e in tl.entries if e["valid"] and e["type"] not in SKIP]
    lin = tl.state.lineage
    if lin is None:
        return History(run_id, tl.state, own)
    try:
        parent = history(reader, client, settings, tenant, lin.parent_run_id)
        prefix: list[tuple[str, Entry]] = []
        for rid, e in parent.events:
            if rid == lin.parent_run_id and e["seq"] > lin.at_seq:
                break
            prefix.append((rid, e))
    except UnknownRun:
        text = f"{lin.parent_run_id} to seq {lin.at_seq} (its log is not readable here)"
        gone: Entry = {"type": "prefix", "seq": lin.at_seq, "text": text}
        prefix = [(lin.parent_run_id, gone)]
    return History(run_id, tl.state, prefix + own)


@dataclass
class Diff:
    a: str
    b: str
    common: int
    """Events the two histories share before they diverge."""
    first_a: Entry | None
    first_b: Entry | None
    """The first differing event of each (None: that history ended there)."""
    only_a: list[Entry]
    only_b: list[Entry]
    """Effects (completed actions, by key) of one run that the other lacks."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _effects(h: History) -> dict[str, Entry]:
    """Key -> what the run's history says about the action completed under it. Exact keys:
    a fork's repeat or new action (``LOGICAL@FORK``) is its own effect, an inherited result
    (completed under the logical key the parent used) is not."""
    seen: dict[str, Entry] = {}
    for rid, e in h.events:
        key = e.get("idempotency_key")
        if e["type"] in ("tool_call_started", "fork_effect_resolved") and key:
            info = {"tool": e.get("tool"), "args_json": e.get("args_json"), "run_id": rid}
            seen.setdefault(key, {**info, "seq": e["seq"]})
    return {
        k: {"key": k, "logical_key": logical_of(k), **seen.get(k, {})}
        for k in sorted(h.state.completed_calls)
    }


def diff_runs(settings: Settings, client: redis.Redis, tenant: str, run_a: str, run_b: str) -> Diff:
    with LogReader(settings) as reader:
        a = history(reader, client, settings, tenant, run_a)
        b = history(reader, client, settings, tenant, run_b)
    common = 0
    for (_, ea), (_, eb) in zip(a.events, b.events, strict=False):
        if _sig(ea) != _sig(eb):
            break
        common += 1
    first_a = _at(a, common)
    first_b = _at(b, common)
    fa, fb = _effects(a), _effects(b)
    only_a = [v for k, v in sorted(fa.items()) if k not in fb]
    only_b = [v for k, v in sorted(fb.items()) if k not in fa]
    return Diff(run_a, run_b, common, first_a, first_b, only_a, only_b)


def _at(h: History, i: int) -> Entry | None:
    if i >= len(h.events):
        return None
    rid, e = h.events[i]
    return {**e, "run_id": rid}
