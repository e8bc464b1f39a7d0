"""ZMQ subscriber for vLLM's KV event stream, with gap detection and replay recovery.

Wire format (vLLM's ZmqEventPublisher): PUB frames `(topic, seq as 8-byte big-endian, payload)`;
seq starts at 0 and grows by one per batch. The optional replay endpoint is a ROUTER: send
`[b"", start_seq]` from a DEALER and receive `[b"", topic, seq, payload]` for every buffered batch
with seq >= start, then `[b"", b"", END_SEQ, b""]`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import zmq

from vllm_kvbm_plugin.events.types import KVEventBatch, decode_batch
from vllm_kvbm_plugin.log import get_logger

logger = get_logger("subscriber")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENDPOINT_FORMS = ("vLLM's KV events publisher binds only tcp://*:PORT, ipc:// and inproc:// endpoints and connects "
                  "to any other: start the worker with tcp://*:PORT (or ipc://PATH) and subscribe to "
                  "tcp://HOST:PORT (or the same ipc://PATH); with tcp://HOST:PORT on both sides nothing flows.")


@dataclasses.dataclass
class SubscriberStats:
    """What a Subscriber saw of one publisher's sequence numbers (for its log line and /router/stats)."""

    received: int = 0  # batches read from the PUB socket
    recovered: int = 0  # batches filled in from the replay endpoint
    lost: int = 0  # batches neither received nor recoverable
    gaps: int = 0  # times a gap was detected


class Subscriber:
    """Yields `(seq, KVEventBatch)` in sequence order, filling gaps from the replay endpoint.

    `start_seq`: the first sequence number expected (0 = from the publisher's start, so batches
    published before we connected are recovered too); None = start with whatever arrives first.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        start_seq: int | None = 0,
        replay_timeout_ms: int = 2000,
        context: zmq.Context | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self.next_seq = start_seq
        self.stats = SubscriberStats()

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self, timeout_ms: int) -> list[tuple[int, KVEventBatch]]:
        """Batches that arrived within `timeout_ms` (plus any recovered before them), in order."""
        out: list[tuple[int, KVEventBatch]] = []
        if not self._sub.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3:
                logger.warning("ignoring a KV event message with %d frames (expected 3)", len(frames))
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            self.stats.received += 1
            out.extend(self._accept(seq, payload))

    def iter(self, idle_timeout_ms: int | None = None) -> Iterator[tuple[int, KVEventBatch]]:
        """Yield batches until nothing arrives for `idle_timeout_ms` (forever when None)."""
        while True:
            got = self.poll(idle_timeout_ms if idle_timeout_ms is not None else 1000)
            if not got and idle_timeout_ms is not None:
                return
            yield from got

    def _accept(self, seq: int, payload: bytes) -> list[tuple[int, KVEventBatch]]:
        if self.next_seq is not None and seq < self.next_seq:
            if seq == 0:  # the publisher restarted
                logger.warning("KV event publisher restarted (seq 0 after %d)", self.next_seq - 1)
            else:
                return []  # already delivered through replay
        out = []
        if self.next_seq is not None and seq > self.next_seq:
            self.stats.gaps += 1
            out = self._recover(self.next_seq, seq)
        out.append((seq, decode_batch(payload)))
        self.next_seq = seq + 1
        return out

    def _recover(self, start: int, stop: int) -> list[tuple[int, KVEventBatch]]:
        """Batches [start, stop) from the replay endpoint; counts what could not be recovered."""
        got: dict[int, KVEventBatch] = {}
        if self._replay_endpoint:
            dealer = self._ctx.socket(zmq.DEALER)
            try:
                dealer.connect(self._replay_endpoint)
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while dealer.poll(self._replay_timeout_ms):
                    frames = dealer.recv_multipart()
                    if len(frames) != 4 or frames[2] == END_SEQ:
                        break
                    s = int.from_bytes(frames[2], "big")
                    if start <= s < stop:
                        got[s] = decode_batch(frames[3])
            finally:
                dealer.close(linger=0)
        missing = (stop - start) - len(got)
        self.stats.recovered += len(got)
        if missing:
            self.stats.lost += missing
            logger.warning(
                "KV events: %d of %d missed batches (seq %d..%d) could not be recovered%s",
                missing,
                stop - start,
                start,
                stop - 1,
                "" if self._replay_endpoint else " (no replay endpoint configured)",
            )
        return sorted(got.items())


class SilenceWatch:
    """Says when a stream delivered nothing for `after_s` while it should have: a worker given
    `tcp://HOST:PORT` connects instead of binding, as its subscriber does, and nothing ever flows
    (no error on either side). `expect()` starts the clock (a request served; or connecting, for a
    stream that must say something eventually); a delivered batch stops it. Warns once per silence."""

    def __init__(self, worker: str | None, endpoint: str, after_s: float) -> None:
        self.worker, self.endpoint, self.after_s = worker, endpoint, after_s
        self.batches = 0
        self.since: float | None = None  # when events became due; None: not waiting for any
        self.warned = False

    def expect(self, now: float | None = None) -> None:
        if self.since is None and self.after_s > 0:
            self.since = time.monotonic() if now is None else now

    def delivered(self, n: int) -> None:
        if n:
            self.batches += n
            self.since, self.warned = None, False

    def silent_s(self, now: float | None = None) -> float | None:
        """Seconds the stream has been silent past due (None: not silent for `after_s` yet)."""
        if self.since is None:
            return None
        s = (time.monotonic() if now is None else now) - self.since
        return s if s >= self.after_s else None

    def check(self, why: str, now: float | None = None) -> bool:
        """True while silent past `after_s`; logs the warning the first time."""
        s = self.silent_s(now)
        if s is not None and not self.warned:
            self.warned = True
            logger.warning("%sno KV events from %s in %.1f s %s (%d batches so far). %s",
                           f"worker {self.worker}: " if self.worker else "", self.endpoint, s, why, self.batches,
                           ENDPOINT_FORMS)
        return s is not None
