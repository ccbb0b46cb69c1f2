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
import time

import pytest
from ci_support import IN_CI
from netns import NemesisUnavailable, ProcessCut, check_available, nemesis_or_fail

CLIENT = r"""
import socket, sys
port = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", port), timeout=5)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.settimeout(1.5)
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "send":
        s.sendall(arg.encode())
        print("sent", flush=True)
    elif cmd == "recv":
        try:
            print("got " + s.recv(100).decode(), flush=True)
        except TimeoutError:
            print("timeout", flush=True)
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
    try:
        check_available()
    except NemesisUnavailable as exc:
        if IN_CI:
            pytest.fail(f"process cuts cannot be made here: {exc}", pytrace=False)
        pytest.skip(str(exc))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        procs: list[subprocess.Popen[str]] = []
        conns: list[socket.socket] = []
        cut: ProcessCut | None = None
        try:
            for _ in range(2):  # one at a time: each accepted connection is its process's
                proc = subprocess.Popen(
                    [sys.executable, "-c", CLIENT, str(port)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                procs.append(proc)
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
                conn, _ = server.accept()
                conn.settimeout(1.5)
                conns.append(conn)
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
