"""A worker process for the network fault tests: owns one run inside a network namespace.

    python tests/faults/netns_worker.py '{"settings": {...}, "run_id": ..., "acks": PATH,
        "effects": PATH, "target": 20, "tool_every": 4, "pace_s": 0.05, "hold_at": 8,
        "hold_dir": DIR}'

It appends ``target`` user messages, a tool call every ``tool_every`` (its effect goes to a
:class:`FileLedger`, a receiver outside every worker, Kafka and Redis), then finishes. At
message ``hold_at`` the effect happens, then the tool waits in the receiver until
``hold_dir/release`` exists, after writing ``hold_dir/held``: the test injects its
network fault there, so the call's COMPLETED is appended across the fault. Each
acknowledged append is one JSON line in the acks file, written after it returned.
Optional: ``wait_s`` (how long opening waits for another owner's lease), ``sleep_at`` and
``sleep_s`` (a durable timer at that message: ``run.sleep``; an agent re-executed past it
reaches it again first, as re-executed code does), ``approval_at`` and ``deadline_s`` (a
person asked at that message, with a deadline; once per run). Exit codes: 0 finished,
3 fenced, 4 another clear error, 1 anything else.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent.parent)]

from runlog._bootstrap import Services  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.errors import (  # noqa: E402
    AppendOutcomeUnknown,
    Fenced,
    KafkaUnavailable,
    RedisUnavailable,
    RunLocked,
)
from runlog.producers._opening import open_run_with  # noqa: E402
from runlog.producers._tools import Absent, Evidence, Match, Tool, ToolError  # noqa: E402
from runlog.schemas._vocabulary import EventType  # noqa: E402

EXIT_FENCED = 3
EXIT_CLEAR = 4


class FileLedger:
    """A fenced receiver in two files, shared by processes in any namespace.

    ``effects``: one line per effect (its idempotency key); ``effects.floors``: the
    highest fencing token seen per key. Both are read and written under an exclusive
    ``flock`` of the effects file. A request below its key's floor is refused; a lookup
    raises the floor to the asker's token first, so its "absent" is final. No
    deduplication: a repeated call shows as a second line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.floors = path.with_name(path.name + ".floors")
        path.touch()
        self.floors.touch()

    def _locked(self, key: str, token: int, *, effect: bool) -> bool:
        with open(self.path, "a+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                floors: dict[str, int] = json.loads(self.floors.read_text() or "{}")
                if effect and token < floors.get(key, 0):
                    return False
                floors[key] = max(floors.get(key, 0), token)
                self.floors.write_text(json.dumps(floors))
                if effect:
                    fh.write(key + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                return True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def apply(self, key: str, token: int) -> bool:
        return self._locked(key, token, effect=True)

    def raise_floor(self, key: str, token: int) -> None:
        self._locked(key, token, effect=False)

    def counts(self) -> Counter[str]:
        return Counter(ln for ln in self.path.read_text().splitlines() if ln)

    def tool(self, hold_at: int | None = None, hold_dir: Path | None = None) -> Tool:
        def effect(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
            if not self.apply(idempotency_key, fencing_token):
                raise ToolError(f"refused {idempotency_key}: a newer owner holds the run")
            if hold_dir is not None and args["i"] == hold_at:
                (hold_dir / "held").write_text(idempotency_key)
                deadline = time.monotonic() + 60
                while not (hold_dir / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            return f"done {args['i']}"

        def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Evidence:
            self.raise_floor(idempotency_key, fencing_token)
            if idempotency_key in self.counts():
                return Match(f"done {args['i']}")
            return Absent("no effect with this key in the receiver's ledger")

        return Tool(
            name="effect", fn=effect, risk="irreversible", reconcile=lookup, receiver="fenced"
        )


def main(spec: dict[str, Any]) -> int:
    settings = Settings(**spec["settings"])
    services = Services(settings, writer_id=spec.get("writer_id") or f"netns-{os.getpid()}")
    hold_dir = Path(spec["hold_dir"]) if spec.get("hold_dir") else None
    tool = FileLedger(Path(spec["effects"])).tool(spec.get("hold_at"), hold_dir)
    every, pace = int(spec.get("tool_every", 4)), float(spec.get("pace_s", 0.05))
    with open(spec["acks"], "a", encoding="utf-8") as acks:

        def ack(seq: int, epoch: int, event_id: str | None) -> None:
            line = {"seq": seq, "epoch": epoch, "event_id": event_id, "wall": time.time()}
            acks.write(json.dumps(line) + "\n")
            acks.flush()

        try:
            run = open_run_with(
                services.run_deps(),
                spec["run_id"],
                tools=[tool],
                goal="netns",
                wait_s=spec.get("wait_s"),
            )
            print(f"READY epoch={run.epoch} seq={run.state.seq}", flush=True)
            done = sum(1 for m in run.state.messages if m.role == "user")
            sleep_at, approval_at = spec.get("sleep_at"), spec.get("approval_at")
            if sleep_at is not None and done > sleep_at:
                run.sleep(float(spec["sleep_s"]))
            while done < int(spec.get("target", 20)):
                ev = run.append(EventType.USER_MESSAGE, content=f"m{done}")
                ack(ev.seq, ev.epoch, ev.event_id)
                if done == sleep_at:
                    run.sleep(float(spec["sleep_s"]))
                if done == approval_at and not run.state.approvals:
                    run.request_approval("skew", deadline_s=float(spec["deadline_s"]))
                if done % every == 0:
                    run.call_tool("effect", {"run": run.run_id, "i": done})
                    ack(run.state.seq, run.epoch, None)
                done += 1
                time.sleep(pace)
            ev = run.finish("completed", f"{done} messages")
            ack(ev.seq, ev.epoch, ev.event_id)
            return 0
        except Fenced as exc:
            print(f"FENCED {exc}", flush=True)
            return EXIT_FENCED
        except (AppendOutcomeUnknown, KafkaUnavailable, RedisUnavailable, RunLocked) as exc:
            print(f"STOPPED {type(exc).__name__}: {exc}", flush=True)
            return EXIT_CLEAR


if __name__ == "__main__":
    code = main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(code)  # do not wait for a cut-off producer to flush
