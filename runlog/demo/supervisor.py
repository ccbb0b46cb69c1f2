"""The demo's supervisor: runs the reconciliation agent through kill -9, a pause and people.

    python -m runlog.demo run --seed 7 --kills 3

It starts the ledger service (and the projection services, when this build has them),
then the agent as a worker subprocess. It SIGKILLs the worker at seeded random moments and
restarts it with the same run id; once, it SIGSTOPs a worker past its lease, starts a
second one, then SIGCONTs the first, which must end ``Fenced``. It is also the "person":
when a worker exits escalated, it looks at the evidence and calls ``runlog.decide``.
It ends with a summary read from the log and the ledger, and exits non-zero unless every
effect happened exactly once and the run verifies.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import IO, Any

import runlog
from runlog.bootstrap import Services
from runlog.demo.agent import (
    CORRECTIONS,
    EXIT_ESCALATED,
    EXIT_FENCED,
    EXIT_FINISHED,
    EXIT_LOCKED,
    EXIT_UNCERTAIN,
    TENANT,
    TICKETS,
)
from runlog.demo.report import build_report, describe_tail, print_report, read_log
from runlog.log.clients import redis_client
from runlog.projections.run_state import fold
from runlog.schemas.keys import new_run_id
from runlog.settings import Settings

EXIT_NAMES = {
    EXIT_FINISHED: "finished",
    1: "error",
    EXIT_ESCALATED: "escalated",
    EXIT_UNCERTAIN: "uncertain",
    EXIT_FENCED: "fenced",
    EXIT_LOCKED: "locked",
    7: "append outcome unknown",
    -signal.SIGKILL: "SIGKILL",
}
DEMO_LEASE_TTL_MS = "3000"
"""Short leases so a killed worker's successor waits seconds, not the default 15 s."""
MAX_UNEXPECTED = 5


def _python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


# The projection services (`runlog project all`), run beside the demo; the summary then
# also reads the state projection.
PROJECTIONS_CMD = _python_module("runlog.cli", "project", "all")


# ------------------------------------------------------------------------------ processes


@dataclass
class Attempt:
    n: int
    pid: int
    reason: str
    rc: int | None = None
    outcome: str = ""
    opened_after_s: float | None = None
    ran_s: float = 0.0
    killed: bool = False
    paused: bool = False
    log_tail: str = ""


class Child:
    """A subprocess whose output lines are echoed with a prefix and watched."""

    def __init__(self, label: str, cmd: list[str], env: dict[str, str], echo: bool) -> None:
        self.label = label
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self.opened = threading.Event()
        self._echo = echo
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        stream: IO[str] | None = self.proc.stdout
        assert stream is not None
        for raw in stream:
            line = raw.rstrip("\n")
            self.lines.append(line)
            if line.startswith(("opened run", "ledger listening")):
                self.opened.set()
            if self._echo:
                print(f"    {self.label}| {line}", flush=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            if self.wait(5) is None:
                self.signal(signal.SIGKILL)
                self.wait(5)
        self._thread.join(timeout=2)


def _leaving(child: Child) -> bool:
    """The worker already reported how it ends (pausing it now would show nothing)."""
    last = child.lines[-1] if child.lines else ""
    return last.startswith(("escalated:", "uncertain:", "fenced:", "run finished", "append"))


# ------------------------------------------------------------------------------- the plan


def fault_plan(rng: random.Random) -> dict[str, Any]:
    """Which ids the ledger makes uncertain, chosen by the seed.

    One idempotent correction loses its response (retried with the same key: replayed);
    one plain correction loses its response (lookup: match); one is slow past the client's
    deadline (lookup: absent, retried); one loses its response and its first lookup is
    unavailable (stays uncertain until a later worker's lookup matches). One ticket loses
    its response after filing (a person rejects a retry), the other is dropped before
    filing (a person approves a retry with the same key).
    """
    idem = [c.correction_id for c in CORRECTIONS if c.endpoint == "idempotent"]
    plain = [c.correction_id for c in CORRECTIONS if c.endpoint == "plain"]
    a = rng.choice(idem)
    match, absent, unavailable = rng.sample(plain, 3)
    filed, not_filed = rng.sample([t[0] for t in TICKETS], 2)
    return {
        "drop_after_commit": sorted([a, match, unavailable, filed]),
        "drop_before_commit": [not_filed],
        "slow": {absent: 3.0},
        "lookup_unavailable": [unavailable],
    }


@dataclass
class Options:
    seed: int = 7
    kills: int = 3
    pause: bool = True
    timeout_s: float = 300.0
    echo: bool = True
    report_path: str | None = None
    projections: bool = True


@dataclass
class Decision:
    approval_id: str
    kind: str
    approved: bool
    note: str
    how: str


@dataclass
class Outcome:
    run_id: str
    seed: int
    faults: dict[str, Any]
    attempts: list[Attempt] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    pauses: list[dict[str, Any]] = field(default_factory=list)
    supervisor_pid: int = field(default_factory=os.getpid)
    timed_out: bool = False
    gave_up: str = ""
    projections: bool = False
    elapsed_s: float = 0.0


def _say(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- the person


def _ledger_get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


def _ledger_fence(base: str, run_id: str, epoch: int) -> None:
    req = urllib.request.Request(
        base + "/fence",
        data=json.dumps({"run": run_id, "epoch": epoch}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()


def decide_pending(settings: Any, run_id: str, ledger_url: str) -> list[Decision]:
    """Act as the person: decide every pending approval from the evidence in the ledger."""

    state = fold(read_log(settings, run_id))
    decisions: list[Decision] = []
    if not state.pending_approvals:
        return decisions
    # Before looking, cut off any older worker still in flight (a paused one may wake up):
    # what the person sees can then no longer change behind their back.
    _ledger_fence(ledger_url, run_id, state.max_epoch_seen)
    effects = _ledger_get(ledger_url + "/effects")["effects"]
    for approval in state.pending_approvals.values():
        call = state.open_calls.get(approval.idempotency_key or "")
        if approval.kind == "action":
            approved, note = True, "reviewed the 9 corrections: go ahead"
        elif call is None:
            approved, note = False, "no open call matches this request"
        else:
            args = json.loads(call.args_json)
            target = (
                f"ticket:{args['ref']}" if "ref" in args else f"correction:{args['correction_id']}"
            )
            seen = int(effects.get(target, 0))
            if approval.kind == "conflict":
                approved, note = False, f"conflicting {target} exists; fixed by hand"
            elif seen:
                what = "ticket already filed" if "ref" in args else "correction already applied"
                approved, note = False, f"{what}: the ledger shows {target} x{seen}"
            else:
                approved = True
                note = f"the ledger shows no {target}: retry with the same key"
        how = runlog.decide(
            run_id,
            approval.approval_id,
            approved=approved,
            decided_by="supervisor",
            note=note,
            tenant=TENANT,
            settings=settings,
        )
        verdict = "approved" if approved else "rejected"
        _say(f"  person: {verdict} {approval.approval_id} ({approval.kind}): {note} [{how}]")
        decisions.append(Decision(approval.approval_id, approval.kind, approved, note, how))
    return decisions


# ------------------------------------------------------------------------------ supervise


class Supervisor:
    def __init__(self, opts: Options) -> None:

        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.env = dict(os.environ)
        self.env.setdefault("RUNLOG_LEASE_TTL_MS", DEMO_LEASE_TTL_MS)
        self.env["PYTHONUNBUFFERED"] = "1"
        # The supervisor's own runlog calls (decide) use the same settings as its workers.
        os.environ["RUNLOG_LEASE_TTL_MS"] = self.env["RUNLOG_LEASE_TTL_MS"]
        self.settings = Settings()
        self.ttl_s = self.settings.lease_ttl_ms / 1000
        self.run_id = new_run_id()
        self.outcome = Outcome(self.run_id, opts.seed, fault_plan(self.rng))
        self.deadline = time.monotonic() + opts.timeout_s
        self.ledger: Child | None = None
        self.ledger_url = ""
        self.projector: Child | None = None
        self.kills_left = opts.kills
        self.pause_tries = 3 if opts.pause else 0
        self.action_approved = False

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # Services -------------------------------------------------------------------------
    def start_services(self) -> None:
        cmd = _python_module(
            "runlog.demo",
            "ledger",
            "--namespace",
            self.run_id,
            "--faults",
            json.dumps(self.outcome.faults, sort_keys=True),
        )
        self.ledger = Child("ledger", cmd, self.env, echo=False)
        if not self.ledger.opened.wait(30):
            raise RuntimeError(f"ledger did not start: {self.ledger.lines[-5:]}")
        port = self.ledger.lines[-1].rsplit(":", 1)[1]
        self.ledger_url = f"http://127.0.0.1:{port}"
        _say(f"ledger service: pid {self.ledger.pid} at {self.ledger_url}")
        _say(f"fault plan (seed {self.opts.seed}): {json.dumps(self.outcome.faults)}")
        if self.opts.projections:
            self.projector = Child("project", PROJECTIONS_CMD, self.env, echo=False)
            self.outcome.projections = True
            _say(f"projection services: pid {self.projector.pid} ({' '.join(PROJECTIONS_CMD[1:])})")

    def stop_services(self) -> None:
        for child in (self.projector, self.ledger):
            if child is not None:
                child.stop()

    # Workers --------------------------------------------------------------------------
    def spawn(self, reason: str, *, takeover: bool = False) -> tuple[Child, Attempt]:
        n = len(self.outcome.attempts) + 1
        cmd = _python_module(
            "runlog.demo",
            "worker",
            "--run-id",
            self.run_id,
            "--ledger-url",
            self.ledger_url,
            "--reason",
            reason,
            *(["--takeover"] if takeover else []),
        )
        child = Child(f"w{n}", cmd, self.env, echo=self.opts.echo)
        attempt = Attempt(n=n, pid=child.pid, reason=reason)
        self.outcome.attempts.append(attempt)
        _say(f"worker #{n}: pid {child.pid} ({reason})")
        return child, attempt

    def _tail(self) -> str:

        try:
            return describe_tail(read_log(self.settings, self.run_id))
        except Exception as exc:  # noqa: BLE001 - only decoration for the narrative
            return f"(log unreadable: {exc})"

    def _end(self, child: Child, attempt: Attempt, rc: int) -> None:
        attempt.rc = rc
        attempt.outcome = EXIT_NAMES.get(rc, f"exit {rc}")
        attempt.ran_s = round(time.monotonic() - child.started, 2)
        child.stop()

    def _progress(self, child: Child, steps: int, timeout: float = 15.0) -> float:
        """Wait until ``child`` reported ``steps`` more lines (or exited); seconds waited."""
        started = time.monotonic()
        target = len(child.lines) + steps
        while child.alive() and len(child.lines) < target:
            if time.monotonic() - started > timeout or self.remaining() <= 0:
                break
            time.sleep(0.01)
        return time.monotonic() - started

    def _opened(self, child: Child, attempt: Attempt) -> bool:
        while not child.opened.wait(0.1):
            if not child.alive() or self.remaining() <= 0:
                return False
        attempt.opened_after_s = round(time.monotonic() - child.started, 2)
        return True

    def _pause(self, a: Child, att_a: Attempt) -> tuple[Child, Attempt]:
        """SIGSTOP ``a`` past its lease, start ``b``, SIGCONT ``a``: ``a`` must end Fenced."""
        a.signal(signal.SIGSTOP)
        att_a.paused = True
        stopped = time.monotonic()
        _say(f"  supervisor: SIGSTOP pid {a.pid} (paused; its lease expires in <= {self.ttl_s} s)")
        time.sleep(self.ttl_s * 1.3)
        b, att_b = self.spawn(f"worker pid {a.pid} stopped answering (paused past its lease)")
        b_opened = self._opened(b, att_b)
        a.signal(signal.SIGCONT)
        _say(
            f"  supervisor: SIGCONT pid {a.pid} after {time.monotonic() - stopped:.1f} s; "
            f"pid {b.pid} owns the run now"
        )
        rc = a.wait(min(60.0, max(1.0, self.remaining())))
        if rc is None:
            a.signal(signal.SIGKILL)
            rc = a.wait(10) or -signal.SIGKILL
        self._end(a, att_a, rc)
        fenced = rc == EXIT_FENCED
        self.outcome.pauses.append(
            {
                "paused_pid": a.pid,
                "successor_pid": b.pid,
                "successor_opened": b_opened,
                "paused_exit": rc,
                "fenced": fenced,
            }
        )
        _say(f"  supervisor: paused pid {a.pid} ended {att_a.outcome} (expected: fenced)")
        if fenced:
            self.pause_tries = 0
        else:
            self.pause_tries -= 1
        return b, att_b

    def drive(self) -> bool:
        """Run workers until the run finishes; False on timeout or too many surprises."""
        unexpected = 0
        reason = "first start"
        child, attempt = self.spawn(reason)
        while True:
            if self.remaining() <= 0:
                child.signal(signal.SIGKILL)
                self._end(child, attempt, child.wait(10) or -signal.SIGKILL)
                self.outcome.timed_out = True
                return False
            if self._opened(child, attempt):
                if self.pause_tries > 0 and self.action_approved:
                    time.sleep(self.rng.uniform(0.2, 0.8))
                    if child.alive() and not _leaving(child):
                        child, attempt = self._pause(child, attempt)
                        continue
                elif self.kills_left > 0:
                    # Kill after a seeded amount of *progress* (lines the worker reports),
                    # plus a little jitter to land mid-step: a wall-clock delay let a fast
                    # worker finish the run before the planned kills had happened.
                    steps = self.rng.randint(1, 5)
                    jitter = self.rng.uniform(0.0, 0.15)
                    delay = self._progress(child, steps) + jitter
                    if child.wait(jitter) is None and not _leaving(child):
                        child.signal(signal.SIGKILL)
                        rc = child.wait(10)
                        attempt.killed = True
                        self._end(child, attempt, rc if rc is not None else -signal.SIGKILL)
                        self.kills_left -= 1
                        attempt.log_tail = self._tail()
                        _say(
                            f"  supervisor: SIGKILL pid {child.pid} {delay:.2f} s into its work "
                            f"(exit {attempt.rc}); log ends at {attempt.log_tail}"
                        )
                        # The first successor waits for the dead worker's lease to expire;
                        # later ones take the run at once: the supervisor saw the exit, so
                        # it knows the owner is dead (fencing covers it if it were not).
                        takeover = self.kills_left < self.opts.kills - 1
                        how = "explicit takeover" if takeover else "after its lease expired"
                        child, attempt = self.spawn(
                            f"worker pid {child.pid} was killed (-9); {how}", takeover=takeover
                        )
                        continue
            rc = child.wait(max(0.1, self.remaining()))
            if rc is None:
                continue  # timed out: handled at the top of the loop
            self._end(child, attempt, rc)
            _say(f"  supervisor: pid {child.pid} exited {attempt.outcome} ({rc})")
            if rc == EXIT_FINISHED:
                return True
            if rc == EXIT_ESCALATED:
                decided = decide_pending(self.settings, self.run_id, self.ledger_url)
                self.outcome.decisions.extend(decided)
                if any(d.kind == "action" and d.approved for d in decided):
                    self.action_approved = True
                reason = "a person decided" if decided else "escalated, nothing to decide"
            elif rc == EXIT_UNCERTAIN:
                time.sleep(1.0)
                reason = "retrying an uncertain call's lookup"
            elif rc in (EXIT_FENCED, EXIT_LOCKED):
                reason = f"previous worker ended {attempt.outcome}"
            else:
                unexpected += 1
                if unexpected > MAX_UNEXPECTED:
                    self.outcome.gave_up = f"{unexpected} unexpected worker exits"
                    return False
                tail = "\n".join(child.lines[-15:])
                _say(f"  supervisor: unexpected exit {rc}; last output:\n{tail}")
                time.sleep(1.0)
                reason = f"previous worker failed ({rc})"
            child, attempt = self.spawn(reason)

    def wait_for_projections(self, final_seq: int) -> dict[str, Any] | None:
        """The run's state projection (summary + full view) once it has caught up."""
        if self.projector is None:
            return None
        try:
            queries = importlib.import_module("runlog.consumers.queries")

            client = redis_client(self.settings)
            try:
                until = time.monotonic() + 30
                summary: dict[str, Any] | None = None
                while time.monotonic() < until:
                    summary = queries.get_summary(client, self.settings, self.run_id)
                    if summary and int(summary.get("seq", 0)) >= final_seq:
                        break
                    time.sleep(0.5)
                view = queries.get_state(client, self.settings, self.run_id) or {}
                return {"summary": summary or {}, "state": view.get("state")}
            finally:
                client.close()
        except Exception as exc:  # noqa: BLE001 - a projection problem must not hide the run's
            return {"error": f"{type(exc).__name__}: {exc}"}


def supervise(opts: Options) -> int:

    started = time.monotonic()
    sup = Supervisor(opts)
    _say(
        f"runlog demo: run {sup.run_id}, seed {opts.seed}, {opts.kills} kill(s)"
        f"{' + 1 pause' if opts.pause else ''}, lease TTL {sup.ttl_s:g} s, "
        f"topic {sup.settings.events_topic}"
    )
    try:
        sup.start_services()
        finished = sup.drive()
        sup.outcome.elapsed_s = round(time.monotonic() - started, 1)
        effects = _ledger_get(sup.ledger_url + "/effects")

        events = read_log(sup.settings, sup.run_id)
        projection = sup.wait_for_projections(max((e.seq for e in events), default=0))
        report = build_report(sup.settings, sup.outcome, events, effects, projection, opts)
        report["supervisor_finished"] = finished
    finally:
        sup.stop_services()

        Services.shared(sup.settings).close()
    print_report(report)
    if opts.report_path:
        with open(opts.report_path, "w") as fh:
            json.dump(report, fh, indent=1, sort_keys=True, default=str)
    return 0 if report["ok"] else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=7, help="seeds kill moments and faults")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs of the worker")
    parser.add_argument("--no-pause", action="store_true", help="skip the SIGSTOP/fencing act")
    parser.add_argument("--timeout", type=float, default=300.0, help="overall bound, seconds")
    parser.add_argument("--quiet", action="store_true", help="do not echo the workers' output")
    parser.add_argument("--report", default=None, help="also write the summary as JSON here")
    parser.add_argument(
        "--no-projections", action="store_true", help="do not run `runlog project all`"
    )


def options(args: argparse.Namespace) -> Options:
    return Options(
        seed=args.seed,
        kills=args.kills,
        pause=not args.no_pause,
        timeout_s=args.timeout,
        echo=not args.quiet,
        report_path=args.report,
        projections=not args.no_projections,
    )


def run(args: argparse.Namespace) -> int:
    return supervise(options(args))
