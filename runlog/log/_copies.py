"""Every place runlog keeps a run's content outside its log: the list erasure works from.

The log is the only authority; each place below is a cache of it, or a request on its way
into it, and may hold a person's words in plaintext (sealing protects the log's records,
not what sits beside them). ``runlog forget`` reaches each of them, in the way its line
says, and ``docs/howto/erasure.md`` lists them for an auditor. A new place that keeps
content is added here first: ``forget`` purges what this list names and nothing else.

Two ways a copy goes:

- ``DELETE``: a key of the run's own (``<prefix>:{tenant:run}:...``) that only serves the
  run while it can still act on it; ``forget`` deletes it once the run is stopped and its
  erasure is in the log (``run_keys``, ``run_key_patterns``). A queued item that had not
  been recorded yet is lost with it, which is what erasing it means: the run is over.
- ``FOLD``: a projection's keys; each projection runner scrubs them when it folds the
  run's CONTENT_ERASED (``consumers._erasure``), exactly once and again on a rebuild.
  ``forget`` waits for every projection to have done so and says which did not.

Redis's AOF and RDB keep what was overwritten until Redis rewrites them: after either way,
``forget`` has Redis rewrite both (``consumers._erasure.rewrite_persistence``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runlog.schemas._keys import run_tag

How = Literal["delete", "fold"]
DELETE: How = "delete"
FOLD: How = "fold"

INBOX = "decisions"
"""Suffix of a run's inbox (a list): cancellations with their reasons and decisions with
their notes, queued while another process owns the run."""
MALFORMED = INBOX + ":malformed"
"""Suffix of the inbox entries that did not parse, set aside by the owner (whole)."""
CANCEL_FLAG = "cancel"
"""Suffix of the flag set beside a queued cancellation (what a step's one GET reads)."""
SNAPSHOT = "snap"
"""Suffix of a run's snapshot pointer; its bodies are ``snap:<seq>``."""


@dataclass(frozen=True)
class Copy:
    """One place that keeps content of a run outside its log."""

    name: str
    where: str
    """The Redis key (or keys), as an operator finds them."""
    holds: str
    """Which content."""
    how: How
    """How ``forget`` reaches it (module docstring)."""
    suffix: str = ""
    """``DELETE``: the key's suffix after the run's tag (``<prefix>:{tenant:run}:``); with
    ``many``, a pattern's (the keys' names are not known beforehand)."""
    many: bool = False
    projection: str = ""
    """``FOLD``: the projection whose runner purges it ('' every projection's)."""


COPIES: tuple[Copy, ...] = (
    Copy(
        "inbox",
        "<prefix>:{tenant:run}:decisions",
        "queued cancellations (reason, who) and decisions (note, answer, who)",
        DELETE,
        INBOX,
    ),
    Copy(
        "set-aside inbox entries",
        "<prefix>:{tenant:run}:decisions:malformed",
        "inbox entries that did not parse, as they were written",
        DELETE,
        MALFORMED,
    ),
    Copy(
        "cancel flag",
        "<prefix>:{tenant:run}:cancel",
        "that a cancellation waits",
        DELETE,
        CANCEL_FLAG,
    ),
    Copy(
        "snapshots",
        "<prefix>:{tenant:run}:snap, <prefix>:{tenant:run}:snap:<seq>",
        "a partial fold of the run: its conversation, tool arguments and results",
        DELETE,
        SNAPSHOT,
    ),
    Copy(
        "snapshot bodies",
        "<prefix>:{tenant:run}:snap:<seq>:<id>",
        "the same, advertised or left by a crash between a body and its pointer",
        DELETE,
        SNAPSHOT + ":*",
        many=True,
    ),
    Copy(
        "state projection",
        "<prefix>:proj:state:{topic:p}:run|msgs|calls|appr|done|sum:<run>",
        "the run's folded state: conversation, arguments, results, summary",
        FOLD,
        projection="state",
    ),
    Copy(
        "uncertain-call queue",
        "<prefix>:proj:uncertain:{topic:p}:open",
        "open calls with their arguments and last error or evidence",
        FOLD,
        projection="uncertain",
    ),
    Copy(
        "audit log",
        "<prefix>:proj:audit:{topic:p}:log:<run>",
        "who did what, with reasons, notes and details",
        FOLD,
        projection="audit",
    ),
    Copy(
        "notify queue",
        "<prefix>:proj:notify:{topic:p}:pending, <prefix>:proj:notify:dlv:{topic:p}",
        "approval requests waiting for a person and the notifications owed or delivered",
        FOLD,
        projection="notify",
    ),
    Copy(
        "quarantine",
        "<prefix>:proj:<projection>:{topic:p}:quarantine",
        "records a projection could not decode, as their bytes",
        FOLD,
    ),
)
"""Every copy, in the order ``forget`` reaches them. Not here: the lifecycle topic's start
requests (a Kafka topic, compacted: ``forget`` tombstones a request no worker took), and
set-aside decisions (``log.setaside``: an operator's words about a record, not its bytes)."""


def inbox_key(prefix: str, tenant: str, run_id: str) -> str:
    return f"{run_tag(prefix, tenant, run_id)}:{INBOX}"


def malformed_key(prefix: str, tenant: str, run_id: str) -> str:
    return f"{run_tag(prefix, tenant, run_id)}:{MALFORMED}"


def cancel_flag_key(prefix: str, tenant: str, run_id: str) -> str:
    return f"{run_tag(prefix, tenant, run_id)}:{CANCEL_FLAG}"


def snapshot_key(prefix: str, tenant: str, run_id: str) -> str:
    return f"{run_tag(prefix, tenant, run_id)}:{SNAPSHOT}"


def run_keys(prefix: str, tenant: str, run_id: str) -> list[str]:
    """The run's own keys that ``forget`` deletes: every ``DELETE`` copy of a known name."""
    tag = run_tag(prefix, tenant, run_id)
    return [f"{tag}:{c.suffix}" for c in COPIES if c.how == DELETE and not c.many]


def run_key_patterns(prefix: str, tenant: str, run_id: str) -> list[str]:
    """SCAN patterns of the run's keys ``forget`` deletes whose names it cannot know: every
    ``DELETE`` copy of many keys (the snapshot bodies)."""
    tag = run_tag(prefix, tenant, run_id)
    return [f"{tag}:{c.suffix}" for c in COPIES if c.how == DELETE and c.many]
