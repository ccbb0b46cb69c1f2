"""The reference reconciliation agent: a worker process the supervisor kills and restarts.

    python -m runlog.demo worker --run-id R --ledger-url http://127.0.0.1:P

The quarterly reconciliation from the specification's opening story, driven by
``runlog.testing``'s ``ScriptedModel`` + ``AgentLoop``: read 14 ledgers, compact the
context, ask a person before posting, post 9 corrections (five through the ledger's
idempotent endpoint, four through its plain endpoint with an authoritative lookup), file 2
exception tickets (irreversible, no lookup), draft the summary, finish. The worker keeps
nothing between processes: each start is the same ``open_run(run_id)``, and the loop derives
where it is from the log.

Exit codes tell the supervisor what happened (a SIGKILL shows as -9).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import runlog
from runlog import current_call
from runlog.bootstrap import Services
from runlog.errors import (
    AppendOutcomeUnknown,
    CallUncertain,
    Escalated,
    Fenced,
    RunLocked,
    RunlogError,
)
from runlog.producers.tools import Absent, Conflict, Match, ToolError, Unavailable, tool
from runlog.settings import Settings
from runlog.testing import (
    AgentLoop,
    ApprovalStep,
    Call,
    CompactStep,
    FinishStep,
    ModelStep,
    ScriptedModel,
)

EXIT_FINISHED = 0
EXIT_ERROR = 1
EXIT_ESCALATED = 3
"""A person must decide an approval request; the supervisor decides and restarts."""
EXIT_UNCERTAIN = 4
"""A call stays uncertain (its lookup was unavailable); try again later."""
EXIT_FENCED = 5
"""This worker lost ownership of the run (another worker took over)."""
EXIT_LOCKED = 6
"""Another live worker holds the run."""
EXIT_APPEND_UNKNOWN = 7
"""The broker did not confirm an append; the next owner learns the truth from the log."""

TENANT = "acme"
PERIOD = "2025-Q3"
TASK = (
    "Reconcile the 2025-Q3 ledgers for acme: read all 14 ledgers, post the corrections, "
    "file exception tickets for what needs a person, and write a summary."
)
CLOCK_MARGIN_MS = 50
"""Must match the ledger's allowance for clock disagreement (``ledger.CLOCK_MARGIN_MS``)."""


@dataclass(frozen=True)
class Correction:
    correction_id: str
    ledger: int
    account: str
    amount_cents: int
    endpoint: str
    """``idempotent`` or ``plain``: which ledger endpoint posts it."""


CORRECTIONS = (
    Correction("C-01", 2, "4010", -12_000, "idempotent"),
    Correction("C-02", 3, "2200", 84_000, "plain"),
    Correction("C-03", 5, "4010", 3_550, "idempotent"),
    Correction("C-04", 6, "6120", -48_000, "plain"),
    Correction("C-05", 8, "1100", 19_999, "idempotent"),
    Correction("C-06", 9, "2200", -7_125, "plain"),
    Correction("C-07", 11, "5000", 250_000, "idempotent"),
    Correction("C-08", 12, "6120", 1_040, "plain"),
    Correction("C-09", 14, "1100", -66_600, "idempotent"),
)
TICKETS = (
    ("EXC-1", "Ledger 4: duplicate supplier invoice", "Invoice 88231 booked twice; needs AP."),
    ("EXC-2", "Ledger 10: unmatched intercompany", "3 transfers have no counterpart in 13."),
)


def money(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    return f"{sign}£{abs(cents) / 100:,.2f}"


def correction_text(body: dict[str, Any]) -> str:
    """The tool's result for an applied correction; the reconciler rebuilds exactly this."""
    return (
        f"{body['correction_id']} applied: ledger {body['ledger']} account {body['account']} "
        f"{money(int(body['amount_cents']))} {body['period']}"
    )


class LedgerUnavailable(Exception):
    """The ledger answered 5xx: the request may or may not have committed (uncertain)."""


@dataclass
class LedgerClient:
    """HTTP client of the ledger service, carrying the run's fencing token on every call."""

    base_url: str
    run_id: str
    tenant: str = TENANT
    timeout_s: float = 2.0
    fencing_token: Callable[[], int] | None = None
    """Overrides the token; by default the epoch of the call being executed or reconciled
    (``runlog.current_call()``)."""
    deadlines: dict[str, int] = field(default_factory=dict)
    """id -> deadline (Unix ms) of this process's last request for it."""

    def _token(self) -> int:
        if self.fencing_token is not None:
            return self.fencing_token()

        ctx = current_call()
        if ctx is None:
            raise RuntimeError("no fencing token: ledger writes happen inside a tool call")
        return ctx.epoch

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """One HTTP exchange; transport errors (timeouts, resets) propagate."""
        data = None if body is None else json.dumps(body, sort_keys=True).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return int(resp.status), json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read() or b"{}")
            except ValueError:
                payload = {}
            return int(exc.code), payload

    def fencing_headers(self) -> dict[str, str]:
        return {"X-Run-Id": self.run_id, "X-Fencing-Token": str(self._token())}

    def mutate(
        self, path: str, body: dict[str, Any], ident: str, extra: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """POST a change. 4xx is a proven failure (ToolError); anything else is uncertain."""

        deadline = int(time.time() * 1000 + self.timeout_s * 1000)
        # Recorded before sending: the reconciler must not trust a 404 before this passes.
        self.deadlines[ident] = deadline
        headers = {**self.fencing_headers(), "X-Deadline-Ms": str(deadline), **(extra or {})}
        status, payload = self.request("POST", path, body, headers)
        if 400 <= status < 500:
            # The ledger answers 4xx only for requests it refused without committing.
            raise ToolError(f"POST {path} refused ({status}): {payload.get('error', '')}")
        if status >= 500:
            raise LedgerUnavailable(f"POST {path} answered {status}: {payload.get('error', '')}")
        return payload

    def wait_past_deadline(self, ident: str) -> None:
        deadline = self.deadlines.get(ident)
        if deadline is None:
            # Not sent by this process: earlier requests came from previous owners, whose
            # (lower) fencing tokens the lookup's token cuts off.
            return
        remaining = (deadline + 2 * CLOCK_MARGIN_MS) / 1000 - time.time()
        if remaining > 0:
            time.sleep(remaining)

    # Tools ---------------------------------------------------------------------------
    def correction_body(self, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "correction_id": args["correction_id"],
            "tenant": self.tenant,
            "ledger": args["ledger"],
            "account": args["account"],
            "amount_cents": args["amount_cents"],
            "period": args["period"],
        }

    def read_ledger(self, args: dict[str, Any], *, idempotency_key: str) -> str:

        status, payload = self.request("GET", f"/ledgers/{int(args['ledger'])}")
        if status == 404:
            raise ToolError(f"no ledger {args['ledger']}")
        if status != 200:
            raise LedgerUnavailable(f"GET /ledgers answered {status}")
        return f"ledger {payload['ledger']}: balance {money(int(payload['balance_cents']))}"

    def post_idempotent(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        body = self.correction_body(args)
        self.mutate(
            "/corrections/idempotent",
            body,
            body["correction_id"],
            {"Idempotency-Key": idempotency_key},
        )
        return correction_text(body)

    def post_plain(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        body = self.correction_body(args)
        self.mutate("/corrections/plain", body, body["correction_id"])
        return correction_text(body)

    def lookup_plain(self, args: dict[str, Any], *, idempotency_key: str) -> Any:
        """Authoritative lookup: Match, Absent, Conflict or Unavailable (never raises)."""

        intended = self.correction_body(args)
        cid = intended["correction_id"]
        found: dict[str, Any] | None = None
        for final in (False, True):
            if final:
                # A 404 proves absence only once this process's last request for the id
                # is past its deadline (see runlog.demo.ledger).
                self.wait_past_deadline(cid)
            try:
                status, payload = self.request(
                    "GET", f"/corrections/{cid}", headers=self.fencing_headers()
                )
            except (OSError, http.client.HTTPException) as exc:
                return Unavailable(f"GET /corrections/{cid} failed: {type(exc).__name__}: {exc}")
            if status == 200:
                found = payload["correction"]
                break
            if status != 404:
                return Unavailable(f"GET /corrections/{cid} answered {status}: {payload}")
            if cid not in self.deadlines:
                break  # nothing of ours can still be in flight: this 404 is final
        if found is None:
            return Absent(
                f"GET /corrections/{cid} -> 404 under fencing token {self._token()}, after "
                "the last attempt's deadline: no earlier request can still commit"
            )
        if all(found.get(k) == v for k, v in intended.items()):
            return Match(correction_text(found))
        return Conflict(json.dumps(found, sort_keys=True))

    def file_ticket(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        body = {
            "ref": args["ref"],
            "tenant": self.tenant,
            "subject": args["subject"],
            "body": args["body"],
        }
        self.mutate("/tickets", body, body["ref"])
        return f"ticket {args['ref']} filed"


def build_tools(client: LedgerClient) -> list[Any]:

    read_ledger = tool("read_ledger", risk="safe")(client.read_ledger)
    # Idempotent endpoint: the key travels as Idempotency-Key, so retrying is harmless.
    post_correction = tool("post_correction", risk="reversible")(client.post_idempotent)
    # Plain endpoint: a retry would apply twice, so only the lookup's evidence may retry it.
    post_correction_plain = tool(
        "post_correction_plain", risk="irreversible", reconcile=client.lookup_plain
    )(client.post_plain)
    # No deduplication, no lookup: an uncertain ticket goes to a person.
    file_ticket = tool("file_ticket", risk="irreversible")(client.file_ticket)
    return [read_ledger, post_correction, post_correction_plain, file_ticket]


def script(think_s: float = 0.25) -> list[Any]:
    """The scripted model's steps (the loop's position in it comes from the log)."""

    def reads(lo: int, hi: int) -> tuple[Call, ...]:
        return tuple(Call("read_ledger", {"ledger": n}) for n in range(lo, hi + 1))

    corrections = tuple(
        Call(
            "post_correction" if c.endpoint == "idempotent" else "post_correction_plain",
            {
                "correction_id": c.correction_id,
                "ledger": c.ledger,
                "account": c.account,
                "amount_cents": c.amount_cents,
                "period": PERIOD,
            },
        )
        for c in CORRECTIONS
    )
    tickets = tuple(
        Call("file_ticket", {"ref": ref, "subject": subject, "body": body})
        for ref, subject, body in TICKETS
    )
    total = sum(c.amount_cents for c in CORRECTIONS)
    summary = (
        f"{PERIOD} reconciliation for {TENANT}: 14 ledgers read; 9 corrections posted "
        f"(net {money(total)}); 2 exception tickets filed (EXC-1, EXC-2)."
    )
    return [
        ModelStep("Reading ledgers 1-7 for 2025-Q3.", reads(1, 7), 1_800, 220, 0.0061, think_s),
        ModelStep("Reading ledgers 8-14.", reads(8, 14), 2_600, 240, 0.0083, think_s),
        CompactStep(
            "Read all 14 ledgers for 2025-Q3. Nine discrepancies to correct (C-01..C-09); "
            "two need a person (EXC-1 duplicate invoice on ledger 4, EXC-2 unmatched "
            "intercompany on ledger 10).",
            kept_turns=1,
        ),
        ApprovalStep(f"post 9 corrections (net {money(total)}) to 9 ledgers for {PERIOD}"),
        ModelStep("Posting the 9 approved corrections.", corrections, 1_200, 610, 0.0052, think_s),
        ModelStep("Filing 2 exception tickets.", tickets, 1_400, 300, 0.0047, think_s),
        ModelStep(f"Draft summary: {summary}", (), 1_900, 420, 0.0071, think_s * 4),
        FinishStep("succeeded", summary),
    ]


def say(msg: str) -> None:
    print(msg, flush=True)


# The errors that stop this worker as the supervisor expects: what it says, its exit code.
Stops = tuple[tuple[type[RunlogError], str, int], ...]
STOPS_OPENING: Stops = (
    (RunLocked, "run is locked", EXIT_LOCKED),
    (Fenced, "fenced while opening", EXIT_FENCED),
)
STOPS_RUNNING: Stops = (
    (Escalated, "escalated", EXIT_ESCALATED),
    (CallUncertain, "uncertain", EXIT_UNCERTAIN),
    (Fenced, "fenced", EXIT_FENCED),
    (AppendOutcomeUnknown, "append outcome unknown", EXIT_APPEND_UNKNOWN),
)


def stopped(exc: RunlogError, stops: Stops) -> int:
    """Say why the worker stops and return its exit code; an error not in ``stops`` is
    not one the supervisor handles, so it propagates."""
    for kind, what, code in stops:
        if isinstance(exc, kind):
            say(f"{what}: {exc}")
            return code
    raise exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--ledger-url", required=True)
    parser.add_argument("--reason", default="", help="why this worker resumes the run")
    parser.add_argument(
        "--takeover",
        action="store_true",
        help="take the run at once: the supervisor saw the previous worker die",
    )
    parser.add_argument("--http-timeout", type=float, default=2.0)
    parser.add_argument("--approval-wait", type=float, default=0.5)
    parser.add_argument("--think", type=float, default=0.25, help="model latency per step")


def run(args: argparse.Namespace) -> int:

    settings = Settings()
    client = LedgerClient(args.ledger_url, args.run_id, timeout_s=args.http_timeout)
    try:
        try:
            # Tools and reconcilers send runlog.current_call().epoch as the fencing token,
            # so open_run's own recovery already carries this owner's token.
            opened = runlog.open_run(
                args.run_id,
                tenant=TENANT,
                tools=build_tools(client),
                settings=settings,
                agent="reference-reconciliation-agent",
                goal=TASK,
                reason=args.reason,
                takeover=args.takeover,
            )
        except RunlogError as exc:
            return stopped(exc, STOPS_OPENING)
        st = opened.state
        say(
            f"opened run {opened.run_id} as epoch {opened.epoch} at seq {st.seq} "
            f"({st.status}, {len(st.open_calls)} open calls)"
        )
        loop = AgentLoop(
            ScriptedModel(script(args.think)),
            approval_wait_s=args.approval_wait,
            on_event=say,
        )
        try:
            with opened:
                final = loop.run(opened, user_message=TASK)
        except RunlogError as exc:
            return stopped(exc, STOPS_RUNNING)
        say(f"run {final.status}: {final.outcome}")
        return EXIT_FINISHED if final.status == "finished" else EXIT_ERROR
    finally:
        Services.shared(settings).close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runlog.demo worker", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
