"""A worker process for the pause test: owns one run and appends until it is fenced.

    python tests/faults/paused_worker.py '{"settings": {...}, "run_id": ..., "acks": PATH}'

It pipelines bursts (``emit`` x N, then one ``barrier``) so that a SIGSTOP is likely to
land with events built and guarded but not yet sent. Each acknowledged event is one JSON
line in the acks file, written only after ``barrier`` returned. Exit codes: 0 finished,
3 fenced (the expected end after a takeover), 4 another clear error, 1 anything else.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import AppendOutcomeUnknown, Fenced, KafkaUnavailable, RedisUnavailable
from runlog.producers._opening import open_run_with
from runlog.schemas._vocabulary import EventType

EXIT_FENCED = 3
EXIT_CLEAR = 4


def main(spec: dict[str, Any]) -> int:
    settings = Settings(**spec["settings"])
    services = Services(settings, writer_id=f"paused-{os.getpid()}")
    burst = int(spec.get("burst", 10))
    with open(spec["acks"], "a", encoding="utf-8") as acks:
        try:
            run = open_run_with(services.run_deps(), spec["run_id"], goal="pause test")
            print(f"READY epoch={run.epoch} seq={run.state.seq}", flush=True)
            for i in range(int(spec.get("target", 100_000))):
                events = [
                    run.emit(EventType.USER_MESSAGE, content=f"z{i}-{j}") for j in range(burst)
                ]
                run.barrier()
                for ev in events:
                    line = {"seq": ev.seq, "epoch": ev.epoch, "event_id": ev.event_id}
                    acks.write(json.dumps(line) + "\n")
                acks.flush()
            run.finish("completed")
            return 0
        except Fenced as exc:
            print(f"FENCED {exc}", flush=True)
            return EXIT_FENCED
        except (AppendOutcomeUnknown, KafkaUnavailable, RedisUnavailable) as exc:
            print(f"STOPPED {type(exc).__name__}: {exc}", flush=True)
            return EXIT_CLEAR


if __name__ == "__main__":
    code = main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(code)  # do not wait for a fenced run's producer to flush
