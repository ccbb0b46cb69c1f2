"""The nemesis itself: a one-way cut drops one direction and only that one.

A TCP connection from a namespace to a listener of the root namespace is made healthy,
then cut: ``out`` must stop the node's bytes and let the listener's through, ``in`` the
reverse, ``both`` both; after ``heal`` bytes flow again. (The first nemesis matched its
``out`` rule in the ``output`` hook, where a packet to 127.0.0.1 still goes to ``lo``:
a cut "both ways" silently dropped only the replies.) Needs no Kafka or Redis.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
from ci_support import IN_CI
from netns import (
    NemesisUnavailable,
    ProcessCut,
    ProcessDelay,
    check_available,
    nemesis_or_fail,
)

CLIENT = r"""
import socket, sys, time
port = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", port), timeout=5)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.settimeout(1.5)
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "send":
        try:
            s.sendall(arg.encode())
            print("sent", flush=True)
        except OSError:  # destroyed (a delay's ``ss -K``)
            print("lost", flush=True)
    elif cmd == "recv":
        try:
            got = s.recv(100).decode()
            print("got " + got if got else "lost", flush=True)
        except TimeoutError:
            print("timeout", flush=True)
        except OSError:
            print("lost", flush=True)
    elif cmd == "echo":  # a new connection: one byte there and back, in milliseconds
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as e:
            e.sendall(b"e")
            e.recv(1)
        print(f"{(time.monotonic() - t0) * 1000:.0f}", flush=True)
    elif cmd == "connect":  # a new connection, beside the held one
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.5).close()
            print("connected", flush=True)
        except OSError:
            print("refused", flush=True)
"""


def _ask(proc: subprocess.Popen[str], cmd: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _recv(conn: socket.socket) -> str:
    try:
        return conn.recv(100).decode()
    except TimeoutError:
        return ""


@pytest.mark.parametrize(
    ("direction", "node_to_service", "service_to_node"),
    [("out", False, True), ("in", True, False), ("both", False, False)],
)
def test_network_cut_drops_the_directions_it_names(
    direction: str, node_to_service: bool, service_to_node: bool
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with nemesis_or_fail({"echo": [port]}, ci=IN_CI) as nem:
            nem.add_node("probe")
            client = nem.popen(
                "probe",
                [sys.executable, "-c", CLIENT, str(port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "ready"
            conn, peer = server.accept()
            with conn:
                conn.settimeout(1.5)
                assert peer[0] == "127.0.0.1"  # Redis' protected mode sees loopback
                assert _ask(client, "send a") == "sent" and _recv(conn) == "a"
                conn.sendall(b"b")
                assert _ask(client, "recv") == "got b"

                nem.cut("probe", "echo", direction)
                t0 = time.monotonic()
                _ask(client, "send c")
                got_c = _recv(conn) == "c"
                conn.sendall(b"d")
                got_d = _ask(client, "recv") == "got d"
                assert (got_c, got_d) == (node_to_service, service_to_node), nem.rules("probe")

                nem.heal("probe")
                deadline = t0 + 20
                if not got_c:  # retransmitted after the heal
                    while not got_c and time.monotonic() < deadline:
                        got_c = "c" in _recv(conn)
                if not got_d:
                    while not got_d and time.monotonic() < deadline:
                        got_d = "d" in _ask(client, "recv")
                assert got_c and got_d, "bytes did not flow again after the heal"
            client.kill()


def _clients(
    port: int,
    n: int,
    *,
    accept: socket.socket | None = None,
    conns: list[socket.socket] | None = None,
) -> list[subprocess.Popen[str]]:
    """``n`` client processes connected to ``port``; with ``accept``, each connection is
    accepted (into ``conns``) before the next process starts, so the i-th is the i-th's."""
    procs = []
    for _ in range(n):
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        if accept is not None and conns is not None:
            conn, _ = accept.accept()
            conn.settimeout(1.5)
            conns.append(conn)
    return procs


@pytest.mark.parametrize(
    ("direction", "process_to_service", "service_to_process"),
    [("out", False, True), ("in", True, False), ("both", False, False)],
)
def test_a_process_cut_drops_its_directions_and_nobody_elses(
    direction: str, process_to_service: bool, service_to_process: bool
) -> None:
    """``ProcessCut`` (the explorer's worker cuts, on loopback): the cut process's held
    connection loses the directions named, a connection it opens during the cut is never
    made, a bystander's connection to the same port flows, and the heal restores it."""
    _process_faults_or_fail()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        conns: list[socket.socket] = []
        procs = _clients(port, 2, accept=server, conns=conns)
        cut: ProcessCut | None = None
        try:
            victim, bystander = procs
            cut = ProcessCut(f"t{direction}", [victim.pid], [port], direction)
            cut.cut()
            assert cut.held  # the victim's connection, found by its local port
            _ask(victim, "send c")
            got_c = _recv(conns[0]) == "c"
            conns[0].sendall(b"d")
            got_d = _ask(victim, "recv") == "got d"
            assert (got_c, got_d) == (process_to_service, service_to_process)
            assert _ask(victim, "connect") == "refused"  # new connections are cut too
            assert _ask(bystander, "send e") == "sent" and _recv(conns[1]) == "e"
            conns[1].sendall(b"f")
            assert _ask(bystander, "recv") == "got f"
            cut.heal()
            assert cut.dropped > 0
            deadline = time.monotonic() + 20
            while not got_c and time.monotonic() < deadline:
                got_c = "c" in _recv(conns[0])
            while not got_d and time.monotonic() < deadline:
                got_d = "d" in _ask(victim, "recv")
            assert got_c and got_d, "bytes did not flow again after the heal"
            for conn in conns:
                conn.close()
        finally:
            if cut is not None:
                cut.heal()
            for proc in procs:
                proc.kill()
                proc.wait(10)


def _process_faults_or_fail() -> None:
    try:
        check_available()
    except NemesisUnavailable as exc:
        if IN_CI:
            pytest.fail(f"process faults cannot be made here: {exc}", pytrace=False)
        pytest.skip(str(exc))


class _EchoServer:
    """A listener on 127.0.0.1 that sends back every byte it gets, on every connection."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(4096)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def close(self) -> None:
        self.server.close()


def test_a_process_delay_holds_its_bytes_and_nobody_elses() -> None:
    """``ProcessDelay`` (the explorer's delayed links): the delayed process's held
    connection is lost (so its client reconnects), each new one takes the delay twice per
    round trip, a bystander's is as fast as before, and after the heal new connections are
    fast again."""
    _process_faults_or_fail()
    echo = _EchoServer()
    procs = _clients(echo.port, 2)
    delay = ProcessDelay("tdelay", [procs[0].pid], [echo.port], 0.4)
    try:
        victim, bystander = procs
        assert _ask(victim, "send a") == "sent" and _ask(victim, "recv") == "got a"
        delay.delay()
        assert delay.killed == 1  # the held connection, found by its local port
        assert "lost" in (_ask(victim, "send b"), _ask(victim, "recv"))
        assert int(_ask(victim, "echo")) >= 750  # 400 ms each way
        assert delay.delayed > 0
        assert int(_ask(bystander, "echo")) < 300
        assert _ask(bystander, "send c") == "sent" and _ask(bystander, "recv") == "got c"
        delay.heal()
        assert int(_ask(victim, "echo")) < 300
    finally:
        delay.close()
        for proc in procs:
            proc.kill()
            proc.wait(10)
        echo.close()


@pytest.mark.parametrize("fault", ["loss", "flap"])
def test_a_lossy_or_flapping_process_link_delivers_late_not_never(fault: str) -> None:
    """``ProcessCut`` with a share of packets (``percent``) or flapping: the process's bytes
    are dropped (the counters say so) and TCP still delivers every one of them, in order;
    a bystander loses none."""
    _process_faults_or_fail()
    echo = _EchoServer()
    procs = _clients(echo.port, 2)
    victim, bystander = procs
    cut = ProcessCut(f"t{fault}", [victim.pid], [echo.port], percent=30 if fault == "loss" else 100)
    try:
        if fault == "loss":
            cut.cut()
        else:
            cut.flap(down_s=0.4, up_s=0.2)
        got = ""
        for ch in "abcdefghij":
            assert _ask(victim, f"send {ch}") == "sent"
            deadline = time.monotonic() + 30
            while ch not in got and time.monotonic() < deadline:
                reply = _ask(victim, "recv")
                assert reply != "lost"
                got += reply[4:] if reply.startswith("got ") else ""
        assert got == "abcdefghij"
        assert _ask(bystander, "send z") == "sent" and _ask(bystander, "recv") == "got z"
        cut.heal()
        assert cut.dropped > 0
    finally:
        cut.heal()
        for proc in procs:
            proc.kill()
            proc.wait(10)
        echo.close()
