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
from netns import nemesis_or_fail

CLIENT = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
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
