"""A loopback TCP forwarder that refuses chosen connections: a server that is down for exactly one
client's start (the first connection here), up for everyone after, as a fleet sees a restarting
Redis. Connections are counted, so a test also learns who connected at all."""

from __future__ import annotations

import socket
import threading
from collections.abc import Collection


class RefusingProxy:
    """Listens on 127.0.0.1:`port`; connection i (0-based) is closed at once if i is in `refuse`,
    else forwarded to `upstream` byte for byte. `accepted` counts every connection."""

    def __init__(self, upstream: tuple[str, int], refuse: Collection[int] = frozenset({0})) -> None:
        self.upstream, self.refuse = upstream, set(refuse)
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="refusing-proxy", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            i, self.accepted = self.accepted, self.accepted + 1
            if i in self.refuse:
                conn.close()
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
