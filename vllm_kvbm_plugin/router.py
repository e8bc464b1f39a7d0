"""A small KV-aware router: send each OpenAI completion to the worker that will serve most of its
prompt from cache (`vllm-kvbm route`).

Every worker's KV event stream (with replay) feeds one `events.index.KVIndex`; a request's prompt
(token ids, or text tokenized by a worker's `/tokenize`) is matched against it and forwarded, as
token ids, to the worker with the most servable tokens (ties: fewest requests in flight, then
fewest routed). Blocks in a shared remote tier (Redis) count for every worker that reads it
(`WorkerConfig.remote`), also for a worker that has published nothing yet; the remote tier's
announcer streams (`vllm-kvbm announce`), if given, feed the index too. Each request is logged with what the index predicted and what the worker reports
as served (`usage.prompt_tokens_details.cached_tokens`, needs `--enable-prompt-tokens-details`);
`GET /router/stats` returns those records. The header `X-KVBM-Policy: round-robin` routes a request
round-robin instead (for comparisons in the same run). A worker whose stream stays silent after it
served a request is warned about (log and stats): its publisher is likely connecting, not binding.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm_kvbm_plugin.events.index import KVIndex, WorkerConfig
from vllm_kvbm_plugin.events.subscriber import SilenceWatch, Subscriber
from vllm_kvbm_plugin.log import get_logger

logger = get_logger("router")
POLICIES = ("kv", "round-robin")


@dataclasses.dataclass
class Worker:
    """One `vllm serve` instance the router sends requests to, and where its KV events come from."""

    url: str  # http://host:port of `vllm serve`
    events: str  # its KV events PUB endpoint
    replay: str | None = None  # its replay endpoint
    in_flight: int = 0
    routed: int = 0
    last_event: float = 0.0  # monotonic time of the last batch applied

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


class Router:
    """The index, the subscriber threads and the routing decision (no HTTP here)."""

    def __init__(self, workers: list[Worker], topic: str = "", config: WorkerConfig | None = None,
                 settle_s: float = 0.05, policy: str = "kv", silence_s: float = 30.0,
                 announcers: list[Worker] = ()):
        if not workers:
            raise ValueError("the router needs at least one worker")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
        self.workers, self.topic, self.policy = workers, topic, policy
        self.index = KVIndex(config)
        for w in workers:  # matched from the start: a new worker may already serve a shared tier's blocks
            self.index.add_instance(w.url, config, ranks=(0,))
        self.lock = threading.Lock()
        self.settle_s = settle_s
        self.records: list[dict] = []
        self._rr = itertools.count()
        # worker index -> its stream's batch count when a request that stored blocks was sent to it
        self._due: dict[int, int] = {}
        self._stop = threading.Event()
        self.watches = [SilenceWatch(w.url, w.events, silence_s) for w in workers]
        # announcer streams: followed like a worker's, never routed to (so never expected to speak)
        followed = list(zip(workers, self.watches)) + [(a, SilenceWatch(None, a.events, 0)) for a in announcers]
        self._threads = [threading.Thread(target=self._follow, args=(w, sw), daemon=True, name=f"kv-events-{i}")
                         for i, (w, sw) in enumerate(followed)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)

    def _follow(self, w: Worker, watch: SilenceWatch) -> None:
        """Apply one worker's stream to the index, from seq 0 (replay fills what came before)."""
        with Subscriber(w.events, w.replay, self.topic, start_seq=0) as sub:
            while not self._stop.is_set():
                got = sub.poll(200)
                with self.lock:
                    for seq, batch in got:
                        self.index.apply(w.url, batch, seq)
                    if got:
                        w.last_event = time.monotonic()
                    watch.delivered(len(got))
                    watch.check("after it served a request")

    def _settle(self) -> None:
        """Read your writes: wait until every worker that answered a request which stored blocks has
        delivered a batch since that request was sent (the response can overtake its events), then
        until no worker published in the last `settle_s`. At most 1 s in all."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with self.lock:
                for i, mark in list(self._due.items()):
                    if self.watches[i].batches > mark:
                        del self._due[i]
                due = bool(self._due)
            if not due and time.monotonic() - max(w.last_event for w in self.workers) >= self.settle_s:
                return
            time.sleep(0.005)
        with self.lock:
            self._due.clear()

    def scores(self, token_ids: list[int]) -> list[int]:
        """Per worker, the prompt tokens it will serve from cache."""
        self._settle()
        with self.lock:
            matches = self.index.match(token_ids)
        return [max((m.tokens for (inst, _), m in matches.items() if inst == w.url), default=0)
                for w in self.workers]

    def choose(self, token_ids: list[int], policy: str | None = None) -> tuple[int, list[int]]:
        """(worker index, scores); marks the worker busy until `done`."""
        scores = self.scores(token_ids)
        with self.lock:
            if (policy or self.policy) == "round-robin":
                i = next(self._rr) % len(self.workers)
            else:
                i = min(range(len(self.workers)),
                        key=lambda k: (-scores[k], self.workers[k].in_flight, self.workers[k].routed, k))
            self.workers[i].in_flight += 1
            self.workers[i].routed += 1
        return i, scores

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
            if answered:
                self.watches[i].expect()
                unit = self.index.unit(self.workers[i].url) or 16
                if sent is not None and record["prompt_tokens"] - (record["served"] or 0) >= unit:
                    self._due[i] = sent
        logger.info("routed to worker %d (%s): prompt %d tokens, predicted %d, served %s, scores %s",
                    i, record["policy"], record["prompt_tokens"], record["predicted"], record["served"],
                    record["scores"])

    def stats(self) -> dict:
        with self.lock:
            records = list(self.records)
            streams = [{"worker": w.url, "events": w.events, "batches": sw.batches, "silent_s": sw.silent_s()}
                       for w, sw in zip(self.workers, self.watches)]
        sums: dict[str, dict] = {}
        for r in records:
            s = sums.setdefault(r["policy"], {"requests": 0, "served": 0, "predicted": 0, "mispredicted": 0})
            s["requests"] += 1
            s["served"] += r["served"] or 0
            s["predicted"] += r["predicted"]
            s["mispredicted"] += r["served"] is not None and r["predicted"] != r["served"]
        return {"workers": [w.url for w in self.workers], "by_policy": sums, "requests": records,
                "streams": streams, "silent_streams": [s["worker"] for s in streams if s["silent_s"] is not None]}


def _cached_tokens(response: dict) -> int | None:
    usage = response.get("usage") or {}
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def _post(url: str, body: dict, timeout: float = 600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


class _Handler(BaseHTTPRequestHandler):
    router: Router  # set by `serve`

    def log_message(self, fmt, *args):  # requests are logged by the router, with their scores
        pass

    def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, msg: str) -> None:
        self._reply(code, json.dumps({"error": {"message": msg, "code": code}}).encode())

    def do_GET(self):
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

    def do_POST(self):
        if self.path != "/v1/completions":
            return self._error(404, f"no route {self.path} (the router serves /v1/completions)")
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            token_ids = self._token_ids(body)
        except ValueError as e:
            return self._error(400, str(e))
        except (urllib.error.URLError, OSError) as e:
            return self._error(502, f"tokenizing failed: {e}")
        policy = self.headers.get("X-KVBM-Policy")
        if policy is not None and policy not in POLICIES:
            return self._error(400, f"X-KVBM-Policy: one of {', '.join(POLICIES)}")
        i, scores = self.router.choose(token_ids, policy)
        worker, served, answered = self.router.workers[i], None, False
        sent = self.router.sent(i)
        try:
            body["prompt"] = token_ids
            with _post(worker.url + self.path, body) as r:
                answered = True
                if body.get("stream"):
                    served = self._relay_stream(r)
                    return
                data, status = r.read(), r.status
            served = _cached_tokens(json.loads(data))
        except urllib.error.HTTPError as e:
            status, data = e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            status, data = 502, json.dumps({"error": {"message": f"worker {worker.url}: {e}", "code": 502}}).encode()
        finally:
            self.router.done(i, {"worker": i, "policy": policy or self.router.policy, "prompt_tokens": len(token_ids),
                                 "predicted": scores[i], "served": served, "scores": scores}, answered, sent)
        self._reply(status, data)

    def _relay_stream(self, r) -> int | None:
        """Pass server-sent events through as they come (the connection ends the stream); the
        cached tokens from the usage chunk (`stream_options: {"include_usage": true}`), if any."""
        self.send_response(r.status)
        self.send_header("Content-Type", r.headers.get("Content-Type", "text/event-stream"))
        self.end_headers()
        served = None
        for line in r:
            self.wfile.write(line)
            if line.startswith(b"data: {") and b'"usage"' in line:
                served = _cached_tokens(json.loads(line[6:])) if served is None else served
            if line == b"\n":
                self.wfile.flush()
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


def serve(router: Router, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted (binds loopback unless told otherwise)."""
    handler = type("Handler", (_Handler,), {"router": router})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    router.start()
    logger.info("routing /v1/completions on http://%s:%d to %s", host, httpd.server_address[1],
                ", ".join(w.url for w in router.workers))
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        router.stop()
