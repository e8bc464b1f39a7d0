"""The remote tier's Redis protocol (RESP) clients: our own pipelined socket client for plain
servers (`DirectClient`), redis-py for TLS and clusters, and the calls every user of the remote
tier makes through either (`run`, `fetch_values`, `store_values`, `delete_values`). The values
they carry: tiers/remote_value.py; when to stop asking a server: tiers/breaker.py.

Credentials: a URL is only ever shown redacted (log.redact_url). vLLM logs the whole
kv_transfer_config at startup, so a password inside `remote_url` reaches vLLM's log: give it in
KVBM_REMOTE_PASSWORD instead (the user, if any, stays in the URL); every connection we open uses it
when the URL carries no password.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Union

import numpy as np

from vllm_kvbm_plugin.log import redact_url
from vllm_kvbm_plugin.tiers import block_file
from vllm_kvbm_plugin.tiers.mac import mac_final, mac_update
from vllm_kvbm_plugin.tiers.remote_value import BAD, MISSING, OK, classify, header_fits

if TYPE_CHECKING:
    import socket

    import redis
    from redis.cluster import RedisCluster

CLIENT_NAME = "kvbm"  # what CLIENT LIST shows for our connections
PASSWORD_ENV = "KVBM_REMOTE_PASSWORD"
SOCKET_TIMEOUT = 0.5  # s: a server slower than this is treated as down (the breaker opens)


def auth_password(url_password: str | None) -> str | None:
    """The password to authenticate with: the URL's, else KVBM_REMOTE_PASSWORD's (module docstring)."""
    return url_password or os.environ.get(PASSWORD_ENV) or None


class Landings:
    """Counts the remote fetches that landed in this process. A scheduler side waiting for its
    fetches waits for the count to move instead of sleeping a fixed pause: where the workers run
    in the scheduler's process (vLLM's in-process and single-worker executors) the request then
    goes on in the step its bytes land; elsewhere nothing moves it and the wait is the pause."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count = 0

    def landed(self) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """Until the count differs from `seen` or `timeout` passes; the count then."""
        with self.cond:
            self.cond.wait_for(lambda: self.count != seen, timeout)
            return self.count


LANDINGS = Landings()


class DirectClient:
    """Pipelined GETs and SETs on a socket of our own (redis:// and unix:// servers, not TLS, not
    a cluster). A GET's reply is read straight into the caller's buffer: the payload of a value
    goes from the kernel into its CPU slot and goes into the MAC there chunk by chunk while it is
    still in cache. redis-py copies each value twice (its parser's buffer, a bytes object) and
    read_value a third time; on 2 cores those copies also starve the server that is sending.
    A SET's value goes to the socket from its parts as they are (sendmsg: header, the CPU slot,
    metadata), where redis-py's pipeline would join, pack and copy it in Python.

    Any error leaves the connection out of step with the server: it is closed (the next fetch
    opens another) and the exception goes to the caller, whose Breaker decides."""

    CHUNK = 64 << 10  # staging buffer for reply lines, headers and metadata
    # GETs in flight: groups of about GROUP_BYTES of values, DEPTH groups at a time. Asked all at
    # once, the server builds every reply in fresh memory before sending (Redis copies values into
    # its output buffers) and a fetch after a pause took twice as long (58 x 256 KiB: 7 ms, not 4.8)
    GROUP_BYTES = 512 << 10
    DEPTH = 2

    def __init__(self, url: str) -> None:
        from redis.connection import parse_url

        self.opts = parse_url(url)
        self.opts["password"] = auth_password(self.opts.get("password"))
        self.sock: socket.socket | None = None
        self.buf = bytearray(self.CHUNK)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # buf[start:end]: received, not yet consumed

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith(("redis://", "unix://"))

    # ---- connection ---------------------------------------------------------------------------
    def connect(self) -> None:
        import socket

        o = self.opts
        if "path" in o:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(SOCKET_TIMEOUT)
            sock.connect(o["path"])
        else:
            sock = socket.create_connection((o.get("host", "localhost"), o.get("port", 6379)), SOCKET_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.start, self.end = sock, 0, 0
        setup = [[b"CLIENT", b"SETNAME", CLIENT_NAME.encode()]]
        if o.get("password"):
            auth = [o["username"], o["password"]] if o.get("username") else [o["password"]]
            setup.insert(0, [b"AUTH"] + [a.encode() for a in auth])
        if o.get("db"):
            setup.append([b"SELECT", str(o["db"]).encode()])
        try:
            sock.sendall(b"".join(_command(c) for c in setup))
            for _ in setup:
                line = self._line()
                if not line.startswith(b"+"):
                    raise ConnectionError(f"remote tier: server refused setup: {line[:200]!r}")
        except BaseException:
            self.close()  # not set up: never used
            raise

    def _ready(self) -> None:
        if self.sock is None or self._stale():
            self.close()
            self.connect()

    def _stale(self) -> bool:
        """Closed by the server since the last fetch (restarted, timed out idle clients): a
        connection redis-py would reopen on its own. Nothing may be pending between fetches."""
        import socket

        self._socket().settimeout(0)  # with a timeout, recv would first wait for something to read
        try:
            self._socket().recv(1, socket.MSG_PEEK)
            return True  # the end of the stream, or bytes nobody asked for
        except BlockingIOError:
            return False  # open, nothing to read: as it should be
        except OSError:
            return True
        finally:
            self._socket().settimeout(SOCKET_TIMEOUT)

    def _socket(self) -> socket.socket:
        if self.sock is None:
            raise ConnectionError("remote tier: not connected")
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    # ---- reading --------------------------------------------------------------------------------
    def _recv(self) -> None:
        """More bytes into the staging buffer (compacted first)."""
        if self.start:
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start:self.end]
            self.start, self.end = 0, n
        if self.end == len(self.buf):
            raise ConnectionError("remote tier: reply line longer than the read buffer")
        n = self._socket().recv_into(self.view[self.end:])
        if n == 0:
            raise ConnectionError("remote tier: the server closed the connection")
        self.end += n

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.view[self.start:i])
                self.start = i + 2
                return line
            self._recv()

    def _read_into(self, dst: memoryview, on_chunk: Callable[[int], None] | None = None) -> None:
        """Exactly len(dst) bytes into dst: what is staged first, then straight from the socket.
        on_chunk(end) after each piece lands (dst[:end] is complete)."""
        n, done = len(dst), 0
        staged = min(n, self.end - self.start)
        if staged:
            dst[:staged] = self.view[self.start:self.start + staged]
            self.start += staged
            done = staged
            if on_chunk is not None:
                on_chunk(done)
        while done < n:
            if n - done < self.CHUNK // 4:  # a short tail: one staging read may bring the next replies too
                self._recv()
                k = min(n - done, self.end - self.start)
                dst[done:done + k] = self.view[self.start:self.start + k]
                self.start += k
            else:
                k = self._socket().recv_into(dst[done:])
                if k == 0:
                    raise ConnectionError("remote tier: the server closed the connection")
            done += k
            if on_chunk is not None:
                on_chunk(done)

    def _skip(self, n: int) -> None:
        while n:
            if self.start == self.end:
                self._recv()
            k = min(n, self.end - self.start)
            self.start += k
            n -= k

    # ---- small commands -------------------------------------------------------------------------
    def call(self, commands: Sequence[Sequence[bytes | str]]) -> list:
        """Run `commands` pipelined, in one round trip; their replies as redis-py's pipelines give
        them with raise_on_error=False: int, bytes, None, or a ResponseError (not raised).
        For commands with short replies (EXISTS, SET): the scheduler's lookups."""
        from redis.exceptions import ResponseError

        try:
            self._ready()
            self._socket().sendall(b"".join(_command(c) for c in commands))
            replies: list[int | bytes | ResponseError | None] = []
            for _ in commands:
                line = self._line()
                kind, rest = line[:1], line[1:]
                if kind == b":":
                    replies.append(int(rest))
                elif kind == b"+":
                    replies.append(rest)
                elif kind == b"-":
                    replies.append(ResponseError(rest.decode(errors="replace")))
                elif kind == b"$":
                    n = int(rest)
                    replies.append(None if n < 0 else self._take(n + 2)[:-2])
                else:
                    raise ConnectionError(f"remote tier: unexpected reply {line[:200]!r}")
            return replies
        except BaseException:
            self.close()
            raise

    # ---- fetch ----------------------------------------------------------------------------------
    def fetch(self, names: list, keys: list, fingerprint: bytes, mac_key: np.ndarray, outs: list) -> list[int]:
        """GET every name (pipelined, DEPTH groups in flight) and verify each value into its `out`
        (uint8, the exact payload size): OK, BAD (present but not a complete value of its key
        under `fingerprint` and `mac_key`; `out` holds garbage) or MISSING, per name."""
        gets = [_command([b"GET", n]) for n in names]
        group = max(1, self.GROUP_BYTES // max(1, outs[0].nbytes)) if outs else 1
        try:
            self._ready()
            sent = min(len(gets), self.DEPTH * group)
            self._socket().sendall(b"".join(gets[:sent]))
            results = []
            for i, (k, out) in enumerate(zip(keys, outs)):
                if i % group == 0 and i and sent < len(gets):  # a group was read: ask for another one
                    self._socket().sendall(b"".join(gets[sent:sent + group]))
                    sent += group
                results.append(self._value(k, fingerprint, mac_key, out))
            return results
        except BaseException:
            self.close()
            raise

    # ---- store ----------------------------------------------------------------------------------
    SEND_BUFFERS = 512  # buffers per sendmsg (the kernel takes at most IOV_MAX, 1024)

    def store(self, names: list, values: list) -> None:
        """SET each name to its value, given as parts (value_parts: header, payload, metadata),
        pipelined in one round trip; raises unless every reply is +OK."""
        bufs: list[bytes | memoryview] = []
        for name, parts in zip(names, values):
            views = [memoryview(p).cast("B") for p in parts]
            name = name.encode() if isinstance(name, str) else name
            bufs.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, sum(v.nbytes for v in views)))
            bufs += [v for v in views if v.nbytes]
            bufs.append(b"\r\n")
        try:
            self._ready()
            i = 0
            while i < len(bufs):
                n = self._socket().sendmsg(bufs[i:i + self.SEND_BUFFERS])
                while i < len(bufs) and n >= len(bufs[i]):
                    n -= len(bufs[i])
                    i += 1
                if n:
                    bufs[i] = memoryview(bufs[i])[n:]
            refused = [line for line in (self._line() for _ in names) if line != b"+OK"]
        except BaseException:
            self.close()
            raise
        if refused:
            raise ConnectionError(f"remote tier: {len(refused)} of {len(names)} SETs refused: {refused[0][:200]!r}")

    def _value(self, key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray, out: np.ndarray) -> int:
        line = self._line()
        if line.startswith(b"-WRONGTYPE"):  # not a string under our name: not ours, a bad value
            return BAD
        if line[:1] != b"$":  # another error (-LOADING, -BUSY, ...): the server's, not the value's
            raise ConnectionError(f"remote tier: unexpected reply {line[:200]!r}")
        size = int(line[1:])
        if size < 0:
            return MISSING
        out = out.reshape(-1)
        plen = out.nbytes
        if size < block_file.HEADER_SIZE + plen:
            self._skip(size + 2)
            return BAD
        head = bytearray(block_file.HEADER_SIZE)
        self._read_into(memoryview(head))
        h = block_file.parse_header(head)
        if not header_fits(h, key, fingerprint, plen, size):
            self._skip(size - block_file.HEADER_SIZE + 2)
            return BAD
        acc = np.zeros(3, dtype=np.uint64)
        summed = [0]

        def mac(end: int) -> None:  # whole words as they land; the tail at the end
            stop = end if end == plen else end & ~7
            if stop > summed[0]:
                mac_update(acc, mac_key, out[summed[0]:stop], summed[0])
                summed[0] = stop

        self._read_into(out.data, mac)
        assert h is not None  # header_fits
        meta = bytearray(h.meta_bytes)
        self._read_into(memoryview(meta))
        if self._take(2) != b"\r\n":
            raise ConnectionError("remote tier: malformed bulk reply")
        tag = mac_final(acc, mac_key, np.frombuffer(head, dtype=np.uint8), np.frombuffer(meta, dtype=np.uint8))
        return OK if int(tag) == h.mac else BAD

    def _take(self, n: int) -> bytes:
        while self.end - self.start < n:
            self._recv()
        out = bytes(self.view[self.start:self.start + n])
        self.start += n
        return out


def _command(args: Sequence[bytes | str]) -> bytes:
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in parts)


RedisPyClient = Union["redis.Redis", "RedisCluster"]  # TLS and cluster URLs (connect)
Client = Union[DirectClient, RedisPyClient]  # what connect_direct returns

URL_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def check_url(url: object) -> None:
    """A clear startup error for anything but a URL `connect` takes, or without redis-py."""
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES + CLUSTER_SCHEMES):
        shown = repr(redact_url(url)) if isinstance(url, str) else type(url).__name__
        raise ValueError(f"remote_url must start with one of {', '.join(URL_SCHEMES + CLUSTER_SCHEMES)}, "
                         f"got {shown}")
    if url.startswith(CLUSTER_SCHEMES):
        cluster_seeds(url)
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ImportError("the remote tier (remote_url, KVBMRemoteTier, vllm-kvbm announce) needs redis-py, "
                          "which is not installed: pip install 'vllm-kvbm-plugin[remote]'") from None


def cluster_seeds(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """Seed nodes, user and password of `redis+cluster://[user:password@]host:port[,host:port...]`
    (rediss+cluster:// for TLS; the password else from KVBM_REMOTE_PASSWORD): any node of the
    cluster will do, the client learns the rest."""
    rest = url.split("://", 1)[1].split("/", 1)[0]
    auth, _, hosts = rest.rpartition("@")
    user, _, secret = auth.partition(":")
    seeds = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"remote_url {redact_url(url)!r}: cluster seeds must be host:port[,host:port...], "
                             f"got {node!r}")
        seeds.append((host.strip("[]"), int(port)))
    return seeds, user or None, auth_password(secret or None)


def connect(url: str) -> RedisPyClient:
    """A redis-py client for `url` with short timeouts and no retries: a slow server must never
    hold a caller for long (the Breaker decides when to try again). For a Redis Cluster, a
    cluster client: it routes each single-key command of a pipeline to the node owning the key."""
    import redis

    if not url.startswith(CLUSTER_SCHEMES):  # the URL's password, if any, wins over this one
        return redis.Redis.from_url(url, retry_on_timeout=False, password=auth_password(None),
                                    socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT,
                                    health_check_interval=0, client_name=CLIENT_NAME)
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    seeds, user, secret = cluster_seeds(url)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds], username=user, password=secret,
                        ssl=url.startswith("rediss"), retry=Retry(NoBackoff(), 0),
                        socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT,
                        health_check_interval=0, client_name=CLIENT_NAME)


def connect_ready(url: str) -> RedisPyClient:
    """`connect`, then one PING to every node (every master of a cluster), so the first lookup
    or fetch finds its connections open and, for a cluster, its slot map built: done lazily, that
    costs a fresh instance more than a lookup's patience and its first request misses."""
    from redis.cluster import RedisCluster

    client = connect(url)
    if isinstance(client, RedisCluster):
        client.ping(target_nodes=client.PRIMARIES)
    else:
        client.ping()
    return client


def connect_direct(url: str) -> Client:
    """A connected DirectClient where one can be used (redis://, unix://), else `connect_ready`'s
    redis-py client: for small pipelined commands (`run`)."""
    if DirectClient.supports(url):
        client = DirectClient(url)
        client.connect()
        return client
    return connect_ready(url)


def run(client: Client, commands: Sequence[Sequence[bytes | str]]) -> list:
    """Pipelined commands on a client of `connect_direct`, in one round trip; replies as redis-py
    gives them with raise_on_error=False."""
    if isinstance(client, DirectClient):
        return client.call(commands)
    pipe = client.pipeline(transaction=False)
    for c in commands:
        pipe.execute_command(*c)
    return pipe.execute(raise_on_error=False)


def fetch_values(client: Client, names: list, keys: list, fingerprint: bytes, mac_key: np.ndarray, outs: list) -> list[int]:
    """OK, BAD or MISSING per name, each value verified into its `out`: straight from the socket
    on a DirectClient, through `classify` on a redis-py client (TLS, cluster)."""
    if isinstance(client, DirectClient):
        return client.fetch(names, keys, fingerprint, mac_key, outs)
    replies = run(client, [("GET", name) for name in names])
    return [classify(v, k, fingerprint, mac_key, o) for v, k, o in zip(replies, keys, outs)]


def store_values(client: Client, names: list, values: list) -> None:
    """SET each name to its value (a list of parts, value_parts); raises on any failure. From
    the parts on a DirectClient, joined on a redis-py client (TLS, cluster)."""
    if isinstance(client, DirectClient):
        return client.store(names, values)
    pipe = client.pipeline(transaction=False)
    for name, parts in zip(names, values):
        pipe.set(name, b"".join(parts))
    pipe.execute()


def delete_values(client: Client, names: list) -> None:
    """Delete `names`, one key per command (a cluster routes each to its node); a failed command
    raises."""
    for reply in run(client, [("DEL", name) for name in names]):
        if isinstance(reply, Exception):
            raise reply
