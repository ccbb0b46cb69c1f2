"""A whole worker process paused (SIGSTOP) past its lease, taken over, then resumed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from codec_support import make_event
from faultkit import FaultReport, read_log
from paused_worker import EXIT_FENCED

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.producers._opening import open_run_with
from runlog.projections._run_state import RunState, apply, is_valid
from runlog.schemas import _codec as codec
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

ROUNDS = 3
WORKER = Path(__file__).with_name("paused_worker.py")


def _acks(path: Path) -> list[dict[str, int | str]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln) for ln in lines if ln.endswith("}")]


def _spec(settings: Settings, run_id: str, acks: Path) -> str:
    keys = (
        "bootstrap_servers",
        "redis_url",
        "topic_prefix",
        "redis_key_prefix",
        "partitions",
        "replication_factor",
        "lease_ttl_ms",
    )
    return json.dumps(
        {
            "settings": {k: getattr(settings, k) for k in keys},
            "run_id": run_id,
            "acks": str(acks),
            "burst": 10,
        }
    )


def test_paused_worker_is_fenced_and_its_stale_writes_excluded(
    healthy: Settings, report: FaultReport, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    settings = healthy
    # A lease bound to its process's session lives as long as the session's liveness key
    # (the shorter of the two TTLs); with liveness off, as long as its own TTL.
    live_ms = settings.liveness_ttl_ms
    ttl = (min(live_ms, settings.lease_ttl_ms) if live_ms else settings.lease_ttl_ms) / 1000
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), str(WORKER.parent)])}
    for rnd in range(ROUNDS):
        run_id = new_run_id()
        acks_path = tmp_path / f"acks-{rnd}.jsonl"
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), _spec(settings, run_id, acks_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        services = Services(settings, writer_id=f"taker-{rnd}")
        try:
            deadline = time.monotonic() + 60
            while len(_acks(acks_path)) < 30 + 7 * rnd:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "worker made no progress"
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGSTOP)
            paused = time.monotonic()
            report.faults["SIGSTOP worker past its lease, take over, SIGCONT"] += 1

            deps = services.run_deps()
            run = open_run_with(deps, run_id, wait_s=3 * ttl, reason="worker paused")
            assert time.monotonic() - paused >= 0.8 * ttl * 0.9, "took over a live lease"
            taken = [run.append(EventType.USER_MESSAGE, content=f"n{i}") for i in range(5)]

            os.kill(proc.pid, signal.SIGCONT)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == EXIT_FENCED, out

            # A zombie's in-flight write, made deterministic: old epoch, the next seq.
            first = read_log(settings, run_id)
            old_epoch = first[0].event.epoch
            zombie = make_event(
                EventType.USER_MESSAGE,
                {"content": "stale"},
                run_id=run_id,
                tenant=run.tenant,
                seq=run.state.seq + 1,
                epoch=old_epoch,
                writer_id="zombie",
            )
            deps.writer.send(
                settings.events_topic, run_id.encode(), codec.encode(zombie), codec.headers(zombie)
            ).result(timeout=30)
            report.faults["zombie write with the old epoch"] += 1
            taken += [run.append(EventType.USER_MESSAGE, content=f"p{i}") for i in range(5)]
            taken.append(run.finish("completed"))

            records = read_log(settings, run_id)
            state = RunState()
            valid: dict[str, bool] = {}
            for rec in records:
                valid[rec.event.event_id] = is_valid(state, rec.event)
                apply(state, rec.event)
            worker_acks = _acks(acks_path)
            lost = [a for a in worker_acks if not valid.get(str(a["event_id"]), False)]
            lost += [
                {"seq": e.seq, "event_id": e.event_id}
                for e in taken
                if not valid.get(e.event_id, False)
            ]
            stale = [
                r.event
                for r in records
                if r.event.writer_id.startswith("paused-") and not valid[r.event.event_id]
            ]
            assert not valid[zombie.event_id]
            report.stale_writes += len(stale)
            report.fenced_writes += state.fenced_writes
            report.acked += len(worker_acks) + len(taken)
            report.records += len(records)
            report.lost.extend(f"pause round {rnd}: {x}" for x in lost)
            report.notes.append(
                f"pause round {rnd}: worker epoch {old_epoch} acked {len(worker_acks)}, "
                f"{len(stale)} stale writes after takeover (excluded), zombie excluded, "
                f"fenced_writes={state.fenced_writes}"
            )
            assert not lost, lost
            assert state.fenced_writes == len(stale) + 1
            assert state.status == "finished" and state.epoch > old_epoch

            # A second reader (a new owner's replay) reaches the same verdicts.
            with open_run_with(deps, run_id) as again:
                assert again.state.digest() == state.digest()
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                proc.wait(timeout=10)
            services.close()
    report.durations["pause_takeover"] = time.monotonic() - t0
