"""The network nemesis: processes in network namespaces, links cut and degraded by nftables.

Every fault test so far talked over one loopback, so a process was reachable or dead. Here
a worker runs in a network namespace of its own, joined by a veth pair to a private bridge
(``rlnem0``, 10.231.0.1/24; the namespace is 10.231.0.N), and reaches the fault cluster's
brokers and Redis over that link: the nemesis can then cut one service off (both ways or
one way), drop a share of its packets, or flap the link, while the rest stays reachable.

How traffic crosses (no change to the cluster, which listens on 127.0.0.1 only):

* in a node's namespace, ``nat output`` rewrites 127.0.0.1:PORT (each port of a service:
  brokers' advertised listeners, Redis) to the bridge's 10.231.0.1:PORT, so the worker
  uses the same addresses as every other client, and ``postrouting`` masquerades it;
* on the bridge, ``nat prerouting`` rewrites 10.231.0.1:PORT back to 127.0.0.1:PORT and
  ``nat input`` makes the source 127.0.0.1 (Redis' protected mode accepts loopback only);
  ``route_localnet`` is set on the bridge and in the namespace, nothing else.

Only the service ports named at construction are translated, only to 127.0.0.1 and the
bridge's own address: no address outside this machine's own namespaces is ever a target,
and ``ip_forward`` is not touched. Faults are rules of one table in the node's own
namespace (``inet rlnem_faults``), rewritten atomically on every change; matching
``oifname eth0 tcp dport PORT`` in ``postrouting`` (the node's requests) and ``iifname
eth0 tcp sport PORT`` in ``prerouting`` (the service's replies). Not in ``output``: a
packet to 127.0.0.1 is routed to ``lo`` there, and rerouted to eth0 only after the
output hooks (after the DNAT), so an ``oifname eth0`` rule in ``output`` never matches.
``drop``, not ``reject``: a partition is silence, so clients find out by their timeouts,
as they would across a real network.

Everything created is named with the prefix (``rlnem``): :meth:`Nemesis.teardown` kills
the processes in the namespaces and removes namespaces, links and tables, and
:meth:`Nemesis.setup` first removes any left by a run that was killed before its teardown.

Clock skew is the process's real clock: :meth:`Nemesis.popen` with ``skew_s`` runs the
command under libfaketime (``faketime -f +30s``), which shifts the wall clock
(``time.time``, ``datetime.now``) by that much (and the monotonic clock by the same
constant, which changes no interval: ``FAKETIME_DONT_FAKE_MONOTONIC=1`` breaks Python's
``time.sleep``, whose ``clock_nanosleep`` deadline libfaketime then rejects). Alone,
libfaketime 0.9.10 (Debian 12, glibc 2.36) leaves librdkafka unusable: librdkafka waits
with C11's ``cnd_timedwait``, an absolute ``CLOCK_REALTIME`` deadline it computes from the
faked clock, and glibc's ``cnd_timedwait`` calls its internal ``pthread_cond_timedwait``,
which libfaketime cannot wrap, so no deadline is translated back to the real clock (strace:
a 500 ms wait becomes a ``futex(FUTEX_WAIT_BITSET|FUTEX_CLOCK_REALTIME)`` until real time +
30.5 s; the 44 ms reconnect backoff after the bootstrap broker is replaced lasts 30 s, so
the first metadata request fails). :func:`faketime_shim` builds ``faketime_c11.c`` (a
``cnd_timedwait`` that calls the exported ``pthread_cond_timedwait``, which libfaketime
translates) with the machine's C compiler, and ``popen`` preloads it ahead of libfaketime.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``ip`` (iproute2), ``nft`` (nftables) and,
for skew, ``faketime`` (Debian's faketime + libfaketime) and ``cc``: ``.ci/run`` installs them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "rlnem"
BRIDGE = f"{PREFIX}0"
SUBNET = "10.231.0"
"""A /24 of the private 10/8 range; setup refuses it if any route of the machine overlaps."""
GATEWAY = f"{SUBNET}.1"
FAULT_TABLE = "rlnem_faults"
NAT_TABLE = "rlnem_nat"
PROXY_TABLE = "rlnem_proxy"
DIRECTIONS = ("both", "out", "in")
"""``out``: the node's packets to the service are dropped; ``in``: the service's replies."""


class NemesisUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no ip/nft, no veth)."""


def _run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def check_available(*, skew: bool = False) -> None:
    """Raise :class:`NemesisUnavailable` saying what is missing."""
    wanted = ("ip", "nft") + (("faketime", "cc") if skew else ())
    missing = [t for t in wanted if not shutil.which(t)]
    if missing:
        raise NemesisUnavailable(
            f"missing {', '.join(missing)}: apt-get install iproute2 nftables faketime "
            "libfaketime gcc libc6-dev"
        )
    if os.geteuid() != 0:
        raise NemesisUnavailable("network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")


@dataclass(frozen=True)
class Fault:
    service: str
    direction: str
    percent: int
    """100: a cut; below: that share of packets dropped at random (nft ``numgen random``)."""


@dataclass
class Node:
    """One namespace: its name, its address on the bridge and its active faults."""

    name: str
    netns: str
    address: str
    faults: dict[tuple[str, str], Fault] = field(default_factory=dict)
    dropped: int = 0
    """Packets the node's fault rules dropped so far (nft counters, summed across rewrites)."""


class Nemesis:
    """Namespaces on a private bridge, reaching the root namespace's ``services`` ports.

    ``services`` maps a name to the TCP ports (on 127.0.0.1) it listens on, e.g.
    ``{"kafka": [29092, 29094, 29096], "redis": [26379]}``. Use as a context manager, or
    call :meth:`setup` and (always, in a ``finally``) :meth:`teardown`.
    """

    def __init__(self, services: Mapping[str, Sequence[int]]) -> None:
        if not services:
            raise ValueError("no services to reach")
        self.services = {k: sorted(int(p) for p in v) for k, v in services.items()}
        self.nodes: dict[str, Node] = {}
        self.procs: list[subprocess.Popen[Any]] = []
        self.log: list[tuple[float, str]] = []
        """(monotonic time, what) of every fault and heal: the episode's history."""
        self._lock = threading.Lock()
        self._flappers: list[tuple[threading.Thread, threading.Event]] = []
        self._routes: list[tuple[str, int, int]] = []

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Nemesis:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    @property
    def _ports(self) -> list[int]:
        return sorted({p for ports in self.services.values() for p in ports})

    def setup(self) -> None:
        check_available()
        cleanup_stale()
        routes = _run(["ip", "-4", "route", "show"])
        if any(line.startswith(f"{SUBNET}.") for line in routes.splitlines()):
            raise NemesisUnavailable(f"{SUBNET}.0/24 is already routed on this machine")
        try:
            _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        except RuntimeError as exc:
            raise NemesisUnavailable(f"cannot make a bridge: {exc}") from exc
        try:
            _run(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE])
            _run(["ip", "link", "set", BRIDGE, "up"])
            _sysctl(f"net.ipv4.conf.{BRIDGE}.route_localnet", 1)
            ports = ", ".join(map(str, self._ports))
            _run(
                ["nft", "-f", "-"],
                stdin=(
                    f"table ip {NAT_TABLE} {{\n"
                    "  chain pre { type nat hook prerouting priority -100;\n"
                    f'    iifname "{BRIDGE}" ip daddr {GATEWAY} tcp dport {{ {ports} }}'
                    " dnat to 127.0.0.1; }\n"
                    "  chain inp { type nat hook input priority 100;\n"
                    f'    iifname "{BRIDGE}" ip daddr 127.0.0.1 snat to 127.0.0.1; }}\n'
                    "}\n"
                ),
            )
        except Exception:
            cleanup_stale()
            raise

    def teardown(self) -> None:
        """Stop flappers and every process started here; remove everything created."""
        for thread, stop in self._flappers:
            stop.set()
            thread.join(timeout=5)
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        cleanup_stale()
        self.nodes.clear()

    # ------------------------------------------------------------------ nodes and processes

    def add_node(self, name: str) -> Node:
        """A namespace ``rlnem-NAME`` at the next address, reaching every service."""
        if name in self.nodes:
            raise ValueError(f"node {name} exists")
        index = len(self.nodes) + 11
        netns, host_end = f"{PREFIX}-{name}", f"{PREFIX}h{index}"
        address = f"{SUBNET}.{index}"
        _run(["ip", "netns", "add", netns])
        node = Node(name, netns, address)
        self.nodes[name] = node
        _run(
            ["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", netns]
        )
        _run(["ip", "link", "set", host_end, "master", BRIDGE, "up"])
        ns = ["ip", "-n", netns]
        _run([*ns, "addr", "add", f"{address}/24", "dev", "eth0"])
        _run([*ns, "link", "set", "lo", "up"])
        _run([*ns, "link", "set", "eth0", "up"])
        _run([*ns, "route", "add", "default", "via", GATEWAY])
        for conf in ("all", "eth0"):
            _sysctl(f"net.ipv4.conf.{conf}.route_localnet", 1, netns=netns)
        ports = ", ".join(map(str, self._ports))
        _run(
            ["ip", "netns", "exec", netns, "nft", "-f", "-"],
            stdin=(
                f"table ip {NAT_TABLE} {{\n"
                "  chain out { type nat hook output priority -100;\n"
                f"    ip daddr 127.0.0.1 tcp dport {{ {ports} }} dnat to {GATEWAY}; }}\n"
                "  chain post { type nat hook postrouting priority 100;\n"
                '    oifname "eth0" masquerade; }\n'
                "}\n"
            ),
        )
        self._apply(node)
        return node

    def popen(
        self,
        node: str,
        argv: Sequence[str],
        *,
        skew_s: float | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``node``'s namespace (under libfaketime if ``skew_s``)."""
        prefix = ["ip", "netns", "exec", self.nodes[node].netns]
        if skew_s:
            check_available(skew=True)
            env = dict(kwargs.get("env") or os.environ)
            # faketime appends libfaketime to LD_PRELOAD: the shim comes first.
            env["LD_PRELOAD"] = " ".join(filter(None, [faketime_shim(), env.get("LD_PRELOAD")]))
            kwargs["env"] = env
            prefix += ["faketime", "-f", f"{skew_s:+.0f}s"]
            self.log.append((time.monotonic(), f"skew {node} {skew_s:+.0f}s: {argv[-1][:60]}"))
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen([*prefix, *argv], **kwargs)
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------------ faults

    def cut(self, node: str, service: str, direction: str = "both") -> None:
        """Drop every packet between ``node`` and ``service`` (one way, or both)."""
        self.drop(node, service, 100, direction)

    def drop(self, node: str, service: str, percent: int, direction: str = "both") -> None:
        """Drop ``percent`` % of the packets between ``node`` and ``service``."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r} not in {DIRECTIONS}")
        if service not in self.services:
            raise ValueError(f"unknown service {service!r}")
        if not 0 < percent <= 100:
            raise ValueError(f"percent {percent} not in 1..100")
        n = self.nodes[node]
        with self._lock:
            n.faults[(service, direction)] = Fault(service, direction, percent)
            self._apply(n)
            what = "cut" if percent == 100 else f"drop {percent}%"
            self.log.append((time.monotonic(), f"{what} {node}<->{service} ({direction})"))

    def heal(self, node: str, service: str | None = None) -> None:
        """Remove ``node``'s faults on ``service`` (every service if None)."""
        n = self.nodes[node]
        with self._lock:
            for key in [k for k in n.faults if service is None or k[0] == service]:
                del n.faults[key]
            self._apply(n)
            self.log.append((time.monotonic(), f"heal {node}<->{service or 'all'}"))

    def flap(
        self, node: str, service: str, *, down_s: float, up_s: float, direction: str = "both"
    ) -> threading.Event:
        """Cut and heal the link in turn until the returned event is set (then healed)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                self.cut(node, service, direction)
                stop.wait(down_s)
                self.heal(node, service)
                stop.wait(up_s)

        thread = threading.Thread(target=loop, daemon=True, name=f"flap-{node}-{service}")
        self._flappers.append((thread, stop))
        thread.start()
        return stop

    def route_through(self, node: str, port: int, proxy_port: int) -> None:
        """``node``'s new connections to ``port`` go to ``proxy_port`` on 127.0.0.1 instead
        (a proxy on the path, e.g. tests/faults/delayproxy.py, which connects on to
        ``port``): a rule of the root namespace's ``ip rlnem_proxy`` table, ahead of the
        bridge's own translation. Connections already made keep their way."""
        if port not in self._ports:
            raise ValueError(f"port {port} is not a service port")
        with self._lock:
            self._routes.append((self.nodes[node].address, port, proxy_port))
            rules = "".join(
                f'    iifname "{BRIDGE}" ip saddr {addr} ip daddr {GATEWAY} tcp dport {p}'
                f" dnat to 127.0.0.1:{pp}\n"
                for addr, p, pp in self._routes
            )
            _run(
                ["nft", "-f", "-"],
                stdin=(
                    f"table ip {PROXY_TABLE}\ndelete table ip {PROXY_TABLE}\n"
                    f"table ip {PROXY_TABLE} {{\n"
                    "  chain pre { type nat hook prerouting priority -150;\n"
                    f"{rules}  }}\n}}\n"
                ),
            )
            self.log.append((time.monotonic(), f"route {node}->{port} via proxy {proxy_port}"))

    def rules(self, node: str) -> str:
        """The node's fault table as nft lists it (for a failure message)."""
        netns = self.nodes[node].netns
        return _run(["ip", "netns", "exec", netns, "nft", "list", "table", "inet", FAULT_TABLE])

    def dropped(self, node: str) -> int:
        """Packets ``node``'s faults have dropped so far: evidence a fault took effect."""
        n = self.nodes[node]
        with self._lock:
            return n.dropped + self._counted(n)

    def _counted(self, node: Node) -> int:
        listing = _run(
            ["ip", "netns", "exec", node.netns, "nft", "list", "table", "inet", FAULT_TABLE],
            check=False,
        )
        return sum(int(m) for m in re.findall(r"counter packets (\d+)", listing))

    def _apply(self, node: Node) -> None:
        node.dropped += self._counted(node)
        out: list[str] = []
        inp: list[str] = []
        for f in node.faults.values():
            ports = ", ".join(map(str, self.services[f.service]))
            rand = f"numgen random mod 100 < {f.percent} " if f.percent < 100 else ""
            if f.direction in ("both", "out"):
                out.append(f'    oifname "eth0" tcp dport {{ {ports} }} {rand}counter drop')
            if f.direction in ("both", "in"):
                inp.append(f'    iifname "eth0" tcp sport {{ {ports} }} {rand}counter drop')
        body = (
            f"table inet {FAULT_TABLE}\n"
            f"delete table inet {FAULT_TABLE}\n"
            f"table inet {FAULT_TABLE} {{\n"
            "  chain out {\n    type filter hook postrouting priority 0;\n"
            + "".join(r + "\n" for r in out)
            + "  }\n  chain inp {\n    type filter hook prerouting priority 0;\n"
            + "".join(r + "\n" for r in inp)
            + "  }\n}\n"
        )
        _run(["ip", "netns", "exec", node.netns, "nft", "-f", "-"], stdin=body)


QUORUM_TABLE = "rlnem_quorum"
QUORUM_CGROUP = f"{PREFIX}-quorum"


class QuorumCut:
    """One node of the local KRaft cluster cut from the controller quorum, on loopback.

    Every node listens on 127.0.0.1, so a node's own connections are told apart by its
    process: it is moved into a cgroup v2 of its own (``rlnem-quorum``), and an nftables
    table in the root namespace (``inet rlnem_quorum``, ``output`` hook) drops what that
    cgroup sends to the other nodes' controller ports (``socket cgroupv2``) and whatever
    anybody sends to the node's own controller port. Its broker port stays reachable, by
    clients and by the other brokers: a broker that still serves but cannot heartbeat,
    vote or fetch the metadata log. A socket keeps the cgroup it was made in, so the cut
    then aborts every connection to a controller port (``ss -K``): everyone reconnects,
    the node's new connections in its new cgroup. :meth:`heal` removes the table and
    moves the process back; :func:`cleanup_stale` removes what a killed run left.

    nft resolves a ``socket cgroupv2`` path under /sys/fs/cgroup; where cgroup v2 is
    mounted elsewhere (a hybrid hierarchy), nft runs in a private mount namespace with it
    mounted there (the kernel's rule holds the cgroup's id, not the path).
    """

    def __init__(self, pid: int, own_port: int, other_ports: Sequence[int]) -> None:
        self.pid = pid
        self.own_port = own_port
        self.other_ports = sorted(other_ports)
        self.root = _cgroup2_root()
        self.origin = ""
        self.dropped = 0

    def cut(self) -> None:
        cleanup_quorum()
        for line in Path(f"/proc/{self.pid}/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                self.origin = line[3:]
        group = self.root / QUORUM_CGROUP
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(f"{self.pid}\n")
        others = ", ".join(map(str, self.other_ports))
        _nft_with_cgroup2(
            self.root,
            f"table inet {QUORUM_TABLE} {{\n"
            "  chain out { type filter hook output priority 0;\n"
            f'    socket cgroupv2 level 1 "{QUORUM_CGROUP}" tcp dport {{ {others} }}'
            " counter drop\n"
            f"    tcp dport {self.own_port} counter drop\n"
            "  }\n}\n",
        )
        # A socket keeps the cgroup it was made in: abort every connection to a controller
        # (``ss -K``), so the node's reconnections are its cgroup's and others' reconnect.
        ports = [self.own_port, *self.other_ports]
        match = " or ".join(f"dport = :{p}" for p in ports)
        _run(["ss", "-K", "-tn", f"( {match} )"])

    def counted(self) -> int:
        listing = _run(["nft", "list", "table", "inet", QUORUM_TABLE], check=False)
        return sum(int(m) for m in re.findall(r"counter packets (\d+)", listing))

    def heal(self) -> None:
        self.dropped += self.counted()
        _run(["nft", "delete", "table", "inet", QUORUM_TABLE], check=False)
        with contextlib.suppress(OSError):
            target = self.root / self.origin.lstrip("/")
            (target / "cgroup.procs").write_text(f"{self.pid}\n")
        cleanup_quorum()


CUT_PREFIX = f"{PREFIX}-cut-"
"""Cgroups (``rlnem-cut-NAME``) and tables (``rlnem_cut_NAME``) of :class:`ProcessCut` and
:class:`ProcessDelay`."""


class _Confined:
    """Processes of this namespace moved into a cgroup v2 of their own (``rlnem-cut-NAME``),
    so nftables rules in the root namespace tell their loopback connections apart from
    everybody else's (``socket cgroupv2``), as :class:`QuorumCut` tells a broker's."""

    def __init__(self, name: str, pids: Sequence[int], ports: Sequence[int]) -> None:
        if not pids or not ports:
            raise ValueError("a fault on processes needs processes and ports")
        if not re.fullmatch(r"[a-z0-9]+", name):
            raise ValueError(f"fault name {name!r}: lowercase letters and digits only")
        self.name = name
        self.pids = list(pids)
        self.ports = sorted(int(p) for p in ports)
        self.root = _cgroup2_root()
        self.group = f"{CUT_PREFIX}{name}"
        self.table = f"{PREFIX}_cut_{name}"
        self.origins: dict[int, str] = {}
        self.held: list[int] = []
        """Local ports of the processes' connections to ``ports`` when the fault began."""

    def _confine(self) -> None:
        group = self.root / self.group
        group.mkdir(exist_ok=True)
        for pid in self.pids:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                    if line.startswith("0::"):
                        self.origins[pid] = line[3:]
                (group / "cgroup.procs").write_text(f"{pid}\n")
        self.held = _local_ports(self.pids, self.ports)

    def _release(self) -> None:
        for pid, origin in self.origins.items():
            with contextlib.suppress(OSError):
                (self.root / origin.lstrip("/") / "cgroup.procs").write_text(f"{pid}\n")
        _remove_cgroup(self.root, self.root / self.group)

    def _table(self, family: str, chain: str, rules: Sequence[str]) -> None:
        """Write the fault's one table (replacing what it held) with one chain of ``rules``."""
        _nft_with_cgroup2(
            self.root,
            f"table {family} {self.table}\n"
            f"delete table {family} {self.table}\n"
            f"table {family} {self.table} {{\n"
            f"  chain out {{ {chain};\n" + "".join(f"    {r}\n" for r in rules) + "  }\n}\n",
        )


class ProcessCut(_Confined):
    """Processes of this namespace cut from a service's ports on loopback, one way or both,
    wholly or for a share of their packets, steadily or flapping.

    The explorer's workers run beside the cluster on 127.0.0.1, so their connections are
    told apart by process (:class:`_Confined`): an nftables table in the root namespace
    (``inet rlnem_cut_NAME``, ``output`` hook, which loopback traffic of both ends passes)
    drops

    * ``out`` (or ``both``): what they send to ``ports``, on the connections they hold (by
      their local ports, read from ``/proc``) and on any they open (``socket cgroupv2``:
      the handshake itself is lost);
    * ``in`` (or ``both``): what ``ports`` send back to them, on the connections they hold
      and on any they open (those get a connection mark of the cut's own at their first
      packet; the replies carrying it are dropped).

    ``percent`` below 100 drops that share of those packets at random (``numgen random``):
    a lossy link, where TCP retransmits and requests arrive late, some after their
    client's timeout. :meth:`flap` cuts and heals in turn until :meth:`heal`.

    Nothing is reset: a cut is silence, and clients find out by their timeouts. Other
    processes' connections to the same ports are untouched. :meth:`heal` removes the table
    and moves the processes back (those still alive); :func:`cleanup_cuts` removes what a
    killed run left.
    """

    def __init__(
        self,
        name: str,
        pids: Sequence[int],
        ports: Sequence[int],
        direction: str = "both",
        *,
        percent: int = 100,
    ) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r} not in {DIRECTIONS}")
        if not 0 < percent <= 100:
            raise ValueError(f"percent {percent} not in 1..100")
        super().__init__(name, pids, ports)
        self.direction = direction
        self.percent = percent
        self.mark = int.from_bytes(os.urandom(4), "big") | 1
        """A connection mark of this cut alone: marks outlive a healed cut in conntrack."""
        self.dropped = 0
        self._flapper: tuple[threading.Thread, threading.Event] | None = None

    def cut(self) -> None:
        self._confine()
        self._write(dropping=True)

    def _write(self, *, dropping: bool) -> None:
        ports = ", ".join(map(str, self.ports))
        cgroup = f'socket cgroupv2 level 1 "{self.group}"'
        drop = (f"numgen random mod 100 < {self.percent} " if self.percent < 100 else "") + (
            "counter drop"
        )
        rules = [f"{cgroup} tcp dport {{ {ports} }} ct state new ct mark set {self.mark}"]
        held = ", ".join(map(str, self.held))
        if dropping and self.direction in ("both", "out"):
            rules.append(f"{cgroup} tcp dport {{ {ports} }} {drop}")
            if held:
                rules.append(f"tcp sport {{ {held} }} tcp dport {{ {ports} }} {drop}")
        if dropping and self.direction in ("both", "in"):
            rules.append(f"ct mark {self.mark} ct direction reply {drop}")
            if held:
                rules.append(f"tcp sport {{ {ports} }} tcp dport {{ {held} }} {drop}")
        if not dropping:
            self.dropped += self.counted()
        self._table("inet", "type filter hook output priority 0", rules)

    def flap(self, *, down_s: float, up_s: float) -> None:
        """Cut (as :meth:`cut`) and let through in turn, ``down_s`` then ``up_s``, until
        :meth:`heal`: a link that keeps coming back and going again."""
        self.cut()  # down from the start, not from whenever the thread first runs
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(down_s):
                self._write(dropping=False)
                if stop.wait(up_s):
                    return
                self._write(dropping=True)

        thread = threading.Thread(target=loop, daemon=True, name=f"flap-{self.name}")
        self._flapper = (thread, stop)
        thread.start()

    def counted(self) -> int:
        listing = _run(["nft", "list", "table", "inet", self.table], check=False)
        return sum(int(m) for m in re.findall(r"counter packets (\d+)", listing))

    def heal(self) -> None:
        if self._flapper is not None:
            thread, stop = self._flapper
            stop.set()
            thread.join(timeout=10)
            self._flapper = None
        self.dropped += self.counted()
        _run(["nft", "delete", "table", "inet", self.table], check=False)
        self._release()


class ProcessDelay(_Confined):
    """Processes of this namespace whose connections to a service's ports go through
    :class:`delayproxy.DelayProxy` (one per port, in this process), each byte held
    ``delay_s`` each way: delay without netem, for processes on loopback.

    :meth:`delay` starts the proxies, adds a ``nat output`` rule in the root namespace
    (``ip rlnem_cut_NAME``) that sends the processes' new connections to each port to its
    proxy instead, and destroys the connections they held (``ss -K``: the kernel's
    socket-destroy, as a connection lost on a real network), so their clients reconnect
    through the proxies at once. :meth:`heal` removes the rule and lifts the delay; the
    connections made through a proxy stay on it, undelayed, until :meth:`close`.
    """

    def __init__(self, name: str, pids: Sequence[int], ports: Sequence[int], delay_s: float):
        super().__init__(name, pids, ports)
        self.delay_s = delay_s
        self.proxies: dict[int, Any] = {}
        self.killed = 0
        """Connections the processes held when the delay began, destroyed so they reconnect."""

    def delay(self) -> None:
        from delayproxy import DelayProxy

        for port in self.ports:
            proxy = DelayProxy(port, self.delay_s)
            proxy.__enter__()
            self.proxies[port] = proxy
        self._confine()
        cgroup = f'socket cgroupv2 level 1 "{self.group}"'
        self._table(
            "ip",
            "type nat hook output priority -100",
            [
                f"{cgroup} tcp dport {port} dnat to 127.0.0.1:{proxy.port}"
                for port, proxy in self.proxies.items()
            ],
        )
        for local in self.held:
            ports = " or ".join(f"dport = :{p}" for p in self.ports)
            _run(["ss", "-K", "-t", f"( sport = :{local} ) and ( {ports} )"], check=False)
            self.killed += 1

    @property
    def delayed(self) -> int:
        """Chunks the proxies passed on late: evidence the delay took effect."""
        return sum(p.delayed for p in self.proxies.values())

    def heal(self) -> None:
        _run(["nft", "delete", "table", "ip", self.table], check=False)
        self._release()
        for proxy in self.proxies.values():
            proxy.delay_s = 0.0

    def close(self) -> None:
        self.heal()
        for proxy in self.proxies.values():
            proxy.close()


def _local_ports(pids: Sequence[int], ports: Sequence[int]) -> list[int]:
    """The local ports of ``pids``' TCP connections to ``ports`` (from ``/proc``)."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    wanted = set(ports)
    out: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[9] in inodes:
                    local, remote = cols[1], cols[2]
                    if int(remote.rsplit(":", 1)[1], 16) in wanted:
                        out.add(int(local.rsplit(":", 1)[1], 16))
    return sorted(out)


def _remove_cgroup(root: Path, group: Path) -> None:
    """Move what is left in ``group`` to the root group, and remove it."""
    with contextlib.suppress(OSError):
        if group.exists():
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(pid + "\n")
            group.rmdir()


def cleanup_cuts() -> None:
    """Remove every :class:`ProcessCut` table and cgroup a killed run left."""
    if shutil.which("nft"):
        for line in _run(["nft", "list", "tables"], check=False).splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[2].startswith(f"{PREFIX}_cut_"):
                _run(["nft", "delete", "table", parts[1], parts[2]], check=False)
    with contextlib.suppress(NemesisUnavailable, OSError):
        root = _cgroup2_root()
        for group in root.glob(f"{CUT_PREFIX}*"):
            _remove_cgroup(root, group)


def _cgroup2_root() -> Path:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    raise NemesisUnavailable("no cgroup v2 hierarchy is mounted")


def _nft_with_cgroup2(root: Path, ruleset: str) -> None:
    if root == Path("/sys/fs/cgroup"):
        _run(["nft", "-f", "-"], stdin=ruleset)
        return
    script = "mount -t cgroup2 none /sys/fs/cgroup && exec nft -f -"
    _run(["unshare", "-m", "sh", "-c", script], stdin=ruleset)


def cleanup_quorum() -> None:
    """Remove the quorum table and cgroup (its processes moved back to the root group)."""
    if shutil.which("nft"):
        _run(["nft", "delete", "table", "inet", QUORUM_TABLE], check=False)
    with contextlib.suppress(NemesisUnavailable, OSError):
        root = _cgroup2_root()
        group = root / QUORUM_CGROUP
        if group.exists():
            for pid in (group / "cgroup.procs").read_text().split():
                (root / "cgroup.procs").write_text(pid + "\n")
            group.rmdir()


@contextlib.contextmanager
def nemesis_or_fail(services: Mapping[str, Sequence[int]], *, ci: bool) -> Iterator[Nemesis]:
    """A set-up :class:`Nemesis`, torn down after; where namespaces cannot be made, the
    test fails under CI (``ci``) and is skipped elsewhere, saying why."""
    import pytest

    nem = Nemesis(services)
    try:
        nem.setup()
    except NemesisUnavailable as exc:
        nem.teardown()
        message = f"network namespaces cannot be made here: {exc}"
        if ci:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield nem
    finally:
        nem.teardown()


SHIM_SOURCE = Path(__file__).with_name("faketime_c11.c")


def faketime_shim() -> str:
    """The path of ``faketime_c11.c`` built as a shared object (once per source text)."""
    source = SHIM_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"{PREFIX}-faketime-c11-{digest}.so"
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}")
        cc = ["cc", "-shared", "-fPIC", "-O2", "-o", str(tmp), str(SHIM_SOURCE), "-lpthread"]
        _run(cc)
        tmp.replace(out)
    return str(out)


LIBFAKETIME = "/usr/$LIB/faketime/libfaketime.so.1"
"""Debian's libfaketime, as its ``faketime`` wrapper preloads it (the loader expands ``$LIB``)."""


def skewed_env(env: Mapping[str, str], skew_s: float) -> dict[str, str]:
    """``env`` for a process whose wall clock runs ``skew_s`` off the real one: what the
    ``faketime`` wrapper sets, without the wrapper's own process between the caller and
    the program (a signal to the child the caller holds then reaches the program)."""
    check_available(skew=True)
    preload = " ".join(filter(None, [faketime_shim(), LIBFAKETIME, env.get("LD_PRELOAD")]))
    return {**env, "LD_PRELOAD": preload, "FAKETIME": f"{skew_s:+.0f}s"}


def _sysctl(key: str, value: int, *, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    _run([*prefix, "sysctl", "-qw", f"{key}={value}"])


def cleanup_stale() -> None:
    """Remove every namespace, link and table this module makes (its prefix), with their
    processes: what a killed run left, or the end of a run."""
    if not shutil.which("ip"):
        return
    for line in _run(["ip", "netns", "list"], check=False).splitlines():
        netns = line.split()[0] if line.strip() else ""
        if not netns.startswith(f"{PREFIX}-"):
            continue
        for pid in _run(["ip", "netns", "pids", netns], check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        _run(["ip", "netns", "del", netns], check=False)
    for line in _run(["ip", "-o", "link", "show"], check=False).splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if name.startswith(PREFIX):
            _run(["ip", "link", "del", name], check=False)
    if shutil.which("nft"):
        _run(["nft", "delete", "table", "ip", NAT_TABLE], check=False)
        _run(["nft", "delete", "table", "ip", PROXY_TABLE], check=False)
    cleanup_quorum()
    cleanup_cuts()
