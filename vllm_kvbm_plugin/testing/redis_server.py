"""A real redis-server (or valkey-server) for tests and benchmarks: our own process on a free
loopback port, no persistence, bounded memory, stopped by its PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time


def server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, maxmemory: str = "256mb", port: int | None = None):
        self.binary = server_binary()
        if self.binary is None:
            raise RuntimeError("no redis-server or valkey-server on PATH (scripts/setup.sh installs Debian's)")
        self.port = port or _free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        """Start (or restart, on the same port, empty) and wait until it answers PING."""
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--daemonize", "no",
             "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}")

    def client(self):
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
