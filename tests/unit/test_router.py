"""The router's choice: most servable tokens per the index, ties to the least loaded worker, and
round-robin on request; its bounded history; its HTTP front's limits and broken streams on real
sockets (the HTTP path runs end to end with real workers in tests/serve/test_router.py)."""

import contextlib
import json
import random
import re
import socket
import struct
import threading
import time

import pytest

from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher
from vllm_kvbm_plugin.events.types import BlockStored, KVEventBatch
from vllm_kvbm_plugin.router import Router, Worker, make_server

rng = random.Random(7)


def toks(n):
    return [rng.randrange(10, 2000) for _ in range(n)]


def store(router, url, prompt, unit=16):
    hs = PromptHasher().event_hashes(prompt, unit)
    ev = BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=prompt[:len(hs) * unit], block_size=unit,
                     lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention")
    router.index.apply(url, KVEventBatch(0.0, [ev]))


def make_router(tmp_path, **kw):
    workers = [Worker.parse(f"http://127.0.0.1:{9000 + i},ipc://{tmp_path}/ev{i},ipc://{tmp_path}/rp{i}")
               for i in range(2)]
    return Router(workers, settle_s=0, **kw)


def test_worker_spec():
    w = Worker.parse("http://127.0.0.1:8000/,tcp://127.0.0.1:5557")
    assert (w.url, w.events, w.replay) == ("http://127.0.0.1:8000", "tcp://127.0.0.1:5557", None)
    with pytest.raises(ValueError, match="URL,EVENTS_ENDPOINT"):
        Worker.parse("http://127.0.0.1:8000")


def test_most_servable_tokens_then_least_loaded(tmp_path):
    router = make_router(tmp_path)
    a, b = toks(100), toks(100)
    store(router, router.workers[1].url, a)
    store(router, router.workers[0].url, b[:48])
    assert router.choose(a)[:2] == (1, [0, 96])
    assert router.choose(b)[:2] == (0, [48, 0])
    router.done(1, {"policy": "kv", "prompt_tokens": 100, "predicted": 96, "served": 96, "scores": [0, 96]})
    # a tie: worker 0 has a request in flight, worker 1 none
    assert router.choose(toks(50))[0] == 1
    stats = router.stats()
    assert stats["by_policy"]["kv"] == {"requests": 1, "served": 96, "predicted": 96, "mispredicted": 0}


def test_round_robin_on_request(tmp_path):
    router = make_router(tmp_path)
    a = toks(100)
    store(router, router.workers[1].url, a)
    assert [router.choose(a, "round-robin")[0] for _ in range(3)] == [0, 1, 0]
    with pytest.raises(ValueError, match="unknown policy"):
        make_router(tmp_path, policy="random")


def test_only_an_answered_request_makes_events_due(tmp_path):
    router = make_router(tmp_path, silence_s=0.01)
    record = {"policy": "kv", "prompt_tokens": 8, "predicted": 0, "served": None, "scores": [0, 0]}
    router.done(0, record, answered=False)  # the worker was unreachable: it published nothing
    router.done(1, record)
    time.sleep(0.05)
    assert router.stats()["silent_streams"] == [router.workers[1].url]
    router.watches[1].delivered(1)  # a batch arrived: the stream works
    assert router.stats()["silent_streams"] == []
    never = make_router(tmp_path, silence_s=0)  # --silence-warning 0
    never.done(0, record)
    time.sleep(0.05)
    assert never.stats()["silent_streams"] == []


def test_a_shared_remote_tier_scores_for_a_worker_that_published_nothing(tmp_path):
    from vllm_kvbm_plugin.events.index import WorkerConfig

    router = make_router(tmp_path, config=WorkerConfig(hash_block_size=16, remote="all"))
    a = toks(100)
    hs = PromptHasher().event_hashes(a, 16)
    remote = BlockStored(block_hashes=hs[:4], parent_block_hash=None, token_ids=a[:64], block_size=16, lora_id=None,
                         medium="STORAGE", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
                         locality="REMOTE", ownership="kvbm-remote:ab")
    router.index.apply(router.workers[0].url, KVEventBatch(0.0, [remote], 0))
    store(router, router.workers[0].url, a[:32])
    assert router.scores(a) == [64, 64]  # worker 1 reads the store worker 0 wrote into


def test_announcer_streams_are_followed_never_routed_to(tmp_path):
    a = Worker.announcer(f"ipc://{tmp_path}/ann,ipc://{tmp_path}/ann-replay")
    assert (a.url, a.events, a.replay) == (f"announcer:ipc://{tmp_path}/ann", f"ipc://{tmp_path}/ann", f"ipc://{tmp_path}/ann-replay")
    with pytest.raises(ValueError, match="EVENTS_ENDPOINT"):
        Worker.announcer("a,b,c")
    router = make_router(tmp_path, announcers=[a])
    assert len(router._threads) == 3 and len(router.workers) == 2


def test_history_is_bounded_and_sums_cover_every_request(tmp_path):
    router = make_router(tmp_path, history=10)
    sizes = []
    for n in range(1, 201):
        i = router.choose(toks(40))[0]
        router.done(i, {"worker": i, "policy": "kv", "prompt_tokens": 40, "predicted": 0, "served": n % 2,
                        "scores": [0, 0]})
        if n in (50, 200):
            sizes.append(len(json.dumps(router.stats()["requests"])))
    stats = router.stats()
    assert len(stats["requests"]) == 10 and stats["history"] == 10
    assert stats["requests"][-1]["served"] == 0 and stats["requests"][0]["served"] == 1  # the latest ten
    assert stats["by_policy"]["kv"] == {"requests": 200, "served": 100, "predicted": 0, "mispredicted": 100}
    assert sizes[0] == sizes[1], sizes
    with pytest.raises(ValueError, match="history"):
        make_router(tmp_path, history=0)


# ---- the HTTP front: real sockets, a stand-in worker where a worker must misbehave -------------------

@contextlib.contextmanager
def serving(router, **kw):
    httpd = make_server(router, "127.0.0.1", 0, **kw)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def exchange(port, head: bytes, body: bytes = b"", until: bytes | None = None) -> bytes:
    """Send a raw request, read what comes back until the router closes (or `until` is seen)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        threading.Thread(target=lambda: _send_quietly(s, head + body), daemon=True).start()
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
            if until is not None and until in out:
                break
        return out


def _send_quietly(s, data):
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # the whole request is out
    except OSError:  # the router closed after answering: the rest of the body is not wanted
        pass


def post_head(length, extra=b""):
    return (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: " + str(length).encode() + b"\r\n\r\n")


def test_an_oversize_body_is_refused_unread(tmp_path):
    router = make_router(tmp_path)
    with serving(router, max_body_bytes=1000) as port:
        out = exchange(port, post_head(10 ** 9), b"x" * (4 << 20))  # announced 1 GB, 4 MiB sent
        assert out.startswith(b"HTTP/1.0 413 ") and out.count(b"HTTP/1.") == 1, out[:200]
        msg = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert "1000000000 bytes" in msg and "limit of 1000 bytes" in msg and "--max-body-bytes" in msg
        assert exchange(port, post_head("12x")).startswith(b"HTTP/1.0 400 ")
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"5\r\nhello\r\n0\r\n\r\n")
        assert exchange(port, chunked).startswith(b"HTTP/1.0 411 ")
        # at the limit: read, parsed and routed (to a worker that is not there)
        body = json.dumps({"prompt": toks(100)}).encode()
        body += b" " * (1000 - len(body))
        out = exchange(port, post_head(len(body)), body)
        assert out.startswith(b"HTTP/1.0 502 ") and b"worker http://127.0.0.1:9000" in out, out[:300]
    assert router.stats()["by_policy"]["kv"]["requests"] == 1  # only the last one was routed


class BreakingWorker:
    """A worker that answers a streamed completion with its headers and one event, then breaks
    off: `reset` (RST) once told the client saw the event, or `close` inside the next chunk."""

    def __init__(self, how: str):
        self.how, self.client_saw_event = how, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.sock.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(1 << 16)
            head, rest = data.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            while len(rest) < length:
                rest += conn.recv(1 << 16)
            event = b'data: {"choices": [{"text": "a"}]}\n\n'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"%x\r\n" % len(event) + event + b"\r\n")
            if self.how == "reset":
                self.client_saw_event.wait(10)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                conn.sendall(b"40\r\ndata: {")


@pytest.mark.parametrize("how", ["reset", "close"])
def test_a_stream_that_breaks_off_gets_no_second_answer(tmp_path, how, caplog):
    worker = BreakingWorker(how)
    router = Router([Worker.parse(f"{worker.url},ipc://{tmp_path}/ev0")], settle_s=0)
    body = json.dumps({"prompt": toks(40), "stream": True}).encode()
    with serving(router) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(post_head(len(body)) + body)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
            if b'"text": "a"' in out:
                worker.client_saw_event.set()
    assert out.startswith(b"HTTP/1.0 200 ") and out.count(b"HTTP/1.") == 1, out
    assert b'data: {"choices": [{"text": "a"}]}' in out and b"[DONE]" not in out and b"502" not in out
    record = router.stats()["requests"][0]
    assert record["served"] is None and router.workers[0].in_flight == 0
    assert any("broke off" in r.getMessage() for r in caplog.records)
