"""How a record written with an older version of a type becomes the current version.

Each step ``vN -> vN+1`` of a type is exactly one of:

* **compatible**: the meaning did not change (e.g. a new optional field with a default);
  Avro schema resolution does the work;
* **upcast**: the meaning changed; a named function rewrites the payload dict;

A step that is neither raises ``MissingUpcaster``: the reader never guesses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runlog.schemas._sealing import SEALED_SINCE
from runlog.schemas._vocabulary import EventType

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

# (type, from_version): the step from_version -> from_version + 1 is plain Avro resolution.
COMPATIBLE_STEPS: frozenset[tuple[EventType, int]] = frozenset(
    {
        # v2 adds the optional ``duration_ms`` (default null): same facts, one more.
        (EventType.TOOL_CALL_COMPLETED, 1),
        # v2 adds the optional ``response_json`` (default null): the whole response a
        # framework returned, beside the text, proposals and usage v1 already recorded.
        (EventType.MODEL_TURN, 1),
        # v2 adds the optional ``dedupes_by_key`` and ``compensable`` (default null): what
        # the tool declared about a retry, so a reader without the tools (the CLI, the
        # console) can say what a person's decision does; null in v1 is "not recorded".
        (EventType.TOOL_CALL_STARTED, 1),
        # v2 adds the optional ``due_at`` (default null): when the decision is due; a v1
        # request had no deadline, which is exactly what null says.
        (EventType.APPROVAL_REQUESTED, 1),
        # v2 adds the optional ``decided_at``, ``key_id`` and ``signature`` (default null): a
        # decider's signature (schemas._signing). A v1 decision resolves as unsigned: what it
        # was, and what a reader that trusts decider keys refuses.
        (EventType.APPROVAL_DECIDED, 1),
        # v2 adds the optional ``operator`` (default null): the person whose act the
        # ownership move records. A v1 resumption resolves as a worker's, which is what
        # every v1 writer but the decision path meant (its decisions stay counted).
        (EventType.RUN_RESUMED, 1),
        # v3 adds the optional ``answer`` (default null): a third answer, "undo and retry",
        # beside approve and reject. A v2 decision resolves with null: approved or rejected,
        # exactly what it said.
        (EventType.APPROVAL_DECIDED, 2),
        # v2 adds the optional ``code_version`` and ``input_json`` (default null): which
        # code of a registered agent started the run, and its input. A v1 start was not
        # made by the agent registry, which is exactly what null says.
        (EventType.RUN_STARTED, 1),
        # RUN_FORKED v3 makes ``state`` a union of ``string`` and ``runlog.Sealed`` and adds
        # the optional ``subject`` (default null: the fork is its own subject, as every
        # older fork was). A v2 fork's state resolves into the string branch unchanged.
        (EventType.RUN_FORKED, 2),
    }
    # The sealed versions (``runlog.schemas._sealing``): each content field becomes a union
    # of ``string`` and ``runlog.Sealed``. An older record's plaintext resolves into the
    # string branch, so it stays exactly what it said. RUN_STARTED v3 also adds the optional
    # ``subject`` (default null: the run is its own subject, as every older run was).
    | {(et, since - 1) for et, since in SEALED_SINCE.items()}
)


def upcast_context_compacted_v1_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 ``kept`` counted MESSAGES retained at the tail; v2 counts turns (``kept_turns``).

    Messages cannot be turned into turns without the state the record was applied to, so
    the upcast keeps the exact fact it has: ``kept_messages`` = v1 ``kept``, and
    ``kept_turns`` unknown (null). The fold uses ``kept_messages`` whenever it is set, so
    an upcast record rebuilds exactly the context the v1 run had.
    """
    out = {k: v for k, v in payload.items() if k != "kept"}
    out["kept_messages"] = payload["kept"]
    out["kept_turns"] = None
    return out


# (type, from_version): the payload upcaster for the step from_version -> from_version + 1.
UPCASTERS: dict[tuple[EventType, int], Upcaster] = {
    (EventType.CONTEXT_COMPACTED, 1): upcast_context_compacted_v1_v2,
}
