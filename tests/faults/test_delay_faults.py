"""Delay: a worker whose links to the brokers go through proxies that hold every byte.

The kernel has no netem, so the delay is a proxy on the path (tests/faults/delayproxy.py):
the worker runs in a namespace of the nemesis, whose connections to each broker are
routed through a proxy of their own (``Nemesis.route_through``; Redis is reached
directly). The proxies pass bytes at once until the worker is inside a tool call (the
effect done, its COMPLETED not appended yet); then every byte waits ``DELAY_S`` each
way, so the COMPLETED's produce request takes longer than the worker's delivery timeout (1 s, the
least runlog accepts): the worker is told the outcome is unknown and stops, while the
request still lands. A new worker resumes through the healed proxies and finishes.

Packet duplication and reordering, the other faults netem would add, are absorbed by TCP
below every client (a segment twice or out of order reaches the application once and in
order), so what a client can see of them is delay and lost connections, which the tests
here and in test_network_faults.py inject.

Reproduce: ``.venv/bin/python -m pytest tests/faults -k delay`` (seed ``SEED``).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from delayproxy import DelayProxy
from faultkit import FaultReport
from netns import Nemesis
from netns_worker import EXIT_CLEAR
from test_network_faults import Episode, _exit

from runlog import stack
from runlog._settings import Settings
from runlog.schemas._vocabulary import EventType

SEED = 4208
DELAY_S = 0.6
"""Each way: a produce round trip of 1.2 s, past the worker's 1 s delivery timeout."""


def test_delay_completed_times_out_but_lands_effect_once(
    healthy: Settings,
    cluster: stack.StackConfig,
    nemesis: Nemesis,
    report: FaultReport,
    tmp_path: Path,
) -> None:
    t0 = time.monotonic()
    ep = Episode(healthy, nemesis, "w1", SEED, tmp_path)
    nemesis.add_node("w1")
    ports = [n.kafka_port for n in cluster.nodes()]
    with contextlib.ExitStack() as stack_:
        proxies = [stack_.enter_context(DelayProxy(port, 0.0)) for port in ports]
        for port, proxy in zip(ports, proxies, strict=True):
            nemesis.route_through("w1", port, proxy.port)
        fast = {"settings_extra": {"delivery_timeout_ms": 1000}}
        first = ep.spawn("delay-g1", **fast)
        ep.wait_held(first)
        for proxy in proxies:
            proxy.delay_s = DELAY_S
        report.faults[f"delay: {DELAY_S * 1000:.0f} ms each way to every broker"] += 1
        ep.release()
        code, out = _exit(first)
        assert code == EXIT_CLEAR and "AppendOutcomeUnknown" in out, (code, out)
        time.sleep(2 * DELAY_S + 0.5)  # what was in flight lands
        for proxy in proxies:
            proxy.delay_s = 0.0
        ep.load_acks("delay-g1")
        second = ep.spawn("delay-g2", hold=False)
        code2, out2 = _exit(second, timeout=60)
        assert code2 == 0, out2
        ep.load_acks("delay-g2")
        chunks = sum(p.chunks for p in proxies)
    state, records = ep.check(report, "delay")
    calls_g1 = ep.hold_at // 4 + 1
    landed = [
        r
        for r in records
        if r.event.writer_id == "delay-g1" and r.event.type is EventType.TOOL_CALL_COMPLETED
    ]
    # The held call's COMPLETED landed though its writer was told the outcome is unknown.
    assert len(landed) == calls_g1, (len(landed), calls_g1)
    assert chunks > 0
    report.notes.append(
        f"delay {DELAY_S * 1000:.0f} ms seed {SEED}: held call {ep.hold_at}, worker 1 "
        f"stopped AppendOutcomeUnknown, its COMPLETED landed; {chunks} chunks proxied, "
        f"{len(state.completed_calls)} effects once"
    )
    report.durations["delay"] = time.monotonic() - t0
