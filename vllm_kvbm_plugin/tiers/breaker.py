"""When to stop asking a remote server. Failure is a miss: every call to the remote tier's server
goes through a `Breaker` that, after a failure (down, slow, reset, paused), stops using the server
for a backoff that doubles up to 30 s, then lets one call probe it."""

from __future__ import annotations

import threading
import time

from vllm_kvbm_plugin.log import get_logger, redact_url

logger = get_logger("tiers.remote")


class Breaker:
    """Circuit breaker: closed (use the server), open (a miss without asking, until the backoff
    ends), then one probe call decides. One log line per state change; counters for stats."""

    MIN_BACKOFF, MAX_BACKOFF = 0.5, 30.0

    def __init__(self, name: str, url: str) -> None:
        self.name, self.url = name, redact_url(url)  # shown in its log lines only
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
