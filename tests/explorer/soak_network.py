"""The soak's network phases: episodes of a worker process in a network namespace while
the nemesis (tests/faults/netns.py) cuts, drops, delays or skews its links and clock.

Each episode is fixed by its seed: one run, written by worker processes in the namespace
``w1`` one after another (a worker that stops with a clear error or is fenced is replaced,
as a supervisor would), with one fault drawn from the seed injected 0-0.5 s after the
first acknowledged append, for a length the seed also draws. After the run finished (or
the episode's deadline passed: a run stuck), the run is opened from the root namespace
and the log, the state and the receiver's ledger are checked: every acknowledged append in
the valid log, no event twice, no two owners, each effect once and a completed call.

Families (``FAMILIES``):

- ``partition``: the link to Redis or to Kafka cut both ways, or only one way, for 0.3-6 s
  (the lease lives 2 s: long cuts cost the worker its lease);
- ``lossy``: 20-40 % of the packets to Kafka and Redis dropped for 1-4 s, or every byte to
  the brokers held 0.2-0.8 s each way for 1-3 s (a proxy on the path, delayproxy.py) with a
  1 s delivery timeout, so timeouts fire while requests land;
- ``skew``: the worker's wall clock 30 s ahead or behind for the whole episode, and its
  link to Redis cut for 0.3-3 s in the middle.

Reproduce one episode: ``python tests/explorer/soak_network.py --family partition --seed N``
(as root; it brings up the 3-node cluster as the explorer does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent), str(HERE.parent / "faults")]

import explorer as ex_mod  # noqa: E402

from runlog import stack  # noqa: E402
from runlog.schemas._keys import new_run_id  # noqa: E402

FAMILIES = ("partition", "lossy", "skew")
EPISODE_DEADLINE_S = 120.0
"""An episode whose run has not finished by then is a run stuck."""
LANES = 3
"""Episodes at once, each in a namespace of its own (``w1``, ``w2``, ...): an episode mostly
waits (paced steps, a cut link), so three share two cores.
"""


@dataclass
class Verdict:
    """One episode's outcome."""

    seed: int
    fault: str
    generations: int = 0
    acks: int = 0
    effects: int = 0
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    stuck: bool = False
    dropped: int = 0
    delayed: int = 0

    @property
    def hit(self) -> bool:
        """The fault reached traffic: packets dropped or bytes delayed."""
        return self.dropped + self.delayed > 0

    @property
    def clean(self) -> bool:
        return not (self.lost or self.doubled or self.other or self.stuck)


class Network:
    """One namespace of ``nemesis`` for the workers, and a delay proxy on its path to every
    broker (passing bytes at once until an episode slows it)."""

    def __init__(self, cfg: stack.StackConfig, nemesis: Any, node: str = "w1") -> None:
        from delayproxy import DelayProxy

        self.cfg = cfg
        self.nemesis = nemesis
        self.node = node
        ports = [n.kafka_port for n in cfg.nodes()]
        self._stack = contextlib.ExitStack()
        nemesis.add_node(node)
        self.proxies = [self._stack.enter_context(DelayProxy(p, 0.0)) for p in ports]
        for port, proxy in zip(ports, self.proxies, strict=True):
            nemesis.route_through(node, port, proxy.port)

    def delayed(self) -> int:
        return sum(p.delayed for p in self.proxies)

    def delay(self, seconds: float) -> None:
        for proxy in self.proxies:
            proxy.delay_s = seconds

    def heal(self) -> None:
        self.delay(0.0)
        self.nemesis.heal(self.node)

    def close(self) -> None:
        self._stack.close()


def _draw(family: str, rng: random.Random) -> tuple[str, float, float, dict[str, Any]]:
    """(fault, start after s, length s, options) of an episode of ``family``."""
    start = rng.uniform(0.0, 0.5)  # after the worker's first acknowledged append
    if family == "partition":
        service = rng.choice(["redis", "kafka"])
        direction = rng.choice(["both", "both", "in", "out"])
        return (
            f"cut {service} ({direction})",
            start,
            rng.uniform(0.3, 6.0),
            {
                "service": service,
                "direction": direction,
            },
        )
    if family == "lossy":
        if rng.random() < 0.5:
            pct = rng.choice([20, 30, 40])
            return f"drop {pct}% to Kafka and Redis", start, rng.uniform(1.0, 4.0), {"loss": pct}
        delay = rng.uniform(0.2, 0.8)
        return (
            f"delay {delay * 1000:.0f} ms each way to the brokers",
            start,
            rng.uniform(1.0, 3.0),
            {"delay": delay},
        )
    if family == "skew":
        skew = rng.choice([30.0, -30.0])
        return (
            f"clock {skew:+.0f} s, Redis cut",
            start,
            rng.uniform(0.3, 3.0),
            {
                "skew": skew,
                "service": "redis",
                "direction": "both",
            },
        )
    raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")


def episode(net: Network, settings: Any, family: str, seed: int, tmp: Path) -> Verdict:
    """One episode of ``family`` fixed by ``seed`` (see the module's docstring)."""
    from faultkit import verify_effects, verify_run
    from netns_worker import EXIT_CLEAR, EXIT_FENCED
    from test_network_faults import Episode

    from runlog._bootstrap import Services
    from runlog.producers._opening import open_run_with

    rng = random.Random(f"{family}:{seed}")
    fault, start_s, length_s, opts = _draw(family, rng)
    verdict = Verdict(seed, fault)
    home = tmp / f"{family}-{seed}"
    home.mkdir(parents=True)
    ep = Episode(settings, net.nemesis, net.node, seed, home)
    ep.target = rng.randint(16, 32)
    skew = opts.get("skew")
    before, before_delayed = net.nemesis.dropped(net.node), net.delayed()
    extra: dict[str, Any] = {"pace_s": 0.05, "tool_every": 2}
    if "delay" in opts:
        extra["settings_extra"] = {"delivery_timeout_ms": 1000}

    def inject() -> None:
        if "loss" in opts:
            net.nemesis.drop(net.node, "kafka", opts["loss"])
            net.nemesis.drop(net.node, "redis", opts["loss"])
        elif "delay" in opts:
            net.delay(opts["delay"])
        else:
            net.nemesis.cut(net.node, opts["service"], opts["direction"])

    t0 = time.monotonic()
    first_ack: float | None = None
    injected = healed = False
    deadline = t0 + EPISODE_DEADLINE_S
    finished = False
    try:
        while time.monotonic() < deadline and not finished:
            verdict.generations += 1
            name = f"soak-{family}-{seed}-g{verdict.generations}"
            proc = ep.spawn(name, hold=False, skew_s=skew, **extra)
            while proc.poll() is None and time.monotonic() < deadline:
                if first_ack is None and ep.acks.exists():
                    first_ack = time.monotonic()
                now = time.monotonic() - (first_ack or float("inf"))
                if not injected and now >= start_s:
                    inject()
                    injected = True
                elif injected and not healed and now >= start_s + length_s:
                    net.heal()
                    healed = True
                time.sleep(0.02)
            if proc.poll() is None:  # stuck: the whole session (faketime forks the worker)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out = proc.communicate()[0] or ""
            ep.load_acks(name, skew_s=skew or 0.0)
            if proc.returncode == 0:
                finished = True
            elif proc.returncode not in (EXIT_CLEAR, EXIT_FENCED):
                verdict.other.append(f"worker {name} exited {proc.returncode}: {out[-400:]}")
                break
            late = time.monotonic() - (first_ack or 0) >= start_s + length_s
            if injected and not healed and late:
                net.heal()
                healed = True
    finally:
        verdict.dropped = net.nemesis.dropped(net.node) - before
        verdict.delayed = net.delayed() - before_delayed
        net.heal()
    verdict.stuck = not finished and not verdict.other
    services = Services(settings, writer_id=f"soak-final-{family}-{seed}")
    try:
        with open_run_with(services.run_deps(), ep.run_id, tools=[ep.ledger.tool()]) as run:
            state = run.state
    finally:
        services.close()
    check = verify_run(settings, ep.run_id, ep.journal)
    verdict.acks = check.acked
    verdict.effects = sum(ep.ledger.counts().values())
    verdict.lost = list(check.lost)
    problems = list(check.violations) + verify_effects(ep.ledger, [state])
    verdict.doubled = [p for p in problems if "times" in p]
    verdict.other += [p for p in problems if "times" not in p]
    if finished and state.status != "finished":
        verdict.other.append(f"the run is {state.status} after its worker finished it")
    return verdict


@contextlib.contextmanager
def network(cfg: stack.StackConfig, lanes: int = 1) -> Iterator[list[Network]]:
    """``lanes`` :class:`Network` s (namespaces ``w1``, ``w2``, ...) on a nemesis of their
    own, all torn down after."""
    from netns import Nemesis

    ports = [n.kafka_port for n in cfg.nodes()]
    with (
        Nemesis({"kafka": ports, "redis": [cfg.redis_port]}) as nemesis,
        contextlib.ExitStack() as nets,
    ):
        yield [
            nets.enter_context(contextlib.closing(Network(cfg, nemesis, f"w{i + 1}")))
            for i in range(lanes)
        ]


def run_phase(
    cfg: stack.StackConfig,
    family: str,
    n: int,
    seed: int,
    tmp: Path,
    progress: Callable[[str], None] = print,
    lanes: int = LANES,
) -> tuple[list[Verdict], float]:
    """``n`` episodes of ``family``, seeds ``seed``, ``seed + 1``, ..., ``lanes`` at once;
    their verdicts (by seed) and the phase's seconds. An episode's outcome depends on its
    seed and on what the machine does meanwhile (the other lanes' load), as a soak's
    should; ``--lanes 1`` reproduces one alone."""
    from runlog._topics import ensure_topics

    t0 = time.monotonic()
    prefix = f"soak-net-{family}-{new_run_id()[-6:]}"
    settings = ex_mod.cluster_settings(cfg, prefix)
    ensure_topics(settings).raise_for_drift()
    seeds = iter(range(seed, seed + n))
    verdicts: list[Verdict] = []
    lock = threading.Lock()

    def lane(net: Network) -> None:
        while True:
            with lock:
                s = next(seeds, None)
            if s is None:
                return
            v = episode(net, settings, family, s, tmp)
            with lock:
                verdicts.append(v)
                if not v.clean:
                    progress(f"  {family} seed {v.seed} ({v.fault}): {_problems(v)[:3]}")
                if len(verdicts) % 10 == 0:
                    progress(f"  {family} {len(verdicts)}/{n}")

    with network(cfg, lanes) as nets:
        threads = [threading.Thread(target=lane, args=(net,), daemon=True) for net in nets]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    verdicts.sort(key=lambda v: v.seed)
    return verdicts, time.monotonic() - t0


def _problems(v: Verdict) -> list[str]:
    return v.lost + v.doubled + v.other + (["stuck"] if v.stuck else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="soak_network", description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=FAMILIES, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--episodes", type=int, default=1)
    ap.add_argument("--lanes", type=int, default=1, help="episodes at once")
    opts = ap.parse_args(argv)
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="soak-net-"))
    with ex_mod.environment() as (cfg, _ledger):
        verdicts, seconds = run_phase(
            cfg, opts.family, opts.episodes, opts.seed, tmp, lanes=opts.lanes
        )
    for v in verdicts:
        status = "clean" if v.clean else f"FOUND {_problems(v)}"
        print(
            f"{opts.family} seed {v.seed}: {v.fault}; {v.generations} worker(s), "
            f"{v.acks} acknowledged, {v.effects} effects, {v.dropped} packets dropped, "
            f"{v.delayed} chunks delayed: {status}"
        )
    print(f"{len(verdicts)} episode(s) in {seconds:.1f} s")
    return 0 if all(v.clean for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
