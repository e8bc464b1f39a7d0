"""A small KV-aware router: send each OpenAI completion to the worker that will serve most of its
prompt from cache (`vllm-kvbm route`).

Every worker's KV event stream (with replay) feeds one `events.index.KVIndex`; a request's prompt
(token ids, or text tokenized by a worker's `/tokenize`) is matched against it and forwarded, as
token ids, to the worker with the most servable tokens (ties: fewest requests in flight, then fewest
routed). Blocks in a shared remote tier (Redis) count for every worker that reads it
(`WorkerConfig.remote`), also for a worker that has published nothing yet; the remote tier's
announcer streams (`vllm-kvbm announce`), if given, feed the index too. Each request is logged with
what the index predicted and what the worker reports as served
(`usage.prompt_tokens_details.cached_tokens`, needs `--enable-prompt-tokens-details`);
`GET /router/stats` returns the latest records and sums over all. A decision waits only for the
streams of workers whose answers it has not seen the events of (`Router._catch_up`). The header
`X-KVBM-Policy: round-robin` routes a request round-robin instead (for comparisons in the same run).
A worker whose stream stays silent after it served a request is warned about (log and stats): its
publisher is likely connecting, not binding.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import itertools
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Sequence
from typing import NamedTuple

from vllm_kvbm_plugin.events.index import KVIndex, WorkerConfig
from vllm_kvbm_plugin.events.subscriber import SilenceWatch, Subscriber
from vllm_kvbm_plugin.events.types import KVEventBatch
from vllm_kvbm_plugin.log import get_logger

logger = get_logger("router")
POLICIES = ("kv", "round-robin")
HISTORY = 1000  # request records kept for /router/stats (`--history`)
MAX_BODY_BYTES = 16 << 20  # largest request body read (`--max-body-bytes`): a 2M-token prompt as ids
CATCH_UP_S = 1.0  # the longest a decision waits for a worker's events (then routes without them)


@dataclasses.dataclass
class Worker:
    """One `vllm serve` instance the router sends requests to, and where its KV events come from."""

    url: str  # http://host:port of `vllm serve`
    events: str  # its KV events PUB endpoint
    replay: str | None = None  # its replay endpoint
    in_flight: int = 0
    routed: int = 0
    last_event: float = 0.0  # monotonic time of the last batch applied
    last_ts: float = 0.0  # the worker's time stamp (time.time()) on that batch

    @classmethod
    def parse(cls, spec: str) -> "Worker":
        """`URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]`."""
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"worker {spec!r}: expected URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]")
        return cls(parts[0].rstrip("/"), parts[1], parts[2] if len(parts) == 3 else None)

    @classmethod
    def announcer(cls, spec: str) -> "Worker":
        """`EVENTS_ENDPOINT[,REPLAY_ENDPOINT]` of a remote tier's announcer: a stream, no server."""
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) not in (1, 2) or not all(parts):
            raise ValueError(f"announcer {spec!r}: expected EVENTS_ENDPOINT[,REPLAY_ENDPOINT]")
        return cls(f"announcer:{parts[0]}", parts[0], parts[1] if len(parts) == 2 else None)


class Decision(NamedTuple):
    """A routing decision: the worker chosen, every worker's score, and how long the decision
    waited for workers' KV events (until the last stream it depended on was caught up)."""

    worker: int
    scores: list[int]
    waited_s: float


class _Due(NamedTuple):
    """An answered request whose KV events the next decision must see (read your writes)."""

    sent: int  # the worker's stream's batch count when the request was sent
    answered: float  # time.time() at the answer: the worker stamps its batches with the same clock
    at: float  # time.monotonic() at the answer


class Router:
    """The index, the subscriber threads and the routing decision (no HTTP here)."""

    def __init__(self, workers: list[Worker], topic: str = "", config: WorkerConfig | None = None,
                 settle_s: float = 0.05, policy: str = "kv", silence_s: float = 30.0,
                 announcers: Sequence[Worker] = (), history: int = HISTORY) -> None:
        if not workers:
            raise ValueError("the router needs at least one worker")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
        if history < 1:
            raise ValueError(f"history: {history}; keep at least one request's record")
        self.workers, self.topic, self.policy = workers, topic, policy
        self.index = KVIndex(config)
        for w in workers:  # matched from the start: a new worker may already serve a shared tier's blocks
            self.index.add_instance(w.url, config, ranks=(0,))
        self.lock = threading.Lock()
        self._caught_up = threading.Condition(self.lock)  # notified whenever a stream delivered batches
        self.settle_s = settle_s  # how long after its answer an idle worker's events may still be in transit
        self.records: collections.deque[dict] = collections.deque(maxlen=history)  # the latest requests
        self.totals: dict[str, dict] = {}  # policy -> sums over every request routed
        self.late = 0  # decisions that gave up waiting for a stream (CATCH_UP_S)
        self._rr = itertools.count()
        self._due: dict[int, _Due] = {}  # worker index -> its latest answer whose events are not seen yet
        self._caught_at: dict[int, float] = {}  # worker index -> when its stream last caught up with an answer
        self._stop = threading.Event()
        self.watches = [SilenceWatch(w.url, w.events, silence_s) for w in workers]
        # announcer streams: followed like a worker's, never routed to (so never expected to speak)
        followed = list(zip(workers, self.watches)) + [(a, SilenceWatch(None, a.events, 0)) for a in announcers]
        self._threads = [threading.Thread(target=self._follow, args=(i if i < len(workers) else None, w, sw),
                                          daemon=True, name=f"kv-events-{i}") for i, (w, sw) in enumerate(followed)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)

    def _follow(self, i: int | None, w: Worker, watch: SilenceWatch) -> None:
        """Apply one stream to the index, from seq 0 (replay fills what came before)."""
        with Subscriber(w.events, w.replay, self.topic, start_seq=0) as sub:
            while not self._stop.is_set():
                self._applied(i, w, watch, sub.poll(200))

    def _applied(self, i: int | None, w: Worker, watch: SilenceWatch, got: list[tuple[int, KVEventBatch]]) -> None:
        """Apply `(seq, batch)`s of the stream of worker `i` (None: an announcer's) and wake the
        decisions waiting for it. A batch stamped at or after the worker's answer catches it up:
        the stream is in order, so every batch of the answered request came before it."""
        with self.lock:
            for seq, batch in got:
                self.index.apply(w.url, batch, seq)
            if got:
                w.last_event, w.last_ts = time.monotonic(), got[-1][1].ts
                if i is not None and (due := self._due.get(i)) is not None and w.last_ts >= due.answered:
                    del self._due[i]
                    self._caught_at[i] = w.last_event
                self._caught_up.notify_all()
            watch.delivered(len(got))
            watch.check("after it served a request")

    def _catch_up(self) -> float:
        """Read your writes: a response can overtake its KV events, so wait until the stream of
        every worker that answered a request which stored blocks has caught up with that answer
        (`_applied`; or, for a worker gone idle, a batch since the request was sent and nothing for
        `settle_s` after the answer: its events are no longer in transit). Never for other
        streams, busy or not, nor for events newer than the answer; at most `CATCH_UP_S`.
        Returns how long the streams took to catch up (the workers' own wait)."""
        t0 = time.monotonic()
        deadline = t0 + CATCH_UP_S
        with self._caught_up:
            waiting = set(self._due)
            while pending := [i for i in waiting if i in self._due]:
                now = time.monotonic()
                for i in pending:
                    due = self._due[i]
                    if self.watches[i].batches > due.sent and now - due.at >= self.settle_s:
                        del self._due[i]
                        self._caught_at[i] = min(now, max(due.at + self.settle_s, self.workers[i].last_event))
                if not any(i in self._due for i in pending):
                    break
                if now >= deadline:
                    self.late += 1
                    logger.warning("no KV events from worker(s) %s %.1f s after their answers; routing without them",
                                   ", ".join(self.workers[i].url for i in pending if i in self._due), CATCH_UP_S)
                    for i in pending:
                        self._due.pop(i, None)
                    return now - t0
                idle = [self._due[i].at + self.settle_s for i in pending if i in self._due]
                self._caught_up.wait(min([deadline] + [t for t in idle if t > now]) - now)
            return max([t0] + [self._caught_at.get(i, t0) for i in waiting]) - t0

    def scores(self, token_ids: list[int]) -> list[int]:
        """Per worker, the prompt tokens it will serve from cache."""
        return self._scores(token_ids)[0]

    def _scores(self, token_ids: list[int]) -> tuple[list[int], float]:
        waited = self._catch_up()
        with self.lock:
            matches = self.index.match(token_ids)
        return [max((m.tokens for (inst, _), m in matches.items() if inst == w.url), default=0)
                for w in self.workers], waited

    def choose(self, token_ids: list[int], policy: str | None = None) -> Decision:
        """Marks the chosen worker busy until `done`."""
        scores, waited = self._scores(token_ids)
        with self.lock:
            if (policy or self.policy) == "round-robin":
                i = next(self._rr) % len(self.workers)
            else:
                i = min(range(len(self.workers)),
                        key=lambda k: (-scores[k], self.workers[k].in_flight, self.workers[k].routed, k))
            self.workers[i].in_flight += 1
            self.workers[i].routed += 1
        return Decision(i, scores, waited)

    def sent(self, i: int) -> int:
        """Call as the request goes to worker `i`: the mark `done` takes (its stream's batches so far)."""
        with self.lock:
            return self.watches[i].batches

    def done(self, i: int, record: dict, answered: bool = True, sent: int | None = None) -> None:
        """The worker's request is over; an answered one makes its KV events due. With `sent` (the
        mark from `sent`), the next routing decision waits for them if it computed a full block."""
        with self.lock:
            self.workers[i].in_flight -= 1
            self.records.append(record)
            s = self.totals.setdefault(record["policy"], {"requests": 0, "served": 0, "predicted": 0,
                                                          "mispredicted": 0})
            s["requests"] += 1
            s["served"] += record["served"] or 0
            s["predicted"] += record["predicted"]
            s["mispredicted"] += record["served"] is not None and record["predicted"] != record["served"]
            if answered:
                self.watches[i].expect()
                unit = self.index.unit(self.workers[i].url) or 16
                if sent is not None and record["prompt_tokens"] - (record["served"] or 0) >= unit:
                    self._due[i] = _Due(sent, time.time(), time.monotonic())
        logger.info("routed to worker %d (%s): prompt %d tokens, predicted %d, served %s, scores %s",
                    i, record["policy"], record["prompt_tokens"], record["predicted"], record["served"],
                    record["scores"])

    def stats(self) -> dict:
        """Sums over every request routed, the latest `history` requests' records, the streams."""
        with self.lock:
            streams = [{"worker": w.url, "events": w.events, "batches": sw.batches, "silent_s": sw.silent_s()}
                       for w, sw in zip(self.workers, self.watches)]
            return {"workers": [w.url for w in self.workers], "by_policy": {p: dict(s) for p, s in self.totals.items()},
                    "requests": list(self.records), "history": self.records.maxlen, "late_decisions": self.late,
                    "streams": streams,
                    "silent_streams": [s["worker"] for s in streams if s["silent_s"] is not None]}


def _cached_tokens(data: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a worker's JSON answer (None: not there)."""
    try:
        response = json.loads(data)
        return ((response.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError):
        return None


def _post(url: str, body: dict, timeout: float = 600) -> http.client.HTTPResponse:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


class _Handler(BaseHTTPRequestHandler):
    router: Router  # set by `make_server`
    max_body_bytes: int

    def log_message(self, fmt: str, *args: object) -> None:  # requests are logged by the router, with their scores
        pass

    def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, msg: str) -> None:
        self._reply(code, json.dumps({"error": {"message": msg, "code": code}}).encode())

    def do_GET(self) -> None:
        if self.path == "/router/stats":
            return self._reply(200, json.dumps(self.router.stats()).encode())
        if self.path == "/health":
            return self._reply(200, b"{}")
        if self.path == "/v1/models":
            try:
                with urllib.request.urlopen(self.router.workers[0].url + self.path, timeout=30) as r:
                    return self._reply(r.status, r.read())
            except (urllib.error.URLError, OSError) as e:
                return self._error(502, f"worker unreachable: {e}")
        self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            return self._refuse(404, f"no route {self.path} (the router serves /v1/completions)")
        raw = self._body()
        if raw is None:
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the request body is not a JSON object")
            token_ids = self._token_ids(body)
        except ValueError as e:
            return self._error(400, str(e))
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            return self._error(502, f"tokenizing failed: {e}")
        policy = self.headers.get("X-KVBM-Policy")
        if policy is not None and policy not in POLICIES:
            return self._error(400, f"X-KVBM-Policy: one of {', '.join(POLICIES)}")
        i, scores, waited = self.router.choose(token_ids, policy)
        worker, served, answered = self.router.workers[i], None, False
        sent = self.router.sent(i)
        try:
            body["prompt"] = token_ids
            with _post(worker.url + self.path, body) as r:
                answered = True
                if body.get("stream"):
                    served = self._relay_stream(r, worker)
                    return
                data, status = r.read(), r.status
            served = _cached_tokens(data)
        except urllib.error.HTTPError as e:
            status, data = e.code, e.read()
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            status, data = 502, json.dumps({"error": {"message": f"worker {worker.url}: {e}", "code": 502}}).encode()
        finally:
            self.router.done(i, {"worker": i, "policy": policy or self.router.policy, "prompt_tokens": len(token_ids),
                                 "predicted": scores[i], "served": served, "scores": scores,
                                 "waited_ms": round(waited * 1000, 1)}, answered, sent)
        self._reply(status, data)

    def _body(self) -> bytes | None:
        """The request body, at most `max_body_bytes`; None when it was refused (answered)."""
        if self.headers.get("Transfer-Encoding"):
            self._refuse(411, "send the request body with a Content-Length (no Transfer-Encoding)")
            return None
        length = (self.headers.get("Content-Length") or "0").strip()
        if not length.isdigit():
            self._refuse(400, f"Content-Length: {length!r} is not a byte count")
            return None
        if int(length) > self.max_body_bytes:
            self._refuse(413, f"the request body ({int(length)} bytes) is over the router's limit of "
                              f"{self.max_body_bytes} bytes (vllm-kvbm route --max-body-bytes)")
            return None
        return self.rfile.read(int(length))

    def _refuse(self, code: int, msg: str) -> None:
        """Answer an error without reading the body, then close the connection so that the client
        reads the answer: discard what it still sends (for at most a second) instead of resetting."""
        self._error(code, msg)
        self.close_connection = True
        deadline = time.monotonic() + 1.0
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(1 << 16):
                    break
        except OSError:  # timed out, or the client is gone
            pass

    def _relay_stream(self, r: http.client.HTTPResponse, worker: Worker) -> int | None:
        """Pass server-sent events through as they come (the connection ends the stream); the
        cached tokens from the usage chunk (`stream_options: {"include_usage": true}`), if any.
        Once the status line is out there is no other answer: a stream broken on either side is
        closed short, the client sees it end without `data: [DONE]`."""
        self.send_response(r.status)
        self.send_header("Content-Type", r.headers.get("Content-Type", "text/event-stream"))
        self.end_headers()
        self.close_connection = True
        served = None
        try:
            for line in r:
                self.wfile.write(line)
                if line.startswith(b"data: {") and b'"usage"' in line:
                    served = _cached_tokens(line[6:]) if served is None else served
                if line == b"\n":
                    self.wfile.flush()
        except (OSError, http.client.HTTPException) as e:
            logger.warning("worker %s: a streamed answer broke off (%s); closing the client's stream short",
                           worker.url, e or type(e).__name__)
        return served

    def _token_ids(self, body: dict) -> list[int]:
        """The prompt as token ids: given as such, or a text tokenized by a worker as it would."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and prompt:
            with _post(self.router.workers[0].url + "/tokenize", {"model": body.get("model"), "prompt": prompt}) as r:
                return json.loads(r.read())["tokens"]
        raise ValueError("prompt: one text or one list of token ids per request")


def make_server(router: Router, host: str = "127.0.0.1", port: int = 8000,
                max_body_bytes: int = MAX_BODY_BYTES) -> ThreadingHTTPServer:
    """The router's HTTP server, bound (loopback unless told otherwise), not serving yet."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: {max_body_bytes}; must be positive")
    handler = type("Handler", (_Handler,), {"router": router, "max_body_bytes": max_body_bytes})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


def serve(router: Router, host: str = "127.0.0.1", port: int = 8000, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Serve until interrupted."""
    httpd = make_server(router, host, port, max_body_bytes)
    router.start()
    logger.info("routing /v1/completions on http://%s:%d to %s", host, httpd.server_address[1],
                ", ".join(w.url for w in router.workers))
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        router.stop()
