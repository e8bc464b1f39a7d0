"""The remote tier's store: one Redis / Valkey key per entry and rank, the value the same bytes as a
disk block file (tiers/disk.py: header with key, layout fingerprint, lengths, checksum; payload;
metadata), so a value is verified exactly as a file is. The server may evict any key at any time.

Failure is a miss: every call goes through a `Breaker` that, after a failure (down, slow, reset,
paused), stops using the server for a backoff that doubles up to 30 s, then lets one call probe it.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np

from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import disk as diskfmt
from vllm_kvbm_plugin.tiers.checksum import checksum_final, checksum_update

logger = get_logger("tiers.remote")

CLIENT_NAME = "kvbm"  # what CLIENT LIST shows for our connections
SOCKET_TIMEOUT = 0.5  # s: a server slower than this is treated as down (the breaker opens)


def key_prefix(root: tuple[int, int], rank: int) -> str:
    """Keys of one layout (model, dtype, KV spec, hash unit) and rank; the disk format version
    names the value format. A value's name is the prefix and its key's hex (diskfmt.key_hex)."""
    return f"kvbm:{diskfmt.VERSION}:{root[0]:016x}{root[1]:016x}:r{rank}:"


_VALUE_NAME = re.compile(rb"kvbm:(\d+):([0-9a-f]{32}):r(\d+):([0-9a-f]{32})")


def parse_value_name(name: bytes) -> tuple[bytes, int, bytes] | None:
    """(layout root hex, rank, key hex) of a value name in the current format, else None."""
    m = _VALUE_NAME.fullmatch(name)
    if m is None or int(m.group(1)) != diskfmt.VERSION:
        return None
    return m.group(2), int(m.group(3)), m.group(4)


def value_name(root_hex: bytes, rank: int, key_hex: bytes) -> bytes:
    return b"kvbm:%d:%s:r%d:%s" % (diskfmt.VERSION, root_hex, rank, key_hex)


def value_parts(key, fingerprint: bytes, payload: np.ndarray, meta: bytes) -> list:
    """The value of `key`: a disk block file's bytes, as parts (the payload is not copied)."""
    return diskfmt.encode(key, fingerprint, payload, meta)


def read_value(value, key, fingerprint: bytes, out: np.ndarray) -> bool:
    """Verify a value read from the store and copy its payload into `out` (uint8, the exact
    payload size). False for anything but a complete value of `key` written under `fingerprint`
    (then `out` holds garbage and must not be used)."""
    out = out.reshape(-1)
    plen = out.nbytes
    if value is None or len(value) < diskfmt.HEADER_SIZE + plen:
        return False
    buf = np.frombuffer(value, dtype=np.uint8)
    h = diskfmt.parse_header(value)
    if (h is None or h.key != diskfmt.key_bytes(key) or h.fingerprint != fingerprint or h.payload_bytes != plen
            or diskfmt.HEADER_SIZE + plen + h.meta_bytes != len(value)):
        return False
    acc = np.zeros(2, dtype=np.uint64)
    payload = buf[diskfmt.HEADER_SIZE: diskfmt.HEADER_SIZE + plen]
    checksum_update(acc, payload, 0, out)
    meta = bytes(value[diskfmt.HEADER_SIZE + plen:])
    return diskfmt._combine(checksum_final(acc, plen), meta) == h.checksum


URL_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def check_url(url) -> None:
    """A clear startup error for anything but a URL `connect` takes."""
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES + CLUSTER_SCHEMES):
        raise ValueError(f"remote_url must start with one of {', '.join(URL_SCHEMES + CLUSTER_SCHEMES)}, "
                         f"got {url!r}")
    if url.startswith(CLUSTER_SCHEMES):
        cluster_seeds(url)


def cluster_seeds(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """Seed nodes, user and password of `redis+cluster://[user:password@]host:port[,host:port...]`
    (rediss+cluster:// for TLS): any node of the cluster will do, the client learns the rest."""
    rest = url.split("://", 1)[1].split("/", 1)[0]
    auth, _, hosts = rest.rpartition("@")
    user, _, password = auth.partition(":")
    seeds = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"remote_url {url!r}: cluster seeds must be host:port[,host:port...], got {node!r}")
        seeds.append((host.strip("[]"), int(port)))
    return seeds, user or None, password or None


def connect(url: str):
    """A redis-py client for `url` with short timeouts and no retries: a slow server must never
    hold a caller for long (the Breaker decides when to try again). For a Redis Cluster, a
    cluster client: it routes each single-key command of a pipeline to the node owning the key."""
    import redis

    opts = dict(socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT, health_check_interval=0,
                client_name=CLIENT_NAME)
    if not url.startswith(CLUSTER_SCHEMES):
        return redis.Redis.from_url(url, retry_on_timeout=False, **opts)
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    seeds, user, password = cluster_seeds(url)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds], username=user, password=password,
                        ssl=url.startswith("rediss"), retry=Retry(NoBackoff(), 0), **opts)


def connect_ready(url: str):
    """`connect`, then one PING to every node (every master of a cluster), so the first lookup
    or fetch finds its connections open and, for a cluster, its slot map built: done lazily, that
    costs a fresh instance more than a lookup's patience and its first request misses."""
    client = connect(url)
    if url.startswith(CLUSTER_SCHEMES):
        client.ping(target_nodes=client.PRIMARIES)
    else:
        client.ping()
    return client


class Breaker:
    """Circuit breaker: closed (use the server), open (a miss without asking, until the backoff
    ends), then one probe call decides. One log line per state change; counters for stats."""

    MIN_BACKOFF, MAX_BACKOFF = 0.5, 30.0

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url
        self.lock = threading.Lock()
        self.open_until = 0.0  # 0: closed
        self.backoff = self.MIN_BACKOFF
        self.probing = False
        self.failures = 0
        self.opened = 0
        self.closed = 0

    def allow(self) -> bool:
        """Whether to call the server now (closed, or the one probe after the backoff)."""
        with self.lock:
            if not self.open_until:
                return True
            if self.probing or time.monotonic() < self.open_until:
                return False
            self.probing = True
            return True

    def is_open(self) -> bool:
        return bool(self.open_until)

    def allow_soon(self) -> bool:
        """Closed, or its backoff is over (the next call probes the server)."""
        return not self.open_until or time.monotonic() >= self.open_until

    def success(self) -> None:
        with self.lock:
            if self.open_until:
                self.closed += 1
                logger.info("KVBMConnector remote tier (%s, %s): server back, using it again", self.name, self.url)
            self.open_until, self.backoff, self.probing = 0.0, self.MIN_BACKOFF, False

    def failure(self, error: BaseException) -> None:
        with self.lock:
            self.failures += 1
            if self.open_until and not self.probing:
                return  # already open: calls that were in flight
            if not self.open_until:
                self.opened += 1
                logger.warning("KVBMConnector remote tier (%s, %s): %s: %s; every remote lookup, read and "
                               "write is a miss for %.1f s", self.name, self.url, type(error).__name__,
                               error, self.backoff)
            else:  # the probe failed
                self.backoff = min(self.backoff * 2, self.MAX_BACKOFF)
            self.open_until = time.monotonic() + self.backoff
            self.probing = False
