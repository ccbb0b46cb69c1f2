"""A synthetic run for measurements: realistic event mix, written through the real writer."""

from __future__ import annotations

import dataclasses

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.producers._opening import open_run_with
from runlog.schemas._vocabulary import EventType


def write_synthetic_run(settings: Settings, events: int) -> tuple[str, str]:
    """A run of about ``events`` realistic events (turns, tool calls, compactions)."""
    services = Services(settings)
    try:
        deps = dataclasses.replace(services.run_deps(), snapshots=None)
        run = open_run_with(deps, tenant="plan", agent="snapshot-plan", goal="measure")
        i = 0
        while run.state.seq < events:
            i += 1
            run.emit(EventType.USER_MESSAGE, content=f"step {i}: please continue " + "x" * 120)
            run.emit(
                EventType.MODEL_TURN,
                text=f"calling lookup for step {i} " + "y" * 200,
                tool_calls=[
                    {"call_id": f"c{i}", "name": "lookup", "args_json": f'{{"i":{i}}}'},
                ],
                usage={"input_tokens": 900 + i, "output_tokens": 120},
                cost_usd=0.002,
            )
            key = f"k{i:08d}"
            started = run.emit(
                EventType.TOOL_CALL_STARTED,
                call_id=f"c{i}",
                name="lookup",
                args_json=f'{{"i":{i}}}',
                idempotency_key=key,
            )
            run.emit(
                EventType.TOOL_CALL_COMPLETED,
                call_id=f"c{i}",
                name="lookup",
                started_seq=started.seq,
                content=f"result {i} " + "z" * 300,
                idempotency_key=key,
                duration_ms=3,
            )
            if i % 50 == 0:
                run.emit(
                    EventType.CONTEXT_COMPACTED,
                    summary=f"summary of the first {i} steps",
                    kept_turns=4,
                    dropped=0,
                )
            if i % 50 == 0:
                run.barrier()
        run.barrier()
        run.close()
        return run.tenant, run.run_id
    finally:
        services.close()
