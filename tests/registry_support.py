"""A gate in front of a schema registry: a TCP forwarder that can refuse every connection
for a while, so clients meet a registry that is down (connection refused) without the
registry itself losing its in-memory ids. Shared by tests/test_registry_outage.py and
the fault explorer."""

from __future__ import annotations

import contextlib
import socket
import threading


class Gate:
    """A TCP forwarder to the registry that can refuse every connection for a while."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.open = True
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._done = False
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _serve(self) -> None:
        while not self._done:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()  # the registry is down: the same as refusing
                continue
            with self._lock:
                self._live |= {client, up}
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def shut(self) -> None:
        """Refuse every new connection and cut the ones open (a client's kept-alive
        connection must meet the outage too), as a registry that went down does."""
        self.open = False
        with self._lock:
            live, self._live = self._live, set()
        for s in live:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._done = True
        self._sock.close()
