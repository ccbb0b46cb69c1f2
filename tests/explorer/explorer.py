"""A model-based fault explorer on the real stack: seeded histories, invariants, shrinking.

    python tests/explorer/explorer.py run --seed 7 --steps 40 [--keep 0,3,9]
    python tests/explorer/explorer.py forever [--steps 40]      # random seeds until one fails

A seed deterministically generates a history of steps: operations (start, resume and
take over real worker processes, sync or asyncio with every call at once, under run ids
of every shape a caller may choose and tenants from hostile alphabets; queue receiver
and reconciler faults for a tool call; approve or reject what a run asks a person,
through the API, the CLI, the console (a real ``runlog ui`` process, over HTTP with a
token of the run's tenant, as a person) or the run's owner, with its worker killed first
or one running, and contradict a decision already taken; start, stop, kill and pause
projection runners) interleaved with faults (SIGKILL and SIGSTOP/SIGCONT of workers and
runners, a ``runlog rebuild`` killed part way, the schema registry paused or refusing
connections in the histories that write Confluent's wire format through one
(``REGISTRY_SHARE``), Redis restarted with its data, without it or rolled back to an older
copy, a partition leader killed or a broker restarted, partitions added
to the events topic, hostile records produced into it), and a worker frozen inside a
call of each tool kind while its run is taken over and the call reconciled
(``pause_call``: SIGSTOP, takeover, SIGCONT). Steps name their targets by
index ("the 2nd live worker"), so a history still means something with any of its steps
dropped: that is what shrinking relies on. Timing is real (processes, brokers), so a
replay is the same history, not the same interleaving to the microsecond.

After every step the checker looks at what can be checked cheaply (no effect doubled,
no worker stopped with an unclear error, every run's log sound); at the end it heals
every fault, drives every run until it finishes or waits for a person, and checks all of
the invariants (see ``Checker``). A failing history is shrunk by dropping steps and
re-running, and printed with the command that replays it.

It runs on the 3-node cluster (``runlog stack up --nodes 3``, ports from
``RUNLOG_CLUSTER_*``) with its own topics and Redis key prefix per execution; Redis
restarts restart the cluster's Redis. The receivers' ledger lives in a private Redis
(``EXPLORER_LEDGER_PORT``, default the cluster's Redis port + 1) that no fault touches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
sys.path[:0] = [str(ROOT), str(TESTS), str(TESTS / "faults")]

import redis  # noqa: E402
from workers.common import FAST_TAKEOVER, worker_env  # noqa: E402

from runlog import stack  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog._topics import ensure_topics  # noqa: E402
from runlog.log._reader import START_SKEW_MS, LogReader  # noqa: E402
from runlog.projections._run_state import RunState, accept, apply  # noqa: E402
from runlog.schemas._keys import MAX_RUN_ID_LEN, partition_for, tenant_problem  # noqa: E402
from runlog.schemas._models import Event  # noqa: E402
from runlog.schemas._vocabulary import EventType  # noqa: E402

WORKER = HERE / "worker.py"
SEEDS_FILE = HERE / "seeds.json"
TOOLS = ("probe", "refund", "charge", "ticket")
MODES = (
    "refuse",
    "fail-before",
    "fail-after",
    "timeout",
    "timeout-after",
    "huge",
    "odd",
    "conflict",
)
MAX_RUNS = 5
MAX_WORKERS_PER_RUN = 2
MAX_RUNNERS = 2
PAD_RUNS = 500
"""Finished runs a history's first rebuild kill adds to the log (``Explorer.pad``)."""
LEASE_TTL_MS = 2000
PARTITIONS = 3
# Step kinds that act on one of the runs (chosen by the step's ``a``): skipped while none exists.
STEPS_ON_A_RUN = (
    "resume",
    "takeover",
    "receiver_fault",
    "recon_unavailable",
    "decide",
    "decide_again",
)
EXIT_NAMES = {
    0: "ok",
    1: "UNCLEAR",
    3: "Fenced",
    4: "RunLocked",
    5: "Escalated",
    6: "CallUncertain",
    7: "ToolFailed",
    9: "ConfigError",
    10: "Unavailable",
    11: "InvalidTenant",
    -9: "SIGKILL",
}

# --------------------------------------------------------------------------- generator

# kind -> weight. Cluster-only kinds are left out when the stack has one broker.
WEIGHTS: dict[str, int] = {
    "start": 6,
    "resume": 7,
    "takeover": 3,
    "kill_worker": 9,
    "pause_worker": 3,
    "receiver_fault": 10,
    "recon_unavailable": 3,
    "decide": 6,
    "wait": 6,
    "runner_start": 3,
    "runner_stop": 1,
    "runner_kill": 2,
    "runner_pause": 1,
    "redis_restart": 2,
    "redis_wipe": 2,
    "redis_save": 2,
    "redis_rollback": 2,
    "leader_kill": 1,
    "broker_restart": 1,
    "hostile": 3,
    "add_partitions": 1,
}
CLUSTER_KINDS = {"leader_kill", "broker_restart"}

# Kinds added after seeds were first recorded. They are drawn from a second stream of the
# seed (``generate``), inserted after a step of the first stream, so an old seed keeps its
# sequence of the kinds above (with their a and b) and gains some of these in between; its
# last steps move past ``steps`` when these are inserted.
NEW_WEIGHTS: dict[str, int] = {
    "decide_again": 3,
    # A rebuild SIGKILLed part way (``runlog rebuild all``): the projections must still
    # equal a rebuild from zero at the end.
    "rebuild_kill": 2,
}
NEW_RATE = 0.12
"""Chance that a step of the first stream is followed by one of ``NEW_WEIGHTS``."""

# A share of the histories write Confluent's wire format through a schema registry (a real
# Apicurio, started once per session, behind a gate) and have registry outages inserted
# between their steps, drawn from a stream of their own (``with_registry_outages``): the
# registry SIGSTOPped (it accepts, never answers: clients time out) or its gate refusing
# connections (it is down), until the next step. Apicurio keeps its ids in memory, so it is
# paused or shut out, never killed: a restarted one would have forgotten every id, which no
# durable registry does.
REGISTRY_SHARE = 0.3
REGISTRY_OUTAGE_RATE = 0.08
"""In a registry history: chance that a step is followed by an outage (one at least)."""
REGISTRY_OUTAGE_S = 3.0
"""How long an outage lasts: the steps that start within it meet it too."""
REGISTRY_TIMEOUT_MS = 1500
"""Every client's registry timeout in a registry history (a paused registry is a timeout)."""

# How a ``start`` names its run: each shape a caller may choose. Minted-looking ids
# ("r" + 12 hex digits of ms + 16) whose time is far ahead, just past the reader's skew
# (it becomes "reachable" during the history), behind, now, or not hex at all.
RUN_ID_SHAPES: dict[str, int] = {
    "plain": 8,
    "minted-future-far": 2,
    "minted-future-near": 2,
    "minted-past": 2,
    "minted-now": 2,
    "minted-odd": 1,
    "uuid": 2,
    "long": 1,
    "odd-chars": 2,
}
# Tenant names a run is started under: valid ones from several alphabets, and ones
# runlog must refuse (InvalidTenant): the worker exits EXIT_INVALID_TENANT, nothing else.
TENANTS: tuple[str, ...] = (
    "default",
    "acme",
    "Zürich-Ωmega",
    "東京支店",
    "big corp inc",
    "o'neil & sons, ltd. (#1) / \\ ~!",
    "日本語 und Deutsch 🙂",
    "a:b",
    "{hash",
    "tag}",
    "}lead",
    "*",
    "evil\u202eacme",
    "zero\u200bwidth",
    "nbsp\u00a0name",
    "tab\tname",
    "",
)
TENANT_WEIGHTS = (20, 3, 2, 2, 2, 2, 2, *(0.5,) * 10)
MODES_OF_A_RUN = {"sync": 4, "async": 1}
DECIDE_CHANNELS = ("api", "cli", "owner")
CONSOLE_SHARE = 0.5
"""Of the decisions drawn for the API, the share taken in the console instead (drawn from a
stream of its own, ``through_the_console``, so the older streams of a seed are unchanged)."""
# Who holds the run when a person decides: whatever the history left, its worker killed
# first (nobody: the decision is appended at once), or a worker started just before.
OWNER_STATES = ("as-is", "kill-first", "owner-live")
TOOL_SET = "|".join(TOOLS)

# A worker frozen inside a call (``pause_call``), for every tool kind: a run of its own whose
# one call is held (the fault ``hold``) just before its request goes to the receiver; the
# worker is SIGSTOPped there, its run taken over (the lease broken at once, or left to
# expire as after a GC pause) and the call reconciled by the new owner, then the worker is
# SIGCONTed and its request goes on. The tools (tests/explorer/worker.py): every risk, and
# every receiver declaration, none included. (risk and lookup, what the receiver declares)
PAUSE_TOOLS: dict[str, tuple[str, str]] = {
    "probe": ("safe, no lookup", "nothing"),
    "refund": ("reversible, lookup, compensate", "fenced"),
    "charge": ("irreversible, lookup", "fenced"),
    "ticket": ("irreversible, no lookup", "nothing"),
    "wire": ("irreversible, lookup", "deadline"),
    "credit": ("irreversible, lookup", "dedupes_by_key"),
    "letter": ("irreversible, lookup", "nothing"),
}
RETRY_ALLOWED = frozenset(("refund", "charge", "wire", "credit"))
"""Risky tools whose receiver declaration makes a lookup's "absent" final, so recovery may
retry them: an effect doubled after a pause is a violation, whatever a person approved."""
DECLARES_NOTHING = frozenset(("ticket", "letter"))
"""Risky tools whose receiver declares nothing: never retried on "absent" (nor without a
lookup) before a person decided; recovery waits or asks, and records the rule why."""
PAUSE_STEPS_PER = 30
"""A history gets one ``pause_call`` per this many steps (one at least)."""
NETWORK = bool(os.environ.get("EXPLORER_NETWORK"))
"""``EXPLORER_NETWORK=1``: histories also cut brokers from the controller quorum
(``quorum_cut`` steps, from a stream of the seed's own: ``network_faults``). Off by
default, so a recorded seed's history is what it was; on, a seed still names one history."""
NETWORK_STEPS_PER = 15
"""With ``NETWORK``, one ``quorum_cut`` per this many steps (one at least)."""
SKEW_STEPS_PER = 12
"""With ``NETWORK``, one ``clock_skew`` per this many steps (one at least)."""
CUT_STEPS_PER = 10
"""With ``NETWORK``, one ``worker_cut`` per this many steps (one at least)."""
LINK_STEPS_PER = 10
"""With ``NETWORK``, one ``worker_link`` per this many steps (one at least)."""
LINK_FAULTS = ("loss", "flap", "delay")
"""A ``worker_link``'s fault (``b``): 20-40 % of packets lost, cut and healed in turn every
half second, or every byte held 100-500 ms each way."""
CUT_SERVICES = ("redis", "kafka")
CUT_DIRECTIONS = ("both", "out", "in")
"""A ``worker_cut``'s link (``b``): to Redis or to the brokers, both ways or one way."""
SKEWS_S = (30.0, -30.0, 0.0)
"""The wall-clock offsets a ``clock_skew`` step gives the workers started after it (``b``
picks one): 30 s ahead, 30 s behind, or the real clock again."""
PAUSE_HOWS = ("break", "expire")
"""How the run is taken over: its lease broken at once (``takeover=True``), or left to
expire (the frozen worker's session and lease time out) and the run resumed."""


@dataclass(frozen=True)
class Step:
    kind: str
    a: int = 0
    b: int = 0
    arg: str = ""

    def text(self) -> str:
        extra = f" {self.arg}" if self.arg else ""
        return f"{self.kind}(a={self.a}, b={self.b}{extra})"


def _pick(rng: random.Random, table: dict[str, int]) -> str:
    return rng.choices(list(table), list(table.values()))[0]


def start_arg(rng: random.Random) -> str:
    shape = _pick(rng, RUN_ID_SHAPES)
    tenant = rng.choices(range(len(TENANTS)), TENANT_WEIGHTS)[0]
    return f"{shape} t{tenant} {_pick(rng, MODES_OF_A_RUN)}"


def decide_arg(rng: random.Random) -> str:
    return f"{rng.choice(DECIDE_CHANNELS)} {rng.choice(OWNER_STATES)}"


def new_step(rng: random.Random) -> Step:
    kind = _pick(rng, NEW_WEIGHTS)
    a, b = rng.randrange(1000), rng.randrange(1000)
    arg = rng.choice(DECIDE_CHANNELS) if kind == "decide_again" else ""
    return Step(kind, a, b, arg)


def generate(seed: int, steps: int, *, cluster: bool = True) -> list[Step]:
    """The history a seed stands for: the same seed always gives the same steps.

    The first stream (``random.Random(seed)``) draws the kinds of ``WEIGHTS`` with their
    a and b, as it always did; a second stream of the seed draws what came later: the
    kinds of ``NEW_WEIGHTS`` inserted between them, and the variants of a step (a start's
    run id shape, tenant and mode; a decision's channel and who holds the run).
    """
    rng = random.Random(seed)
    extra = random.Random(f"extra:{seed}")
    kinds = [k for k in WEIGHTS if cluster or k not in CLUSTER_KINDS]
    weights = [WEIGHTS[k] for k in kinds]
    # The first run is plain, of the default tenant and sync: the core of every history.
    out: list[Step] = [Step("runner_start"), Step("start", arg="plain t0 sync")]
    grown = False
    while len(out) < steps:
        kind = rng.choices(kinds, weights)[0]
        if kind == "add_partitions":
            # Terminal for the topic (every later open is refused), so once, late.
            if grown or len(out) < steps * 0.7:
                continue
            grown = True
        a, b, arg = rng.randrange(1000), rng.randrange(1000), ""
        if kind == "receiver_fault":
            arg = f"{rng.choice(TOOLS)}:{rng.choice(MODES)}"
        elif kind == "recon_unavailable":
            arg = rng.choice(("refund", "charge"))
        elif kind == "start":
            arg = start_arg(extra)
        elif kind == "decide":
            arg = decide_arg(extra)
        out.append(Step(kind, a, b, arg))
        if extra.random() < NEW_RATE:
            out.append(new_step(extra))
    history = with_registry_outages(seed, through_the_console(seed, out[:steps]))[:steps]
    extra_steps = paused_calls(seed, len(history))
    if NETWORK and cluster:
        n = len(history)
        extra_steps += network_faults(seed, n) + clock_skews(seed, n) + worker_cuts(seed, n)
        extra_steps += worker_links(seed, n)
    return history + extra_steps


def network_faults(seed: int, n: int) -> list[Step]:
    """The ``quorum_cut`` steps of a history of ``n`` steps (``EXPLORER_NETWORK=1``), from
    a stream of the seed's own (``network:<seed>``), appended after the ``n`` steps and each
    executed right after step ``a`` (``in_order``), as ``pause_call`` is. ``b`` picks the
    partition whose leader is cut and how long (2-10 s)."""
    return _appended(f"network:{seed}", "quorum_cut", n, NETWORK_STEPS_PER)


def clock_skews(seed: int, n: int) -> list[Step]:
    """The ``clock_skew`` steps of a history of ``n`` steps (``EXPLORER_NETWORK=1``), from a
    stream of the seed's own (``skew:<seed>``, so the ``quorum_cut`` steps stay as they
    were), appended and each executed right after step ``a``. ``b`` picks the clock
    (``SKEWS_S``) of every worker process started after it, until the next one: their
    real wall clock, under libfaketime, so every timestamp they take (run ids, events'
    ``occurred_at``, timers' and approvals' deadlines) is the skewed one."""
    return _appended(f"skew:{seed}", "clock_skew", n, SKEW_STEPS_PER)


def worker_cuts(seed: int, n: int) -> list[Step]:
    """The ``worker_cut`` steps of a history of ``n`` steps (``EXPLORER_NETWORK=1``), from a
    stream of the seed's own (``cut:<seed>``), appended and each executed right after step
    ``a``. ``b`` picks a live worker, its link (Redis or the brokers, both ways, its
    requests only or the replies only: ``CUT_SERVICES``, ``CUT_DIRECTIONS``) and how long
    the link stays cut (1-6 s, while the next steps run: a worker that reaches Kafka but
    not Redis renews nothing while its appends could land; one that reaches Redis but not
    Kafka keeps its lease while its deliveries time out)."""
    return _appended(f"cut:{seed}", "worker_cut", n, CUT_STEPS_PER)


def worker_links(seed: int, n: int) -> list[Step]:
    """The ``worker_link`` steps of a history of ``n`` steps (``EXPLORER_NETWORK=1``), from
    a stream of the seed's own (``link:<seed>``), appended and each executed right after
    step ``a``. ``b`` picks a live worker, its link (Redis or the brokers) and how that link
    degrades for 2-7 s while the next steps run (``LINK_FAULTS``): lost packets (TCP
    retransmits, so requests land late, some after their client's timeout), a flapping
    link, or a delay of every byte (a request that lands after its timeout fired)."""
    return _appended(f"link:{seed}", "worker_link", n, LINK_STEPS_PER)


def _appended(stream: str, kind: str, n: int, per: int) -> list[Step]:
    """One ``kind`` step per ``per`` steps of a history of ``n`` (one at least), each naming
    the step it follows (``a``) and a choice (``b``), drawn from the random ``stream``."""
    if n < 3:
        return []
    rng = random.Random(stream)
    return [Step(kind, rng.randrange(2, n), rng.randrange(1000)) for _ in range(max(1, n // per))]


def paused_calls(seed: int, n: int) -> list[Step]:
    """The ``pause_call`` steps of a history of ``n`` steps, from a stream of the seed's own
    (``pause:<seed>``). They are appended after the ``n`` steps, so every other step keeps
    its index (a kept list of an older seed means what it meant), and each is executed
    right after step ``a`` (``in_order``): interleaved, not at the end."""
    if n < 3:
        return []
    rng = random.Random(f"pause:{seed}")
    return [
        Step(
            "pause_call",
            rng.randrange(2, n),
            rng.randrange(1000),
            f"{rng.choice(list(PAUSE_TOOLS))} {rng.choice(PAUSE_HOWS)}",
        )
        for _ in range(max(1, n // PAUSE_STEPS_PER))
    ]


AFTER_A_STEP = ("pause_call", "quorum_cut", "clock_skew", "worker_cut", "worker_link")
"""Steps appended after a history's own, each executed right after the step ``a`` names."""


def in_order(full: list[Step], kept: list[int]) -> list[int]:
    """The order ``kept`` steps execute in: by index, a ``pause_call`` right after the step
    it names (``a``), whether that step is kept or not."""

    def place(i: int) -> tuple[int, int, int]:
        s = full[i]
        return (s.a, 1, i) if s.kind in AFTER_A_STEP else (i, 0, i)

    return sorted(kept, key=place)


def uses_registry(seed: int) -> bool:
    """Whether the seed's history writes through a schema registry (its own stream)."""
    return random.Random(f"registry:{seed}").random() < REGISTRY_SHARE


def with_registry_outages(seed: int, history: list[Step]) -> list[Step]:
    """In a registry history, registry outages inserted after some steps (after the first
    run started, at least one), from a stream of the seed's own; others are unchanged."""
    if not uses_registry(seed):
        return history
    rng = random.Random(f"registry-outages:{seed}")
    out: list[Step] = []
    for i, s in enumerate(history):
        out.append(s)
        if i >= 2 and rng.random() < REGISTRY_OUTAGE_RATE:
            out.append(Step("registry_outage", rng.randrange(1000), rng.randrange(1000)))
    if not any(s.kind == "registry_outage" for s in out):
        at = rng.randrange(2, max(3, len(out) // 2))
        out.insert(at, Step("registry_outage", rng.randrange(1000), rng.randrange(1000)))
    return out


def through_the_console(seed: int, history: list[Step]) -> list[Step]:
    """The console, the fourth channel of a decision: a third stream of the seed moves
    ``CONSOLE_SHARE`` of the decisions (first or contradicting) drawn for the API to the
    console. Drawn apart, so a seed recorded before the console keeps every other step."""
    rng = random.Random(f"console:{seed}")
    out = []
    for s in history:
        parts = s.arg.split()
        api = s.kind in ("decide", "decide_again") and parts[:1] == ["api"]
        if api and rng.random() < CONSOLE_SHARE:
            s = Step(s.kind, s.a, s.b, " ".join(["console", *parts[1:]]))
        out.append(s)
    return out


def make_run_id(step: Step, ns: str, index: int) -> str:
    """The run id a ``start`` step names, in the shape its arg says (hex digits from the
    step's a and b, so a replay has the same shape; minted times are relative to now)."""
    shape = step.arg.split()[0] if step.arg else "plain"
    rng = random.Random(f"run-id:{step.a}:{step.b}:{index}")
    now_ms = int(time.time() * 1000)
    tail = rng.randbytes(8).hex()
    if shape.startswith("minted-") and shape != "minted-odd":
        offset_ms = {
            "minted-future-far": rng.randrange(86_400_000, 10 * 365 * 86_400_000),
            # Past the reader's skew by a few seconds: during the history the id's "time"
            # goes from ahead of the clock to reachable while the run is mid-way.
            "minted-future-near": START_SKEW_MS + rng.randrange(1_000, 8_000),
            "minted-past": -rng.randrange(60_000, 5 * 365 * 86_400_000),
            "minted-now": 0,
        }[shape]
        return f"r{now_ms + offset_ms:012x}{tail}"
    if shape == "minted-odd":
        # 29 characters starting with r, but what int(_, 16) makes of the "time" varies:
        # negative, underscores, upper case, not hex at all.
        head = rng.choice(
            ("-" + f"{now_ms:011x}"[-11:], "0_000_0000_0", f"{now_ms:012X}", "zzzzzzzzzzzz")
        )
        return f"r{head}{tail}"
    if shape == "uuid":
        return str(uuid.UUID(bytes=rng.randbytes(16), version=4))
    if shape == "long":
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:@-"
        head = f"{ns}-r{index}-"
        length = MAX_RUN_ID_LEN - rng.randrange(0, 4)
        return head + "".join(rng.choice(alphabet) for _ in range(length - len(head)))
    if shape == "odd-chars":
        pattern = rng.choice(
            (
                "{ns}.r{i}",
                ":{ns}:r{i}:",
                "@{ns}@r{i}",
                "..{ns}..r{i}",
                "-_{ns}_-r{i}",
                "{i}.{ns}@x:y",
            )
        )
        return pattern.format(ns=ns, i=index)
    return f"{ns}-r{index}"


def tenant_of(step: Step) -> str:
    parts = step.arg.split()
    return TENANTS[int(parts[1][1:])] if len(parts) > 1 else "default"


def mode_of(step: Step) -> str:
    parts = step.arg.split()
    return parts[2] if len(parts) > 2 else "sync"


def plan_for(seed: int, index: int) -> list[list[Any]]:
    """A run's script: 2 to 5 calls of the four tools, deterministic per seed and run."""
    rng = random.Random(f"plan:{seed}:{index}")
    calls: list[list[Any]] = []
    for i in range(rng.randint(2, 5)):
        tool = rng.choice(TOOLS)
        calls.append([tool, {"n": i, "amount": rng.randint(1, 99)}])
    return calls


# --------------------------------------------------------------------------- environment


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class LedgerServer:
    """The receivers' private Redis: no fault of the explorer ever touches it."""

    def __init__(self, cfg: stack.StackConfig) -> None:
        self.port = int(os.environ.get("EXPLORER_LEDGER_PORT") or cfg.redis_port + 1)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="explorer-ledger-"))

    def up(self) -> None:
        if _answers(self.port):
            return
        # The port may be held for a while as the local end of someone's client socket
        # (it is in the ephemeral range): a few tries, then the next ports up.
        for attempt in range(6):
            port = self.port + 100 * (attempt // 2)
            if self._start(port):
                self.port, self.url = port, f"redis://127.0.0.1:{port}/0"
                return
            time.sleep(1)
        raise RuntimeError(f"ledger redis did not start on {self.port} or above")

    def _start(self, port: int) -> bool:
        exe = shutil.which("redis-server") or "redis-server"
        proc = subprocess.Popen(
            [
                exe,
                *("--port", str(port), "--bind", "127.0.0.1", "--save", ""),
                *("--appendonly", "no", "--dir", str(self.dir)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                with contextlib.suppress(Exception):
                    proc.kill()
                    proc.wait(timeout=5)
                return False
            time.sleep(0.05)
        self.proc = proc
        return True

    def down(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class ConsoleServer:
    """The operator console as a person reaches it: ``runlog ui`` in a process of its own
    on a free port, over the explorer's deployment (its topics, its Redis prefix, the run
    index its projection runners keep). Every valid tenant of ``TENANTS`` has tokens that
    grant that tenant only (as a tenant's person holds), one per name a decision is
    recorded under. Started at the first console decision; stopped with the history."""

    NAMES = ("explorer", "explorer-again")

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.tokens: dict[tuple[str, str], str] = {
            (t, name): f"tok-{i}-{name}-{uuid.uuid4().hex}"
            for i, t in enumerate(TENANTS)
            if tenant_problem(t) is None
            for name in self.NAMES
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def up(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        grants = {tok: {"tenants": [t], "name": name} for (t, name), tok in self.tokens.items()}
        env = {**self.env, "RUNLOG_UI_TOKENS": json.dumps(grants), "RUNLOG_UI_REFRESH_S": "0"}
        cmd = [sys.executable, "-m", "runlog.cli", "ui", "--port", str(port)]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=fh, stderr=fh)
        deadline = time.monotonic() + 30
        while not _answers(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the console did not start (see {self.log})")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def down(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def decide(
        self,
        tenant: str,
        rid: str,
        aid: str,
        *,
        approve: bool,
        by: str,
        note: str,
        wait_s: float = 10.0,
    ) -> tuple[str, str]:
        """Decide as a person does: log in with the tenant's token, open the approval's
        question page, answer, and confirm the restated consequence. ``(outcome, detail)``:
        outcome ``recorded`` or ``queued`` (its flash), ``refused`` (the console's page
        naming the decision that stands), ``unseen`` (the run is not in the console's
        index yet: a person cannot decide it there either) or ``failed``."""
        import re
        from urllib.parse import quote

        import httpx

        base = self.up()
        path = f"/runs/{quote(rid, safe='')}/approvals/{quote(aid, safe='')}"
        with httpx.Client(base_url=base, follow_redirects=False, timeout=120) as web:
            r = web.post("/login", data={"token": self.tokens[(tenant, by)]})
            if r.status_code != 303:
                return "failed", f"login: HTTP {r.status_code}"
            deadline = time.monotonic() + wait_s
            while (page := web.get(path)).status_code == 404 and time.monotonic() < deadline:
                time.sleep(0.5)  # the index follows the log (a runner may be down or behind)
            if page.status_code == 404:
                return "unseen", "not in the console's index"
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
            if page.status_code != 200 or csrf is None:
                return "failed", f"question page: HTTP {page.status_code}"
            form = {"decision": "approve" if approve else "reject", "note": note}
            form |= {"csrf": csrf.group(1), "next": f"/runs/{quote(rid, safe='')}"}
            r = web.post(path, data=form)
            if r.status_code == 200 and 'id="confirmation"' in r.text:
                r = web.post(path, data={**form, "confirm": "yes"})
            if r.status_code == 303:
                done = re.search(r"done=\w+?-(recorded|queued)", r.headers.get("location", ""))
                if done is None:
                    return "failed", f"redirected to {r.headers.get('location')}"
                return done.group(1), ""
            if r.status_code == 409 and 'id="refused"' in r.text:
                return "refused", "the console named the decision that stands"
            return "failed", f"HTTP {r.status_code}: {r.text[:160]!r}"


class RegistryServer:
    """A schema registry (Apicurio, as ``runlog stack up --registry`` runs it) for the
    explorer's histories, started at the first history that uses one and kept for the
    session; clients reach it through a ``Gate`` that an outage closes. Its port:
    ``EXPLORER_REGISTRY_PORT`` (default the cluster's Redis port + 3; management port next)."""

    def __init__(self, cfg: stack.StackConfig) -> None:
        from runlog.stack import _registry as stack_registry

        port = int(os.environ.get("EXPLORER_REGISTRY_PORT") or cfg.redis_port + 3)
        self.paths = stack_registry.RegistryPaths(
            cfg.cache_dir / f"apicurio-{stack_registry.APICURIO_VERSION}",
            Path(tempfile.mkdtemp(prefix="explorer-registry-")),
            port,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.gate: Any = None
        self.paused = False

    @property
    def url(self) -> str:
        assert self.gate is not None
        return f"http://127.0.0.1:{self.gate.port}/apis/ccompat/v7"

    def up(self) -> str:
        from registry_support import Gate

        from runlog.stack import _registry as stack_registry
        from runlog.stack._jars import java_binary

        if self.proc is None or self.proc.poll() is not None:
            jar = stack_registry.fetch(self.paths)
            argv = [java_binary(), "-Xmx256m", "-Dquarkus.http.host=127.0.0.1"]
            argv += [
                f"-Dquarkus.http.port={self.paths.port}",
                "-Dquarkus.management.host=127.0.0.1",
            ]
            argv += [f"-Dquarkus.management.port={self.paths.port + 1}", "-jar", str(jar)]
            with open(self.paths.state / "registry.log", "ab") as fh:
                self.proc = subprocess.Popen(
                    argv, cwd=self.paths.state, stdout=fh, stderr=fh, start_new_session=True
                )
            deadline = time.monotonic() + 120
            while not stack_registry.answers(self.paths.url):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the schema registry did not start ({self.paths.state})")
                time.sleep(0.25)
            if self.gate is not None:
                self.gate.close()
            self.gate = Gate(self.paths.port)
        self.heal()
        return self.url

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def refuse(self) -> None:
        self.gate.shut()

    def heal(self) -> None:
        if self.paused and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
            self.paused = False
        if self.gate is not None:
            self.gate.open = True

    def down(self) -> None:
        self.heal()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        shutil.rmtree(self.paths.state, ignore_errors=True)


_REGISTRY: RegistryServer | None = None


def registry_for(cfg: stack.StackConfig) -> RegistryServer:
    """The session's registry (started once, at the first history that uses one)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = RegistryServer(cfg)
    _REGISTRY.up()
    return _REGISTRY


def stop_registry() -> None:
    """Stop the session's registry, if a history started one."""
    global _REGISTRY
    if _REGISTRY is not None:
        _REGISTRY.down()
        _REGISTRY = None


def cluster_settings(
    cfg: stack.StackConfig, prefix: str, registry_url: str | None = None
) -> Settings:
    if registry_url is not None:
        return Settings(
            bootstrap_servers=cfg.bootstrap_servers,
            redis_url=cfg.redis_url,
            replication_factor=min(3, len(cfg.nodes())),
            lease_ttl_ms=LEASE_TTL_MS,
            topic_prefix=prefix,
            redis_key_prefix=prefix,
            partitions=PARTITIONS,
            schema_registry_url=registry_url,
            schema_registry_timeout_ms=REGISTRY_TIMEOUT_MS,
        )
    return Settings(
        bootstrap_servers=cfg.bootstrap_servers,
        redis_url=cfg.redis_url,
        replication_factor=min(3, len(cfg.nodes())),
        lease_ttl_ms=LEASE_TTL_MS,
        topic_prefix=prefix,
        redis_key_prefix=prefix,
        partitions=PARTITIONS,
        schema_registry_url=None,
    )


def env_for(settings: Settings, ledger_url: str, ns: str) -> dict[str, str]:
    env = worker_env(
        settings,
        RUNLOG_KAFKA_EXTRA=FAST_TAKEOVER,
        EXPLORER_LEDGER_URL=ledger_url,
        EXPLORER_LEDGER_NS=ns,
    )
    env.pop("RUNLOG_SCHEMA_REGISTRY_URL", None)
    if settings.schema_registry_url is not None:
        env["RUNLOG_SCHEMA_REGISTRY_URL"] = settings.schema_registry_url
        env["RUNLOG_SCHEMA_REGISTRY_TIMEOUT_MS"] = str(settings.schema_registry_timeout_ms)
    return env


# --------------------------------------------------------------------------- execution

SAVE_LUA = """
local out = {}
for _, k in ipairs(redis.call('KEYS', ARGV[1])) do
  local v = redis.call('DUMP', k)
  if v then
    out[#out + 1] = k
    out[#out + 1] = v
    out[#out + 1] = redis.call('PEXPIRETIME', k)
  end
end
return out
"""
"""A copy of one moment, as an RDB or AOF is: each key, its value and its expiry (absolute
ms, -1 for none)."""
RESTORE_LUA = """
for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end
for i = 2, #ARGV, 3 do
  local at = tonumber(ARGV[i + 2])
  if at > 0 then
    redis.call('RESTORE', ARGV[i], at, ARGV[i + 1], 'REPLACE', 'ABSTTL')
  else
    redis.call('RESTORE', ARGV[i], 0, ARGV[i + 1], 'REPLACE')
  end
end
return #ARGV
"""
"""The copy back, each key with the expiry it had (a key whose time has passed is not
restored, as Redis loading an old RDB drops it): restored without its TTL, a killed
rebuild's marker would fence the runners for ever, which no real rollback does."""


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    run_id: str = ""
    paused_until: float = 0.0
    log: Path | None = None
    refusal: bool = False
    """A worker whose tenant runlog must refuse: InvalidTenant (or SIGKILL) is its only exit."""


@dataclass
class Outcome:
    seed: int
    steps: int
    kept: list[int]
    history: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    exits: Counter[str] = field(default_factory=Counter)
    acks: int = 0
    effects: int = 0
    doubled_allowed: int = 0
    pauses: list[dict[str, Any]] = field(default_factory=list)
    """One per ``pause_call`` executed: tool, key, how, effects, exits, what recovery did."""
    quarantined: int = 0
    runs: int = 0
    finished: int = 0
    waiting: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.violations)


class Explorer:
    """Executes one history on the real stack and checks it."""

    def __init__(
        self,
        cfg: stack.StackConfig,
        ledger: LedgerServer,
        seed: int,
        registry: RegistryServer | None = None,
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        self.ns = f"x{seed}-{uuid.uuid4().hex[:6]}"
        self.registry = registry
        self.registry_until = 0.0
        self.s = cluster_settings(cfg, self.ns, None if registry is None else registry.url)
        self.ledger_url = ledger.url
        self.ledger = redis.Redis.from_url(ledger.url)
        self.env = env_for(self.s, ledger.url, self.ns)
        self.dir = Path(tempfile.mkdtemp(prefix=f"explorer-{self.ns}-"))
        self.journal = self.dir / "journal.jsonl"
        self.journal.touch()
        self.runs: list[str] = []
        self.pause_runs: list[str] = []
        """Runs of ``pause_call`` steps: out of ``runs``, so no other step's target moves."""
        self.custom_plans: dict[str, list[list[Any]]] = {}
        self.workers: list[Proc] = []
        self.runners: list[Proc] = []
        self.down_nodes: list[int] = []
        self.saved: dict[bytes, tuple[bytes, int]] | None = None
        self.grown = False
        self.n_workers = 0
        self.decided: set[tuple[str, str]] = set()
        self.out: Outcome | None = None
        self._producer: Any = None
        self.ghosts: list[tuple[int, int]] = []
        self.kinds_done: set[str] = set()
        self.tenants: dict[str, str] = {}
        self.modes: dict[str, str] = {}
        self.plans: dict[str, int] = {}
        self.refused: list[str] = []
        """Runs started under a tenant name runlog refuses: nothing of them may exist."""
        self.agains: list[tuple[str, str, bool]] = []
        """(run, approval, the first decision) of every contradicting decision tried."""
        self.step_problems: list[str] = []
        """Violations a step saw itself (a contradicting decision accepted)."""
        self.rebuilds: list[Proc] = []
        self.padded = 0
        self.console = ConsoleServer(self.env, self.dir / "console.log")
        self.skew_s = 0.0
        """The wall-clock offset of the workers started next (``clock_skew`` steps)."""
        self.n_cuts = 0
        self.cuts: list[tuple[float, Any]] = []
        """(monotonic time to heal, ``ProcessCut`` or ``ProcessDelay``) of the ``worker_cut``
        and ``worker_link`` steps still in force."""
        self.delays: list[Any] = []
        """The ``ProcessDelay`` of every delayed link: their proxies carry the connections
        made through them until the execution ends."""

    # ----------------------------------------------------------------- helpers
    def r(self) -> redis.Redis:
        return redis.Redis.from_url(self.s.redis_url, socket_timeout=5)

    def lk(self, name: str) -> str:
        return f"{self.ns}:{name}"

    def alive(self, procs: list[Proc]) -> list[Proc]:
        return [p for p in procs if p.proc.poll() is None]

    def spawn_worker(
        self, run_id: str, *, takeover: bool = False, extra: tuple[str, ...] = ()
    ) -> Proc | None:
        live = [w for w in self.alive(self.workers) if w.run_id == run_id]
        if len(live) >= MAX_WORKERS_PER_RUN:
            return None
        self.n_workers += 1
        name = f"w{self.n_workers}"
        # ``--run-id=``: a run id may begin with "-", which argparse would take for an option.
        cmd = [sys.executable, str(WORKER), f"--run-id={run_id}", "--name", name]
        # A run the caller added to ``runs`` itself (the soak does) is plain: the default
        # tenant, sync, the plan of its index.
        plan = self.plans.setdefault(run_id, self.runs.index(run_id) if run_id in self.runs else 0)
        tenant = self.tenants.setdefault(run_id, "default")
        script = self.custom_plans.get(run_id) or plan_for(self.seed, plan)
        cmd += ["--plan", json.dumps(script)]
        cmd += ["--journal", str(self.journal), f"--tenant={tenant}"]
        if self.modes.setdefault(run_id, "sync") == "async":
            cmd.append("--async")
        if takeover:
            cmd.append("--takeover")
        cmd += extra
        log = self.dir / f"{name}.log"
        env = self.env
        if self.skew_s:
            from netns import skewed_env

            env = skewed_env(env, self.skew_s)
            assert self.out is not None
            self.out.faults["worker started on a skewed clock"] += 1
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=fh, stderr=fh)
        p = Proc(name, proc, run_id, log=log, refusal=run_id in self.refused)
        self.workers.append(p)
        return p

    def kill_workers_of(self, rid: str) -> int:
        n = 0
        for w in self.alive(self.workers):
            if w.run_id == rid:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGCONT)
                    w.proc.send_signal(signal.SIGKILL)
                w.proc.wait(timeout=10)
                w.paused_until = 0.0
                n += 1
        if n:
            assert self.out is not None
            self.out.faults["SIGKILL worker (before a decision)"] += n
        return n

    def spawn_runner(self) -> None:
        if len(self.alive(self.runners)) >= MAX_RUNNERS:
            return
        name = f"p{len(self.runners) + 1}"
        log = self.dir / f"{name}.log"
        cmd = [sys.executable, "-m", "runlog.cli", "project", "all", "--group", f"{self.ns}-g"]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, env=self.env, cwd=str(ROOT), stdout=fh, stderr=fh)
        self.runners.append(Proc(name, proc, log=log))

    def pick(self, procs: list[Proc], a: int) -> Proc | None:
        live = sorted(self.alive(procs), key=lambda p: p.name)
        return live[a % len(live)] if live else None

    def run_of(self, a: int) -> str | None:
        return self.runs[a % len(self.runs)] if self.runs else None

    @property
    def every_run(self) -> list[str]:
        """The runs the checker covers: the history's and its ``pause_call`` runs."""
        return self.runs + self.pause_runs

    def cont_paused(self, *, all_of_them: bool = False) -> None:
        now = time.monotonic()
        if self.registry_until and (all_of_them or now >= self.registry_until):
            # An outage lasts REGISTRY_OUTAGE_S: the steps that follow meet it too.
            assert self.registry is not None
            self.registry.heal()
            self.registry_until = 0.0
        for due, cut in list(self.cuts):
            if all_of_them or now >= due:
                cut.heal()
                self.cuts.remove((due, cut))
                if self.out is not None:  # evidence the fault took effect
                    seen = getattr(cut, "dropped", 0) or getattr(cut, "delayed", 0)
                    self.out.faults["packets dropped or chunks delayed by worker faults"] += seen
        for p in self.workers + self.runners:
            if p.paused_until and (all_of_them or now >= p.paused_until):
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGCONT)
                p.paused_until = 0.0

    def heal_nodes(self) -> None:
        for node in list(self.down_nodes):
            stack.start_node(self.cfg, node)
            self.down_nodes.remove(node)
        if stack.redis_pid(self.cfg) is None:
            stack.start_redis(self.cfg)

    def ready(self, timeout: float = 120.0) -> None:
        """Every node and Redis up, this execution's topics created: a history starts on
        a healthy cluster whatever the previous one left behind."""
        for node in self.cfg.nodes():
            if stack.node_pid(self.cfg, node.node_id) is None:
                stack.start_node(self.cfg, node.node_id)
        if stack.redis_pid(self.cfg) is None:
            stack.start_redis(self.cfg)
        deadline = time.monotonic() + timeout
        while True:
            try:
                ensure_topics(self.s).raise_for_drift()
                if self.registry is not None:
                    # This history's subjects (one per event type, named by its topic).
                    from runlog.log._registry import RegistryIds

                    self.registry.heal()
                    RegistryIds(
                        self.s.schema_registry_url or "", self.s.events_topic
                    ).register_all()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)

    def read(self, run_id: str) -> list[Event]:
        settings = self.s
        if self.grown:
            settings = settings.model_copy(update={"partitions": PARTITIONS + 3})
        with LogReader(settings) as reader:
            part = partition_for(run_id, PARTITIONS)
            return [rec.event for rec in reader.read(run_id, partition=part, start=0)]

    # ----------------------------------------------------------------- steps
    def do_on_run(self, step: Step, rid: str) -> str:
        """A step on run ``rid`` (one of ``STEPS_ON_A_RUN``)."""
        assert self.out is not None
        k = step.kind
        if k in ("resume", "takeover"):
            p = self.spawn_worker(rid, takeover=k == "takeover")
            return f"{k} {rid} as {p.name}" if p else "skip: enough workers"
        if k == "receiver_fault":
            tool, mode = step.arg.split(":")
            self.ledger.rpush(self.lk(f"fault:{rid}:{tool}"), mode)
            self.out.faults[f"receiver {mode}"] += 1
            return f"next {tool} of {rid}: {mode}"
        if k == "recon_unavailable":
            self.ledger.rpush(self.lk(f"recon:{rid}:{step.arg}"), "unavailable")
            self.out.faults["reconciler unavailable"] += 1
            return f"next lookup of {step.arg} in {rid}: unavailable"
        # A decision goes to the first run from ``rid`` on that has something to decide;
        # with none, it asks for something: the run's next ticket call fails after its
        # effect, so the run waits for a person (a later decision step finds it).
        if k == "decide_again":
            found = self.run_with(
                rid,
                lambda r, st: (
                    any(ap.approved is not None for ap in st.approvals.values())
                    or any((r, a) not in self.decided for a in st.pending_approvals)
                ),
            )
            if found is None:
                return self.provoke(rid)
            return self.decide_again(found, step.b, step.arg or "api")
        assert k == "decide", k
        found = self.run_with(
            rid, lambda r, st: any((r, a) not in self.decided for a in st.pending_approvals)
        )
        if found is None:
            return self.provoke(rid)
        channel, owner = (step.arg or "api as-is").split()
        return self.decide(found, approve=step.b % 3 != 0, channel=channel, owner=owner)

    def run_with(self, rid: str, want: Any) -> str | None:
        """The first run from ``rid`` on (in start order, wrapping) whose state ``want``s."""
        i = self.runs.index(rid)
        for r in self.runs[i:] + self.runs[:i]:
            try:
                st = fold_valid(self.read(r))
            except Exception:  # noqa: BLE001 - a person cannot read it now either
                continue
            if want(r, st):
                return r
        return None

    def provoke(self, rid: str) -> str:
        assert self.out is not None
        self.ledger.rpush(self.lk(f"fault:{rid}:ticket"), "fail-after")
        self.out.faults["receiver fail-after (so a person is asked)"] += 1
        return f"nothing to decide: next ticket of {rid}: fail-after (a person will be asked)"

    def do(self, step: Step) -> str:
        """Execute one step; return what it did (for the printed history)."""
        assert self.out is not None
        k = step.kind
        if k == "start":
            if len(self.runs) + len(self.refused) >= MAX_RUNS:
                return "skip: enough runs"
            index = len(self.runs) + len(self.refused)
            rid = make_run_id(step, self.ns, index)
            tenant = tenant_of(step)
            self.tenants[rid], self.modes[rid], self.plans[rid] = tenant, mode_of(step), index
            if tenant_problem(tenant) is None:
                self.runs.append(rid)
            else:
                self.refused.append(rid)
                self.out.faults["tenant name runlog must refuse"] += 1
            p = self.spawn_worker(rid)
            return f"start {rid} of tenant {tenant!a} ({self.modes[rid]}) as {p.name if p else '-'}"
        if k in STEPS_ON_A_RUN:
            rid = self.run_of(step.a)
            return "skip: no run" if rid is None else self.do_on_run(step, rid)
        if k == "kill_worker":
            p = self.pick(self.workers, step.a)
            if p is None:
                return "skip: no live worker"
            # Up to 3 s: past a worker's start-up, into its calls (and the receivers' slow
            # answers), where a kill leaves a STARTED without its COMPLETED.
            delay_ms = (step.b * 7) % 3000
            time.sleep(delay_ms / 1000)
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGKILL)
            self.out.faults["SIGKILL worker"] += 1
            return f"SIGKILL {p.name} ({p.run_id}) after {delay_ms} ms"
        if k == "pause_worker":
            p = self.pick([w for w in self.workers if not w.paused_until], step.a)
            if p is None:
                return "skip: no live worker"
            p.proc.send_signal(signal.SIGSTOP)
            p.paused_until = time.monotonic() + 0.5 + (step.b % 40) / 10
            self.out.faults["SIGSTOP worker"] += 1
            return f"SIGSTOP {p.name} for {p.paused_until - time.monotonic():.1f} s"
        if k == "wait":
            time.sleep(0.3 + (step.b % 20) / 10)
            return "wait"
        if k == "runner_start":
            self.spawn_runner()
            return "runner start"
        if k in ("runner_stop", "runner_kill", "runner_pause"):
            p = self.pick([r for r in self.runners if not r.paused_until], step.a)
            if p is None:
                return "skip: no runner"
            if k == "runner_stop":
                p.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(timeout=20)
                return f"SIGTERM runner {p.name}"
            if k == "runner_kill":
                p.proc.send_signal(signal.SIGKILL)
                self.out.faults["SIGKILL runner"] += 1
                return f"SIGKILL runner {p.name}"
            p.proc.send_signal(signal.SIGSTOP)
            p.paused_until = time.monotonic() + 1 + (step.b % 40) / 10
            self.out.faults["SIGSTOP runner"] += 1
            return f"SIGSTOP runner {p.name}"
        if k in ("redis_restart", "redis_wipe"):
            stack.kill_redis(self.cfg, sig=signal.SIGKILL)
            time.sleep(0.2)
            stack.start_redis(self.cfg, empty=k == "redis_wipe")
            self.out.faults[
                "Redis kill -9, restart " + ("empty" if k == "redis_wipe" else "AOF")
            ] += 1
            return k
        if k == "redis_save":
            # One script, so the copy is of one moment, as an RDB or AOF is: a copy taken
            # key by key while runners write would mix moments no real Redis ever held.
            with contextlib.closing(self.r()) as r:
                flat = r.eval(SAVE_LUA, 0, f"{self.ns}:*")
            self.saved = {flat[i]: (flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}
            return f"saved {len(self.saved)} keys"
        if k == "redis_rollback":
            if self.saved is None:
                return "skip: nothing saved"
            args = [x for k, (v, at) in self.saved.items() for x in (k, v, at)]
            with contextlib.closing(self.r()) as r:
                r.eval(RESTORE_LUA, 0, f"{self.ns}:*", *args)
            self.out.faults["Redis rolled back to an older copy"] += 1
            return f"rolled Redis back to {len(self.saved)} saved keys"
        if k == "leader_kill":
            if self.down_nodes:
                self.heal_nodes()
            from faultkit import partition_leaders

            leaders = partition_leaders(self.s)
            leader = leaders[step.a % len(leaders)][0]
            if leader < 0:
                return "skip: no leader"
            stack.kill_node(self.cfg, leader, sig=signal.SIGKILL)
            self.down_nodes.append(leader)
            self.out.faults["partition leader kill -9"] += 1
            return f"kill -9 node {leader} (leader of partition {step.a % len(leaders)})"
        if k == "broker_restart":
            if self.down_nodes:
                self.heal_nodes()
            node = step.a % len(self.cfg.nodes()) + 1
            stack.stop_node(self.cfg, node)
            stack.start_node(self.cfg, node)
            self.out.faults["broker restart"] += 1
            return f"restart node {node}"
        if k == "rebuild_kill":
            return self.rebuild_kill(step.b)
        if k == "pause_call":
            return self.pause_call(step)
        if k == "quorum_cut":
            return self.quorum_cut(step.b)
        if k == "clock_skew":
            return self.clock_skew(step.b)
        if k == "worker_cut":
            return self.worker_cut(step.b)
        if k == "worker_link":
            return self.worker_link(step.b)
        if k == "registry_outage":
            if self.registry is None:
                return "skip: no registry in this history"
            how = "SIGSTOP" if step.b % 2 == 0 else "refuse"
            zombie = self.zombie_unseen(step.a)  # encoded while the registry answers
            if how == "SIGSTOP":
                self.registry.pause()
            else:
                self.registry.refuse()
            self.registry_until = time.monotonic() + REGISTRY_OUTAGE_S
            self.out.faults[f"schema registry {how}"] += 1
            # The live runners meet it: a record whose schema id none of them has cached
            # yet arrives during it (a stale writer's GUARDRAIL_TRIGGERED, which no worker
            # writes, so it is fenced by every reader), and they must wait the outage out,
            # retrying, never exiting and quarantining nothing. Workers that start, or
            # write a type they have not looked up yet, stop with RegistryUnavailable.
            fresh = ""
            if zombie is not None:
                assert self._producer is not None
                rid, value = zombie
                part = partition_for(rid, PARTITIONS)
                self._producer.produce(self.s.events_topic, value, rid, partition=part)
                self._producer.flush(30)
                fresh = f"; an uncached-id record of {zombie[0]} sent into it"
            time.sleep(1.0)  # readers meet it meanwhile; the next steps too, within it
            state = "paused (SIGSTOP)" if how == "SIGSTOP" else "refusing connections"
            return f"schema registry {state} for {REGISTRY_OUTAGE_S:.0f} s{fresh}"
        if k == "hostile":
            n = self.hostile(step.b)
            self.out.faults["hostile records"] += n
            return f"{n} hostile records"
        if k == "add_partitions":
            from confluent_kafka.admin import AdminClient, NewPartitions

            admin = AdminClient(self.s.kafka_common())
            fut = admin.create_partitions([NewPartitions(self.s.events_topic, PARTITIONS + 3)])
            for f in fut.values():
                f.result(timeout=30)
            self.grown = True
            self.out.faults["partitions added"] += 1
            return f"events topic grown to {PARTITIONS + 3} partitions"
        raise ValueError(f"unknown step {k}")

    def clock_skew(self, b: int) -> str:
        """Workers started from now on run on a clock ``SKEWS_S[b % 3]`` off the real one
        (libfaketime, with the shim that keeps librdkafka's timed waits real: netns.py);
        those already running keep theirs, so skewed and unskewed owners meet on a run."""
        assert self.out is not None
        from netns import skewed_env

        skew = SKEWS_S[b % len(SKEWS_S)]
        if skew:
            skewed_env({}, skew)  # the tools it needs are here, or say what is missing
            self.out.faults[f"workers' clock {skew:+.0f} s"] += 1
        self.skew_s = skew
        return f"workers started from now on: clock {skew:+.0f} s"

    def worker_cut(self, b: int) -> str:
        """Cut a live worker's link to Redis or to the brokers (both ways, its requests or
        the replies only) for 1-6 s (tests/faults/netns.py, ``ProcessCut``); the next steps
        run meanwhile, and it is healed when due (``cont_paused``)."""
        from netns import ProcessCut

        picked = self._link_of(b)
        if picked is None:
            return "skip: no live worker"
        p, service, ports, name = picked
        direction = CUT_DIRECTIONS[(b // 2) % 3]
        hold_s = 1 + (b // 6) % 6
        cut = ProcessCut(name, [p.proc.pid], ports, direction)
        cut.cut()
        return self._degraded(
            cut,
            hold_s,
            f"worker cut from {service} ({direction})",
            p,
            f"cut from {service} ({direction})",
        )

    def worker_link(self, b: int) -> str:
        """Degrade a live worker's link to Redis or to the brokers for 2-7 s (``LINK_FAULTS``:
        tests/faults/netns.py, ``ProcessCut`` with a share of packets or flapping,
        ``ProcessDelay``); the next steps run meanwhile, and it is healed when due."""
        from netns import ProcessCut, ProcessDelay

        picked = self._link_of(b)
        if picked is None:
            return "skip: no live worker"
        p, service, ports, name = picked
        fault = LINK_FAULTS[(b // 2) % 3]
        hold_s = 2 + (b // 6) % 6
        if fault == "loss":
            percent = 20 + 5 * (b % 5)
            cut = ProcessCut(name, [p.proc.pid], ports, percent=percent)
            cut.cut()
            what = f"{percent} % of its packets to and from {service} lost"
            return self._degraded(cut, hold_s, f"worker link to {service}: loss", p, what)
        if fault == "flap":
            cut = ProcessCut(name, [p.proc.pid], ports)
            cut.flap(down_s=0.5, up_s=0.5)
            what = f"its link to {service} flapping"
            return self._degraded(cut, hold_s, f"worker link to {service}: flap", p, what)
        delay_s = 0.1 * (1 + (b // 36) % 5)
        delay = ProcessDelay(name, [p.proc.pid], ports, delay_s)
        self.delays.append(delay)
        delay.delay()
        what = f"every byte to and from {service} held {delay_s * 1000:.0f} ms"
        return self._degraded(delay, hold_s, f"worker link to {service}: delay", p, what)

    def _link_of(self, b: int) -> tuple[Proc, str, list[int], str] | None:
        """The live worker (by ``b``), the service whose link a step degrades, its ports and
        a name for the fault."""
        live = sorted(
            (w for w in self.alive(self.workers) if not w.paused_until), key=lambda p: p.name
        )
        if not live:
            return None
        p = live[(b // 36) % len(live)]
        service = CUT_SERVICES[b % 2]
        if service == "redis":
            ports = [self.cfg.redis_port]
        else:
            ports = [n.kafka_port for n in self.cfg.nodes()]
        self.n_cuts += 1
        return p, service, ports, f"{self.ns.rsplit('-', 1)[1]}x{self.n_cuts}"

    def _degraded(self, fault: Any, hold_s: int, counted: str, p: Proc, what: str) -> str:
        assert self.out is not None
        self.cuts.append((time.monotonic() + hold_s, fault))
        self.out.faults[counted] += 1
        return f"{p.name} ({p.run_id}): {what} for {hold_s} s"

    def quorum_cut(self, b: int) -> str:
        """Cut the leader of partition ``b`` (mod the count) from the controller quorum for
        2-10 s (tests/faults/netns.py, ``QuorumCut``), the workers running, then heal."""
        assert self.out is not None
        if self.down_nodes:
            self.heal_nodes()
        from faultkit import partition_leaders
        from netns import QuorumCut

        leaders = partition_leaders(self.s)
        part = b % len(leaders)
        leader = leaders[part][0]
        pid = stack.node_pid(self.cfg, leader) if leader >= 0 else None
        if pid is None:
            return "skip: no leader"
        node = self.cfg.node(leader)
        others = [n.controller_port for n in self.cfg.nodes() if n.node_id != leader]
        cut = QuorumCut(pid, node.controller_port, others)
        hold_s = 2 + b % 9
        cut.cut()
        try:
            time.sleep(hold_s)
        finally:
            cut.heal()
        self.out.faults["broker cut from the controller quorum"] += 1
        return (
            f"cut node {leader} (leader of partition {part}) from the quorum for {hold_s} s "
            f"({cut.dropped} controller packets dropped)"
        )

    def pause_call(self, step: Step) -> str:
        """A worker frozen inside a call of one tool kind (``PAUSE_TOOLS``), on a run of its
        own: held just before its request goes to the receiver, SIGSTOPped, its run taken
        over (``PAUSE_HOWS``) and the call reconciled by the new owner (which runs until it
        stops: finished, waiting for a person or waiting out a deadline), then SIGCONTed
        with its request released. The checker counts what the receiver applied."""
        assert self.out is not None
        tool, how = step.arg.split()
        rid = f"{self.ns}-pause{len(self.pause_runs)}"
        self.pause_runs.append(rid)
        self.custom_plans[rid] = [[tool, {"n": 0, "amount": 1 + step.b % 99}]]
        began = time.monotonic()
        self.ledger.rpush(self.lk(f"fault:{rid}:{tool}"), "hold")
        held = self.lk(f"held:{rid}")
        deadline = time.monotonic() + 60
        tries = 0
        old: Proc | None = None
        while (key := self.ledger.get(held)) is None:
            if old is None or old.proc.poll() is not None:
                # A worker that stopped before its call (a registry outage or a Redis fault
                # of the steps before) is started again, twice at most, as a caller would.
                if tries == 3 or time.monotonic() > deadline:
                    return f"could not: no worker of {rid} reached its {tool} call"
                if old is not None:
                    time.sleep(max(1.0, self.registry_until - time.monotonic()))
                    self.cont_paused()  # what ended meanwhile ends now, as between steps
                old, tries = self.spawn_worker(rid), tries + 1
                assert old is not None
            time.sleep(0.02)
        assert old is not None
        record: dict[str, Any] = {"run": rid, "tool": tool, "how": how, "key": key.decode()}
        self.out.pauses.append(record)
        old.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            if how == "expire":
                self.wait_lease_free(rid)
            new = self.spawn_worker(rid, takeover=how == "break")
            assert new is not None
            try:
                new.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                new.proc.kill()
                new.proc.wait(timeout=10)
            record["new_exit"] = EXIT_NAMES.get(new.proc.returncode, str(new.proc.returncode))
        finally:
            self.ledger.set(self.lk(f"release:{rid}"), "1")
            with contextlib.suppress(ProcessLookupError):
                old.proc.send_signal(signal.SIGCONT)
        frozen = time.monotonic() - t0
        try:
            old.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            old.proc.kill()
            old.proc.wait(timeout=10)
        record["old_exit"] = EXIT_NAMES.get(old.proc.returncode, str(old.proc.returncode))
        record["effects"] = int(self.ledger.hget(self.lk("L:count"), record["key"]) or 0)
        record["seconds"] = round(time.monotonic() - began, 1)
        self.out.faults[f"SIGSTOP inside a {tool} call, run taken over ({how})"] += 1
        return (
            f"{old.name} frozen in {tool} of {rid} for {frozen:.1f} s, taken over ({how}) by "
            f"{new.name}: {record['new_exit']}; woken: {record['old_exit']}; "
            f"{record['effects']} effect(s)"
        )

    def wait_lease_free(self, rid: str, timeout: float = 30.0) -> None:
        """Until the run's lease is free: gone, or its owner's session expired."""
        from runlog.schemas._keys import lease_key, live_key, session_of

        key = lease_key(self.s.redis_key_prefix, self.tenants.get(rid, "default"), rid)
        deadline = time.monotonic() + timeout
        with contextlib.closing(self.r()) as r:
            while time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError):
                    value = r.get(key)
                    if value is None:
                        return
                    session = session_of(value.decode())
                    if session is not None and not r.exists(
                        live_key(self.s.redis_key_prefix, session)
                    ):
                        return
                time.sleep(0.05)

    def decide(
        self,
        rid: str,
        *,
        approve: bool,
        channel: str = "api",
        owner: str = "as-is",
        console_wait_s: float = 10.0,
    ) -> str:
        """A person's decision on the run's first pending approval, through ``channel``
        (``runlog.decide``, ``runlog approve|reject``, or the owner's ``Run.decide``), with
        the run's workers killed first, a worker started just before, or as it is."""
        try:
            events = self.read(rid)
        except Exception as exc:  # noqa: BLE001 - a person cannot read it now either
            return f"skip: cannot read {rid}: {type(exc).__name__}"
        st = fold_valid(events)
        pending = [a for a in st.pending_approvals if (rid, a) not in self.decided]
        if not pending:
            return f"skip: nothing pending in {rid}"
        aid = sorted(pending)[0]
        verb = "approve" if approve else "reject"
        how = ""
        if owner == "kill-first":
            how = f"killed {self.kill_workers_of(rid)} workers first; "
        if channel == "owner":
            p = self.spawn_worker(rid, takeover=owner == "kill-first", extra=("--decide", verb))
            return f"{how}owner {p.name if p else '-'} of {rid} to {verb} its first pending"
        if owner == "owner-live":
            p = self.spawn_worker(rid)
            time.sleep(1.0)  # its start-up: the decision finds it holding the run (or gone)
            how = f"with {p.name if p else 'its workers'} running; "
        note = "" if approve else "rejected by the explorer"
        if channel == "console":
            tenant = self.tenants.get(rid, "default")
            outcome, detail = self.console.decide(
                tenant, rid, aid, approve=approve, by="explorer", note=note, wait_s=console_wait_s
            )
            assert self.out is not None
            self.out.faults[f"console decision {outcome}"] += 1
            if outcome in ("recorded", "queued"):
                self.decided.add((rid, aid))
            return f"{how}console {verb} {aid} of {rid}: {outcome} {detail}".rstrip()
        if channel == "cli":
            done = self.cli_decide(rid, aid, approve=approve, by="explorer", note=note)
            if done.returncode != 0:
                return (
                    f"{how}cli {verb} {aid} of {rid}: exit {done.returncode}: {done.stderr[-160:]}"
                )
            self.decided.add((rid, aid))
            return f"{how}cli {verb} {aid} of {rid}: {done.stdout.strip()[-80:]}"
        try:
            got = self.api_decide(rid, aid, approve=approve, by="explorer", note=note)
        except Exception as exc:  # noqa: BLE001 - refused or unavailable: recorded as such
            return f"{how}decide {aid} of {rid}: {type(exc).__name__}: {exc}"[:240]
        self.decided.add((rid, aid))
        return f"{how}{verb} {aid} of {rid}: {got}"

    def api_decide(self, rid: str, aid: str, *, approve: bool, by: str, note: str) -> str:
        import runlog

        return runlog.decide(
            rid,
            aid,
            approved=approve,
            decided_by=by,
            note=note,
            tenant=self.tenants.get(rid, "default"),
            settings=self.s,
        )

    def cli_decide(
        self, rid: str, aid: str, *, approve: bool, by: str, note: str
    ) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "runlog.cli", "approve" if approve else "reject"]
        cmd += [f"--tenant={self.tenants.get(rid, 'default')}", f"--by={by}", f"--note={note}"]
        cmd += ["--", rid, aid]  # a run id may begin with "-"
        return subprocess.run(
            cmd, env=self.env, cwd=str(ROOT), capture_output=True, text=True, timeout=120
        )

    def decide_again(self, rid: str, b: int, channel: str) -> str:
        """A second decision, contradicting the one that stands on one of the run's decided
        approvals: it must be refused, and the first must go on standing. With none decided
        but one pending, the first is taken here (``runlog.decide``) and, once it is in the
        log, contradicted."""
        from runlog.errors import DecisionConflict

        try:
            st = fold_valid(self.read(rid))
        except Exception as exc:  # noqa: BLE001 - a person cannot read it now either
            return f"skip: cannot read {rid}: {type(exc).__name__}"
        decided = sorted(a for a, ap in st.approvals.items() if ap.approved is not None)
        pending = sorted(a for a in st.pending_approvals if (rid, a) not in self.decided)
        done = ""
        if not decided and pending:
            done = self.decide(rid, approve=b % 2 == 0) + "; then "
            try:
                st = fold_valid(self.read(rid))
            except Exception as exc:  # noqa: BLE001 - a person cannot read it now either
                return f"{done}skip: cannot read {rid}: {type(exc).__name__}"
            decided = sorted(a for a, ap in st.approvals.items() if ap.approved is not None)
        if not decided:
            return f"{done}skip: nothing decided in {rid}"
        aid = decided[b % len(decided)]
        first = bool(st.approvals[aid].approved)
        again = not first
        verb = "approve" if again else "reject"
        self.agains.append((rid, aid, first))
        note = "a second, contradicting decision"
        what = f"{done}{channel} {verb} {aid} of {rid} (first: {'approve' if first else 'reject'})"
        if channel == "owner":
            p = self.spawn_worker(rid, extra=("--decide-again", f"{aid}:{verb}"))
            return f"{what}: by owner {p.name if p else '-'}"
        if channel == "console":
            outcome, detail = self.console.decide(
                self.tenants.get(rid, "default"),
                rid,
                aid,
                approve=again,
                by="explorer-again",
                note=note,
            )
            assert self.out is not None
            self.out.faults[f"console contradicting decision {outcome}"] += 1
            if outcome in ("recorded", "queued"):
                self.step_problems.append(f"{what} was accepted by the console: {outcome}")
            return f"{what}: console {outcome} {detail}".rstrip()
        if channel == "cli":
            done = self.cli_decide(rid, aid, approve=again, by="explorer-again", note=note)
            if done.returncode == 0:
                self.step_problems.append(f"{what} was accepted by the CLI: {done.stdout!r:.200}")
            return f"{what}: exit {done.returncode}"
        try:
            got = self.api_decide(rid, aid, approve=again, by="explorer-again", note=note)
        except DecisionConflict:
            return f"{what}: refused (DecisionConflict)"
        except Exception as exc:  # noqa: BLE001 - unavailable: recorded as such
            return f"{what}: {type(exc).__name__}: {exc}"[:240]
        self.step_problems.append(f"{what} was accepted by runlog.decide: {got}")
        return f"{what}: ACCEPTED ({got})"

    def rebuild_kill(self, b: int) -> str:
        """``runlog rebuild all`` SIGKILLed part way, at a point it is seen to reach: up to
        3 s after it was started (its start-up, or done already); as soon as its deletes
        began (a key of the projections it found gone: the next batches not deleted yet);
        or up to 1.5 s after it fenced the runners (a partition's generation moved: it
        deletes, then refolds from offset zero)."""
        from runlog.consumers.stores import PROJECTIONS, make_handler

        handlers = [
            make_handler(n, self.s.redis_key_prefix, self.s.events_topic) for n in PROJECTIONS
        ]
        gens = [h.keys.gen(p) for h in handlers for p in range(PARTITIONS)]
        padded = self.pad()
        point = ("start", "deletes", "refold", "refold")[b % 4]
        before: list[Any] = []
        sample: list[bytes] = []
        found: list[bytes] = []
        with contextlib.closing(self.r()) as r, contextlib.suppress(redis.RedisError):
            before = r.mget(gens)
            if point == "deletes":
                found = list(r.scan_iter(match=handlers[0].keys.pattern(), count=1000))
                sample = random.Random(b).sample(found, min(40, len(found)))
        name = f"rb{len(self.rebuilds) + 1}"
        log = self.dir / f"{name}.log"
        cmd = [sys.executable, "-m", "runlog.cli", "rebuild", "all"]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, env=self.env, cwd=str(ROOT), stdout=fh, stderr=fh)
        p = Proc(name, proc, log=log)
        self.rebuilds.append(p)
        t0 = time.monotonic()

        def until(seen: Any) -> float:
            with contextlib.closing(self.r()) as r:
                while proc.poll() is None and time.monotonic() - t0 < 30:
                    with contextlib.suppress(redis.RedisError):
                        if seen(r):
                            break
                    time.sleep(0.001)
            return time.monotonic() - t0

        if point == "start":
            delay_ms = (b * 7) % 3000
            time.sleep(delay_ms / 1000)
            when = f"{delay_ms} ms after its start"
        elif point == "deletes" and sample:
            at = until(lambda r: r.exists(*sample) < len(sample))
            when = f"as its deletes began (at {at:.2f} s; {len(found)} keys were there)"
        else:
            delay_ms = (b * 7) % 1500
            at = until(lambda r: r.mget(gens) != before)
            time.sleep(delay_ms / 1000)
            when = f"{delay_ms} ms after it fenced the runners (at {at:.2f} s)"
        if proc.poll() is not None:
            took = time.monotonic() - t0
            return (
                f"{padded}rebuild {name} ended ({proc.returncode}) before its kill, {when}, "
                f"{took:.2f} s"
            )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert self.out is not None
        self.out.faults["SIGKILL rebuild"] += 1
        return f"{padded}SIGKILL rebuild {name} {when}"

    def pad(self) -> str:
        """Once per history: ``PAD_RUNS`` finished runs produced straight into the log, so
        the projections hold more keys than a rebuild deletes in one batch (500) and a
        rebuild takes long enough to be killed in the middle of each of its phases."""
        if self.padded:
            return ""
        from confluent_kafka import Producer

        from runlog.schemas import _codec as codec

        producer = Producer({**self.s.kafka_common(), "linger.ms": 20})
        for i in range(PAD_RUNS):
            rid = f"{self.ns}-pad{i}"
            part = partition_for(rid, PARTITIONS)
            for seq, (et, payload) in enumerate(
                (
                    (EventType.RUN_STARTED, {"agent": "explorer-pad"}),
                    (EventType.RUN_FINISHED, {"outcome": "succeeded"}),
                ),
                start=1,
            ):
                ev = codec.build_event(
                    et, payload, run_id=rid, tenant="pad", seq=seq, epoch=1, writer_id="pad"
                )
                producer.produce(
                    self.s.events_topic,
                    codec.encode(ev),
                    rid,
                    partition=part,
                    headers=codec.headers(ev),
                )
            producer.poll(0)
        left = producer.flush(30)
        self.padded = PAD_RUNS - left
        return f"padded the log with {PAD_RUNS} finished runs; "

    def _ghost_delivered(self, err: Any, msg: Any) -> None:
        if err is None:
            self.ghosts.append((msg.partition(), msg.offset()))

    def set_aside_ghosts(self) -> None:
        """What an operator does with records nobody can decode under a run id: set them
        aside (``runlog records set-aside``), so the run's readers skip them."""
        from runlog.log._setaside import set_aside

        with contextlib.closing(self.r()) as client:
            for part, offset in self.ghosts:
                set_aside(
                    client,
                    self.s,
                    part,
                    offset,
                    by="explorer",
                    reason="hostile bytes",
                    error="undecodable",
                )

    def zombie_unseen(self, a: int) -> tuple[str, bytes] | None:
        """(run, value): a well-formed GUARDRAIL_TRIGGERED of a real run with a stale epoch
        (fenced by every reader), in Confluent's framing under an id looked up now."""
        from confluent_kafka import Producer

        from runlog.log._registry import ids_for
        from runlog.schemas import _models as m
        from runlog.schemas._codec import build_event, encode

        valid: list[Event] = []
        for i in range(len(self.runs)):  # the first run from ``a`` on with a valid event
            try:
                valid = [
                    e for e, ok in verdicts(self.read(self.runs[(a + i) % len(self.runs)])) if ok
                ]
            except Exception:  # noqa: BLE001 - not this one then
                continue
            if valid:
                break
        if not valid:
            return None
        rid = valid[-1].run_id
        last = valid[-1]
        # Of the type's current schema version, as a real stale writer would write it (a
        # v1 record of a type sealed since v2 is refused as malformed, never as stale).
        ev = build_event(
            EventType.GUARDRAIL_TRIGGERED,
            m.GuardrailTriggered(guardrail="zombie", severity="info", action="none"),
            run_id=rid,
            tenant=last.tenant,
            seq=last.seq + 1,
            epoch=last.epoch - 1,
            writer_id="zombie",
        )
        if self._producer is None:
            self._producer = Producer({**self.s.kafka_common(), "linger.ms": 5})
        return rid, encode(ev, ids_for(self.s))

    def hostile(self, b: int) -> int:
        from confluent_kafka import Producer

        from runlog.schemas._codec import encode, new_event_id

        if self._producer is None:
            self._producer = Producer({**self.s.kafka_common(), "linger.ms": 5})
        rng = random.Random(b)
        topic = self.s.events_topic
        n = 0
        for i in range(1 + b % 12):
            part = rng.randrange(PARTITIONS)
            kind = i % 5
            if kind == 0:  # garbage under a valid run id no worker uses
                self._producer.produce(
                    topic,
                    rng.randbytes(40),
                    f"{self.ns}-ghost{b}",
                    partition=part,
                    on_delivery=self._ghost_delivered,
                )
            elif kind == 1:  # runlog's magic, an unknown fingerprint, no key
                self._producer.produce(topic, b"\xc3\x01" + rng.randbytes(30), None, partition=part)
            elif kind == 2:  # a key that is not UTF-8
                self._producer.produce(topic, b"\x00junk", b"\xff\xfe\xfd", partition=part)
            elif kind == 3:  # a key no run id can be
                self._producer.produce(topic, b"{}", "bad key*{x}", partition=part)
            else:  # a zombie: a well-formed event of a real run with a stale epoch
                rid = self.run_of(b + i)
                if rid is None:
                    continue
                try:
                    events = self.read(rid)
                except Exception:  # noqa: BLE001 - no zombie then
                    continue
                valid = [e for e, ok in verdicts(events) if ok]
                if not valid or valid[-1].epoch < 2:
                    continue
                last = valid[-1]
                ev = last.model_copy(
                    update={
                        "event_id": new_event_id(),
                        "seq": last.seq + 1,
                        "epoch": last.epoch - 1,
                        "writer_id": "zombie",
                    }
                )
                self._producer.produce(
                    topic, encode(ev), rid, partition=partition_for(rid, PARTITIONS)
                )
            n += 1
        self._producer.flush(30)
        return n

    # ----------------------------------------------------------------- one history
    def execute(
        self, history: list[Step], kept: list[int], *, generated: int, quiet: bool = False
    ) -> Outcome:
        """Run ``history`` (steps ``kept`` of the ``generated`` the seed stands for)."""
        out = Outcome(self.seed, generated, kept)
        self.out = out
        t0 = time.monotonic()
        self.ready()
        checker = Checker(self)
        try:
            for i, step in enumerate(history):
                self.cont_paused()
                if self.down_nodes and step.kind not in ("leader_kill", "broker_restart"):
                    # A killed leader stays down for one step, then comes back.
                    self.heal_nodes()
                self.kinds_done.add(step.kind)
                try:
                    what = self.do(step)
                except Exception as exc:  # noqa: BLE001 - a fault that could not be injected
                    what = f"could not: {type(exc).__name__}: {exc}"[:300]
                line = f"[{kept[i]:3d}] {step.text():48s} {what}"
                out.history.append(line)
                if not quiet:
                    print(line, flush=True)
                problems = checker.after_step()
                if problems:
                    out.violations.extend(f"after step {kept[i]}: {p}" for p in problems)
                    break
            if not out.violations:
                out.violations.extend(checker.at_end())
        finally:
            self.teardown()
            out.seconds = time.monotonic() - t0
        return out

    def teardown(self) -> None:
        self.cont_paused(all_of_them=True)
        for delay in self.delays:
            delay.close()
        self.delays.clear()
        for p in self.workers + self.runners + self.rebuilds:
            if p.proc.poll() is None:
                p.proc.kill()
            with contextlib.suppress(Exception):
                p.proc.wait(timeout=10)
        with contextlib.suppress(Exception):
            self.heal_nodes()
        with contextlib.suppress(Exception):
            self.console.down()
        if self._producer is not None:
            self._producer.flush(5)


def verdicts(events: list[Event]) -> list[tuple[Event, bool]]:
    st = RunState()
    return [(ev, accept(st, ev)) for ev in events]


def fold_valid(events: list[Event]) -> RunState:
    st = RunState()
    for ev in events:
        apply(st, ev)
    return st


# --------------------------------------------------------------------------- checker


class Checker:
    """The invariants, over the log, the ledger, the journal and the projections.

    1. No effect happens twice for one key unless a person (an approved retry of an
       uncertain call) or a compensation (the first effect was undone) said so; ``probe``
       is declared safe to repeat and is exempt.
    2. Every effect is completed in its run's log, or its call is still open (uncertain or
       escalated), or it was compensated: never silently forgotten.
    3. No acknowledged append is lost: every append a worker was told is durable is the
       valid event at that seq and epoch (and event id, where the worker knew it).
    4. One valid owner per epoch, contiguous seqs from 1, epochs never go back, nothing
       valid after RUN_FINISHED; an open never got an epoch already used in the log.
    5. The projections equal a rebuild from zero.
    6. ``runlog verify --all`` passes.
    7. Nothing waits forever without being named: a run that is not finished has a
       pending approval or an open call in the uncertain-call queue (or its topic was
       grown, and every open of it is refused by design).
    8. No worker, runner or rebuild stopped with an unclear error (a traceback).
    9. One start per run: one valid RUN_STARTED, and at most one worker ever opened the
       run as new (whatever its id's shape and whatever Redis lost).
    10. Tenants: a run of a valid tenant name carries it in every event, end to end; a
       name runlog refuses stops its worker with ``InvalidTenant`` and nothing else, and
       leaves no event and no effect.
    11. A decision is final: a second, contradicting decision (API, CLI or the owner) is
       refused and never reaches the log, the first stands in the fold, and effects follow
       the first only (an approved retry is counted from standing decisions; a rejected
       ``refund`` whose effect happened is undone by its compensation).
    """

    def __init__(self, ex: Explorer) -> None:
        self.ex = ex
        self.seen_exits: set[str] = set()

    # ------------------------------------------------------------- cheap, every step
    def after_step(self) -> list[str]:
        problems = self.exits()
        problems += self.ex.step_problems
        self.ex.step_problems = []
        problems += self.owners_accepted_again()
        planted = os.environ.get("EXPLORER_PLANT")
        if planted and self.ex.kinds_done >= set(planted.split(",")):
            # A planted failure (tests of the shrinker): fails once these kinds all ran.
            problems.append(f"planted: {planted} all ran")
        problems += self.doubles()
        if not self.ex.down_nodes:
            for rid in self.ex.every_run:
                try:
                    events = self.ex.read(rid)
                except Exception:  # noqa: BLE001 - checked again at the end, healed
                    continue
                problems += [f"{rid}: {p}" for p in log_problems(events)]
        return problems

    def exits(self) -> list[str]:
        assert self.ex.out is not None
        problems: list[str] = []
        for p in self.ex.workers + self.ex.runners + self.ex.rebuilds:
            code = p.proc.poll()
            if code is None or p.name in self.seen_exits:
                continue
            self.seen_exits.add(p.name)
            kind = "worker" if p.run_id else "rebuild" if p.name.startswith("rb") else "runner"
            self.ex.out.exits[f"{kind} {EXIT_NAMES.get(code, str(code))}"] += 1
            unclear = (
                code == 1
                or (kind == "runner" and code not in (0, -9, -15))
                or (kind == "worker" and code not in EXIT_NAMES)
            )
            if kind == "worker" and p.refusal and code not in (11, -9):
                problems.append(
                    f"worker {p.name} of {p.run_id} (tenant {self.ex.tenants[p.run_id]!a}, "
                    f"which runlog must refuse) exited {code}, not InvalidTenant"
                )
            elif kind == "worker" and not p.refusal and code == 11:
                problems.append(
                    f"worker {p.name} of {p.run_id}: valid tenant "
                    f"{self.ex.tenants[p.run_id]!a} refused as invalid"
                )
            elif unclear:
                tail = p.log.read_text(errors="replace")[-1500:] if p.log else ""
                problems.append(f"{kind} {p.name} {p.run_id} exited {code}:\n{tail}")
        return problems

    def owners_accepted_again(self) -> list[str]:
        """An owner that recorded a second, contradicting decision (``--decide-again``)."""
        problems = []
        for line in self.ex.journal.read_text().splitlines():
            j = json.loads(line)
            if j["kind"] == "decide-accepted" and j.get("by") == "explorer-again":
                problems.append(
                    f"owner {j['worker']} of {j['run']} recorded a second, contradicting "
                    f"decision on {j['approval_id']}"
                )
        return problems

    def ledger(self) -> tuple[dict[str, int], dict[str, str], dict[str, int], dict[str, str]]:
        led, lk = self.ex.ledger, self.ex.lk
        counts = {k.decode(): int(v) for k, v in led.hgetall(lk("L:count")).items()}
        tools = {k.decode(): v.decode() for k, v in led.hgetall(lk("L:tool")).items()}
        undone = {k.decode(): int(v) for k, v in led.hgetall(lk("L:undone")).items()}
        runs = {k.decode(): v.decode() for k, v in led.hgetall(lk("L:run")).items()}
        return counts, tools, undone, runs

    def doubles(self, approved: Counter[str] | None = None) -> list[str]:
        """Keys whose effect happened more often than 1 + undone + approved retries.

        During the run (``approved`` None) approvals are read from the key's run log
        only when a key is over its undone allowance; at the end they come from every log.
        """
        counts, tools, undone, _ = self.ledger()
        problems = []
        for key, n in counts.items():
            if tools.get(key) == "probe" or n <= 1 + undone.get(key, 0):
                continue
            if approved is None and self.approved_retry(key):
                continue
            if approved is not None and n <= 1 + undone.get(key, 0) + approved[key]:
                continue
            problems.append(f"effect {key} ({tools.get(key)}) happened {n} times")
        return problems

    def approved_retry(self, key: str) -> bool:
        _, _, _, runs = self.ledger()
        rid = runs.get(key)
        if rid is None:
            return False
        try:
            return approvals_of(self.ex.read(rid))[key] > 0
        except Exception:  # noqa: BLE001 - unreadable now: decide at the end
            return True

    # ------------------------------------------------------------- at the end
    def at_end(self) -> list[str]:
        ex = self.ex
        assert ex.out is not None
        ex.cont_paused(all_of_them=True)
        ex.heal_nodes()
        # Clocks too: a worker 30 s behind stamps a commit deadline already past by the
        # receiver's clock (``wire`` refuses it, safely, every time), so the runs are
        # driven to their end on the real clock, as every other fault is healed first.
        ex.skew_s = 0.0
        for key in ex.ledger.scan_iter(match=ex.lk("fault:*")):
            ex.ledger.delete(key)
        for key in ex.ledger.scan_iter(match=ex.lk("recon:*")):
            ex.ledger.delete(key)
        deadline = time.monotonic() + 30
        while ex.alive(ex.workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        for w in ex.alive(ex.workers):
            w.proc.kill()
            w.proc.wait(timeout=10)
        problems = self.exits()
        # Drive every run until it finishes or waits for a person who already decided all.
        # Every other decision here is taken in the console (the API takes the rest, and
        # any the console could not take), so most histories decide there at least once.
        end_decisions = 0
        for _round in range(6):
            open_runs = []
            for rid in ex.every_run:
                st = fold_valid(ex.read(rid))
                if st.status == "finished":
                    continue
                open_runs.append(rid)
                for aid in sorted(st.pending_approvals):
                    if (rid, aid) not in ex.decided:
                        channel = "console" if end_decisions % 2 == 0 else "api"
                        end_decisions += 1
                        if channel == "console" and not ex.alive(ex.runners):
                            ex.spawn_runner()  # the console lists what the runners index
                        # The index may be refolding after a rebuild: a person would wait.
                        what = ex.decide(rid, approve=True, channel=channel, console_wait_s=30)
                        if (rid, aid) not in ex.decided:
                            what += f"; then {ex.decide(rid, approve=True)}"
                        ex.out.history.append(f"[end] {what}")
            if not open_runs or ex.grown:
                break
            procs = [ex.spawn_worker(rid, takeover=True) for rid in open_runs]
            for p in procs:
                if p is not None:
                    try:
                        p.proc.wait(timeout=90)
                    except subprocess.TimeoutExpired:
                        p.proc.kill()
                        problems.append(f"worker {p.name} of {p.run_id} hung at the end")
            problems += self.exits()
        if not ex.alive(ex.runners):
            ex.spawn_runner()
        states: dict[str, RunState] = {}
        approved: Counter[str] = Counter()
        logs: dict[str, list[Event]] = {}
        for rid in ex.every_run:
            events = logs[rid] = ex.read(rid)
            problems += [f"{rid}: {p}" for p in log_problems(events)]
            states[rid] = fold_valid(events)
            approved.update(approvals_of(events))
            problems += [f"{rid}: {p}" for p in self.acks(rid, events)]
        problems += self.doubles(approved)
        problems += self.paused_calls(logs)
        problems += [f"{rid}: {p}" for rid, ev in logs.items() for p in absence_problems(ev)]
        problems += self.forgotten(states)
        problems += self.tenants(states)
        problems += self.decisions_final(states)
        problems += self.projections()
        ex.set_aside_ghosts()
        problems += self.verify_all()
        problems += self.liveness(states)
        counts, _, _, _ = self.ledger()
        ex.out.effects = sum(counts.values())
        ex.out.runs = len(ex.every_run)
        ex.out.finished = sum(1 for st in states.values() if st.status == "finished")
        ex.out.waiting = ex.out.runs - ex.out.finished
        return problems

    def paused_calls(self, logs: dict[str, list[Event]]) -> list[str]:
        """Every ``pause_call``: what the receiver applied under the frozen call's key, in
        the end (after the woken request and whatever recovery and a person did). A tool
        whose declaration allows a retry (``RETRY_ALLOWED``) has at most one effect, unless
        a compensation undid one; a tool that declares nothing (``DECLARES_NOTHING``) was
        not retried before a person decided, and the new owner recorded why (a rule, and
        the action: wait or ask a person)."""
        counts, _, undone, _ = self.ledger()
        problems = []
        for rec in self.ex.out.pauses if self.ex.out is not None else []:
            tool, key, rid = rec["tool"], rec["key"], rec["run"]
            rec["effects"] = n = counts.get(key, 0)
            rec["undone"] = u = undone.get(key, 0)
            rec["doubled"] = n > 1 + u
            events = logs.get(rid, [])
            recon = [
                (ev.seq, ev.payload)
                for ev, ok in verdicts(events)
                if ok
                and ev.type is EventType.RECONCILIATION_ATTEMPTED
                and ev.payload.idempotency_key == key
            ]
            rec["recovery"] = [f"{p.outcome}->{p.action}" for _, p in recon]
            what = f"pause of {tool} ({PAUSE_TOOLS[tool][1]}) in {rid}, key {key}"
            if tool in RETRY_ALLOWED and rec["doubled"]:
                problems.append(f"{what}: its effect happened {n} times ({u} undone)")
            if tool not in DECLARES_NOTHING:
                continue
            decided = next(
                (
                    ev.seq
                    for ev, ok in verdicts(events)
                    if ok and ev.type is EventType.APPROVAL_DECIDED
                ),
                None,
            )
            before = [p for seq, p in recon if decided is None or seq < decided]
            if not before:
                problems.append(f"{what}: the new owner recorded no reconciliation of it")
            for p in before:
                if p.action not in ("escalate", "keep_uncertain") or not p.rule:
                    problems.append(
                        f"{what}: recovery did {p.action!r} on {p.outcome!r} before a "
                        f"person decided (rule {p.rule!r})"
                    )
        return problems

    def acks(self, rid: str, events: list[Event]) -> list[str]:
        assert self.ex.out is not None
        valid_at = {ev.seq: ev for ev, ok in verdicts(events) if ok}
        epochs_used = {ev.epoch for ev in valid_at.values()}
        problems = []
        opens: list[int] = []
        starters: list[str] = []
        for line in self.ex.journal.read_text().splitlines():
            j = json.loads(line)
            if j["run"] != rid:
                continue
            if j["kind"] == "open":
                if any(e >= j["epoch"] and e in epochs_used for e in opens):
                    problems.append(f"{j['worker']} opened at epoch {j['epoch']} after {opens}")
                opens.append(j["epoch"])
                if j["seq"] == 1:
                    starters.append(f"{j['worker']} at epoch {j['epoch']}")
            if j["kind"] != "ack":
                continue
            self.ex.out.acks += 1
            ev = valid_at.get(j["seq"])
            if ev is None or ev.epoch != j["epoch"]:
                got = "nothing" if ev is None else f"epoch {ev.epoch}"
                problems.append(
                    f"acked seq {j['seq']} epoch {j['epoch']} ({j['worker']}) is {got} in the log"
                )
            elif j["event_id"] and ev.event_id != j["event_id"]:
                problems.append(f"acked seq {j['seq']} ({j['worker']}) is another event")
        if len(starters) > 1:
            problems.append(f"started as a new run by {len(starters)} workers: {starters}")
        return problems

    def forgotten(self, states: dict[str, RunState]) -> list[str]:
        counts, tools, undone, runs = self.ledger()
        problems = []
        for key in counts:
            st = states.get(runs.get(key, ""))
            if st is None:
                problems.append(f"effect {key} of no known run")
                continue
            if key in st.completed_calls or key in st.open_calls or undone.get(key):
                continue
            problems.append(
                f"effect {key} ({tools.get(key)}) of {runs.get(key)} is neither completed, "
                "open nor compensated in the log: forgotten"
            )
        return problems

    def tenants(self, states: dict[str, RunState]) -> list[str]:
        ex = self.ex
        problems = []
        for rid, st in states.items():
            began = ex.tenants.get(rid, "default")
            if st.tenant and st.tenant != began:
                problems.append(f"{rid}: tenant {st.tenant!a} in the log, started as {began!a}")
        _, _, _, runs = self.ledger()
        for rid in ex.refused:
            events = ex.read(rid)
            if events:
                problems.append(
                    f"{rid} of refused tenant {ex.tenants[rid]!a} has {len(events)} events"
                )
            effects = [k for k, r in runs.items() if r == rid]
            if effects:
                problems.append(f"{rid} of refused tenant has effects {effects[:3]}")
        return problems

    def decisions_final(self, states: dict[str, RunState]) -> list[str]:
        """Every contradicting decision tried: refused, so the first still stands."""
        problems = []
        for rid, aid, first in self.ex.agains:
            st = states.get(rid)
            ap = None if st is None else st.approvals.get(aid)
            if ap is None or ap.approved is not first:
                got = None if ap is None else ap.approved
                problems.append(
                    f"{rid}: approval {aid} first decided approved={first} reads {got} now"
                )
        counts, tools, undone, _ = self.ledger()
        for rid, st in states.items():
            for aid, ap in st.approvals.items():
                key = ap.idempotency_key
                if ap.approved is not False or key is None or tools.get(key) != "refund":
                    continue
                if counts.get(key, 0) > 0 and not undone.get(key):
                    problems.append(
                        f"{rid}: {aid} rejected a refund whose effect {key} happened, "
                        "and nothing undid it (a reversible call's rejection is compensated)"
                    )
        for rid in self.ex.every_run:
            for ev in self.ex.read(rid):
                if (
                    ev.type is EventType.APPROVAL_DECIDED
                    and getattr(ev.payload, "decided_by", "") == "explorer-again"
                ):
                    problems.append(
                        f"{rid}: a refused, contradicting decision on {ev.payload.approval_id} "
                        f"is in the log at seq {ev.seq}"
                    )
        return problems

    def projections(self) -> list[str]:
        from projections_support import dump, wait_caught_up

        from runlog.consumers.runner import rebuild
        from runlog.consumers.stores import PROJECTIONS

        ex = self.ex
        settings = ex.s
        if ex.grown:
            settings = settings.model_copy(update={"partitions": PARTITIONS + 3})
        with contextlib.closing(ex.r()) as client:
            try:
                wait_caught_up(client, settings, timeout=90)
                # A rebuild killed part way leaves its projections marked incomplete (their
                # positions may look caught up): the runners complete it once the dead
                # rebuild's marker expires. Compare only what they completed.
                from runlog.consumers.stores import make_handler as _handler

                marks = [
                    key
                    for n in PROJECTIONS
                    for h in [_handler(n, settings.redis_key_prefix, settings.events_topic)]
                    for key in (h.keys.rebuild_marker(), h.keys.incomplete_marker())
                ]
                deadline = time.monotonic() + 120
                while client.exists(*marks):
                    if time.monotonic() > deadline:
                        return [f"projections: still marked rebuilding/incomplete: {marks}"]
                    time.sleep(0.2)
                wait_caught_up(client, settings, timeout=90)
            except AssertionError as exc:
                return [f"projections: {exc}"]
            for p in ex.alive(ex.runners):
                p.proc.send_signal(signal.SIGTERM)
                p.proc.wait(timeout=30)
            self.exits()
            live = dump(client, settings)
            from runlog.consumers import _queries as queries

            q = queries.quarantined(client, settings)
            assert ex.out is not None
            ex.out.quarantined = len(q) if hasattr(q, "__len__") else 0
            waited = sum(
                "retrying in" in (p.log.read_text(errors="replace") if p.log else "")
                and "egistry" in (p.log.read_text(errors="replace") if p.log else "")
                for p in ex.runners
            )
            if waited:
                ex.out.faults["runner waited out a registry outage"] += waited
            # An outage says nothing about a record: none may be set aside for one.
            outage = [r for r in q if "RegistryUnavailable" in str(r.get("error", ""))]
            if outage:
                return [f"quarantined for a registry outage: {outage[0]!r:.400}"]
            rebuild(client, settings, PROJECTIONS)
            rebuilt = dump(client, settings)
        if live != rebuilt:
            diff = sorted(k for k in set(live) | set(rebuilt) if live.get(k) != rebuilt.get(k))
            shown = [
                f"{k}: live {live.get(k)!r:.400} / rebuilt {rebuilt.get(k)!r:.400}"
                for k in diff[:4]
            ]
            return [f"projections differ from a rebuild at {diff[:8]}", *shown]
        return []

    def verify_all(self) -> list[str]:
        ex = self.ex
        env = dict(ex.env)
        if ex.grown:
            env["RUNLOG_PARTITIONS"] = str(PARTITIONS + 3)
        done = subprocess.run(
            [sys.executable, "-m", "runlog.cli", "verify", "--all"],
            env=env,
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0 and not ex.grown:
            return [
                f"runlog verify --all exited {done.returncode}: {done.stdout[-1500:]}"
                f"{done.stderr[-1500:]}"
            ]
        return []

    def liveness(self, states: dict[str, RunState]) -> list[str]:
        from runlog.consumers import _queries as queries

        if self.ex.grown:
            return []
        with contextlib.closing(self.ex.r()) as client:
            queue = queries.uncertain_report(client, self.ex.s).open
        queued = {(c["run_id"], c["idempotency_key"]) for c in queue}
        problems = []
        for rid, st in states.items():
            if st.status == "finished":
                continue
            if st.pending_approvals:
                continue
            if any((rid, key) in queued for key in st.open_calls):
                continue
            problems.append(
                f"{rid} is stuck at seq {st.seq} ({st.status}) with nothing pending: "
                f"open calls {sorted(st.open_calls)}"
            )
        return problems


def absence_problems(events: list[Event]) -> list[str]:
    """A retry on a lookup's "absent" of a risky tool whose receiver declares nothing: an
    absence that is not final (the original request could still land) never allows one."""
    return [
        f"{ev.payload.name} {ev.payload.idempotency_key} retried on a non-final absence "
        f"(seq {ev.seq}, rule {ev.payload.rule!r})"
        for ev, ok in verdicts(events)
        if ok
        and ev.type is EventType.RECONCILIATION_ATTEMPTED
        and ev.payload.outcome == "absent"
        and ev.payload.action not in ("escalate", "keep_uncertain")
        and ev.payload.name in DECLARES_NOTHING
    ]


def approvals_of(events: list[Event]) -> Counter[str]:
    """Keys a person approved to retry (each approval may add one effect).

    Only the decision that stands counts (the first valid one of its approval): a later,
    superseded approval must not let an effect happen again."""
    requested: dict[str, str] = {}
    decided: set[str] = set()
    out: Counter[str] = Counter()
    for ev, ok in verdicts(events):
        if not ok:
            continue
        p = ev.payload
        if ev.type is EventType.APPROVAL_REQUESTED and getattr(p, "idempotency_key", None):
            requested[p.approval_id] = p.idempotency_key
        elif ev.type is EventType.APPROVAL_DECIDED and p.approval_id not in decided:
            decided.add(p.approval_id)
            key = requested.get(p.approval_id)
            if p.approved and key is not None:
                out[key] += 1
    return out


def log_problems(events: list[Event]) -> list[str]:
    good = [ev for ev, ok in verdicts(events) if ok]
    if not good:
        return []
    problems = []
    if [ev.seq for ev in good] != list(range(1, len(good) + 1)):
        problems.append("valid seqs not contiguous from 1")
    if good[0].type is not EventType.RUN_STARTED:
        problems.append(f"first valid event is {good[0].type.value}")
    started = [ev.seq for ev in good if ev.type is EventType.RUN_STARTED]
    if len(started) > 1:
        problems.append(f"{len(started)} valid RUN_STARTED (seqs {started})")
    owners: dict[int, set[str]] = {}
    for ev in good:
        owners.setdefault(ev.epoch, set()).add(ev.writer_id)
    two = {e: w for e, w in owners.items() if len(w) > 1}
    if two:
        problems.append(f"epochs with two writers: {two}")
    epochs = [ev.epoch for ev in good]
    if epochs != sorted(epochs):
        problems.append("valid epochs went backwards")
    fin = [i for i, ev in enumerate(good) if ev.type is EventType.RUN_FINISHED]
    if fin and fin[0] != len(good) - 1:
        problems.append("valid events after RUN_FINISHED")
    ids = Counter(ev.event_id for ev in events)
    if any(n > 1 for n in ids.values()):
        problems.append("an event id is in the log twice")
    return problems


# --------------------------------------------------------------------------- driving


@contextlib.contextmanager
def environment(
    *, keep_cluster: bool | None = None
) -> Iterator[tuple[stack.StackConfig, LedgerServer]]:
    """The 3-node cluster and the receivers' ledger for the explorer and the soaks, stopped
    afterwards (the cluster only if this process started it, and not with ``keep_cluster``).

    A SIGTERM stops them too, then ends the process at once (``os._exit``): the caller's code
    after its ``with`` block does not run. ``soak.py`` prints each phase's row as it ends, so
    a terminated soak has printed what it found, though not its closing table or ``--json``;
    ``soak_network.py`` prints its verdicts only after the block, so a terminated one prints
    none."""
    cfg = stack.StackConfig.from_env(nodes=3)
    # Ours to stop only if nothing of it ran before: a node down (a fault another
    # session left) does not make the cluster ours.
    started = not any(sv.running for sv in stack.status(cfg).services)
    if keep_cluster is None:
        keep_cluster = bool(os.environ.get("EXPLORER_KEEP_CLUSTER"))
    previous = _exit_on_sigterm()
    try:
        ledger = LedgerServer(cfg)
        try:
            # Inside the clean-up's reach: a SIGTERM (or a failure) while the cluster or the
            # ledger is still starting stops the part of it already running.
            stack.up(cfg, timeout=180)
            ledger.up()
            yield cfg, ledger
        finally:
            ledger.down()
            stop_registry()
            if started and not keep_cluster:
                stack.down(cfg)
    except _Terminated as exc:
        # What this process started is stopped now. Leave at once: the interpreter's own
        # exit would collect the Kafka clients the interrupted history left open, and
        # destroying a consumer waits for the brokers just stopped (it hung there).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.code if isinstance(exc.code, int) else 1)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(SystemExit):
    """SIGTERM, raised in the main thread by ``_exit_on_sigterm``'s handler."""


def _exit_on_sigterm() -> Any:
    """Make SIGTERM (``timeout``, a cancelled job) end this process through an exception, so
    the ``finally`` blocks stop what it started: the history's workers, the ledger and the
    cluster. Python's default is to die without running them, which left the 3-node cluster
    running. Returns the handler it replaced, or None off the main thread, where no handler can
    be set."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, _frame: Any) -> None:
        raise _Terminated(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def explore(
    cfg: stack.StackConfig,
    ledger: LedgerServer,
    seed: int,
    steps: int,
    keep: list[int] | None = None,
    *,
    quiet: bool = False,
) -> Outcome:
    full = generate(seed, steps)
    kept = list(range(len(full))) if keep is None else [i for i in keep if i < len(full)]
    kept = in_order(full, kept)
    registry = registry_for(cfg) if uses_registry(seed) else None
    ex = Explorer(cfg, ledger, seed, registry)
    try:
        return ex.execute([full[i] for i in kept], kept, generated=steps, quiet=quiet)
    finally:
        cleanup(ex)


def cleanup(ex: Explorer) -> None:
    from confluent_kafka.admin import AdminClient

    with contextlib.suppress(Exception):
        admin = AdminClient(ex.s.kafka_common())
        topics = [t for t in admin.list_topics(timeout=10).topics if t.startswith(ex.ns)]
        if topics:
            for f in admin.delete_topics(topics).values():
                f.result(timeout=30)
    with contextlib.suppress(Exception), contextlib.closing(ex.r()) as r:
        keys = list(r.scan_iter(match=f"{ex.ns}*", count=1000))
        if keys:
            r.delete(*keys)
    with contextlib.suppress(Exception):
        keys = list(ex.ledger.scan_iter(match=f"{ex.ns}:*", count=1000))
        if keys:
            ex.ledger.delete(*keys)
    if not os.environ.get("EXPLORER_KEEP_LOGS"):
        shutil.rmtree(ex.dir, ignore_errors=True)


def replay_command(seed: int, steps: int, kept: list[int]) -> str:
    keep = ",".join(map(str, sorted(kept)))
    return f"make explore SEED={seed} STEPS={steps} KEEP={keep}"


def shrink(
    cfg: stack.StackConfig,
    ledger: LedgerServer,
    failing: Outcome,
    *,
    budget_s: float = 900,
    tries: int = 2,
) -> Outcome:
    """The shortest history that still fails: drop chunks, then single steps, re-running.

    A re-run may pass by timing alone, so a candidate counts as failing if any of
    ``tries`` executions fails.
    """
    best = failing
    deadline = time.monotonic() + budget_s
    # A violation seen after step N owes nothing to the steps after N: cut them first.
    first = failing.violations[0] if failing.violations else ""
    if first.startswith("after step "):
        last = int(first.split()[2].rstrip(":"))
        cut = [i for i in best.kept if i <= last]
        if cut != best.kept:
            got = explore(cfg, ledger, best.seed, best.steps, cut, quiet=True)
            print(
                f"  shrink: {len(cut)} steps (up to the failing one) -> "
                f"{'fails' if got.failed else 'passes'}",
                flush=True,
            )
            if got.failed:
                best = got
    chunk = max(1, len(best.kept) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i = 0
        progressed = False
        while i < len(best.kept) and time.monotonic() < deadline:
            candidate = best.kept[:i] + best.kept[i + chunk :]
            if not candidate:
                i += chunk
                continue
            for _ in range(tries):
                got = explore(cfg, ledger, best.seed, best.steps, candidate, quiet=True)
                print(
                    f"  shrink: {len(candidate)} steps -> {'fails' if got.failed else 'passes'}",
                    flush=True,
                )
                if got.failed:
                    best = got
                    progressed = True
                    break
            else:
                i += chunk
        if not progressed:
            chunk //= 2
    return best


def report(out: Outcome) -> str:
    lines = [
        f"seed {out.seed}: {len(out.kept)} of {out.steps} steps, {out.seconds:.0f} s, "
        f"runs {out.runs} (finished {out.finished}, waiting for a person {out.waiting}), "
        f"acks {out.acks}, effects {out.effects}, quarantined {out.quarantined}",
        f"  faults: {dict(out.faults)}",
        f"  exits: {dict(out.exits)}",
    ]
    if out.pauses:
        lines.append("  paused calls: " + "; ".join(pause_line(p) for p in out.pauses))
    if out.failed:
        lines.append("  VIOLATIONS:")
        lines += [f"    {v}" for v in out.violations]
        lines.append("  history:")
        lines += [f"    {h}" for h in out.history]
        lines.append(f"  replay: {replay_command(out.seed, out.steps, out.kept)}")
    return "\n".join(lines)


def pause_line(p: dict[str, Any]) -> str:
    """One ``pause_call``: tool, how taken over, effects (doubled?), what recovery did."""
    doubled = ""
    if p.get("doubled"):
        doubled = " DOUBLED" if p["tool"] in RETRY_ALLOWED else " (a person approved a retry)"
    recovery = ",".join(p.get("recovery", [])) or "-"
    return (
        f"{p['tool']} ({PAUSE_TOOLS[p['tool']][1]}, {p['how']}): {p.get('effects')} effect(s)"
        f"{doubled}, recovery {recovery}, new owner {p.get('new_exit')}, "
        f"woken {p.get('old_exit')}, {p.get('seconds')} s"
    )


def load_seeds() -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(SEEDS_FILE.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="explorer")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="one seed (and optionally a subset of its steps)")
    p_run.add_argument("--seed", type=int, required=True)
    p_run.add_argument("--steps", type=int, default=40)
    p_run.add_argument("--keep", default="", help="comma-separated step indexes to keep")
    p_run.add_argument("--no-shrink", action="store_true")
    p_ever = sub.add_parser("forever", help="random seeds until one fails (unbounded)")
    p_ever.add_argument("--steps", type=int, default=40)
    p_ever.add_argument("--no-shrink", action="store_true")
    opts = ap.parse_args(argv)
    with environment() as (cfg, ledger):
        if opts.cmd == "run":
            seeds = iter([opts.seed])
        else:
            seeds = iter(lambda: random.SystemRandom().randrange(10**6), None)
        for seed in seeds:
            keep = [int(x) for x in opts.keep.split(",") if x] if opts.cmd == "run" else []
            out = explore(cfg, ledger, seed, opts.steps, keep or None)
            print(report(out), flush=True)
            if out.failed:
                if not opts.no_shrink:
                    print("shrinking...", flush=True)
                    out = shrink(cfg, ledger, out)
                    print("shortest failing history:\n" + report(out), flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
