"""`vllm-kvbm route`'s decision latency under sustained load, and its memory over many requests.

Four stand-in workers (one child process; vLLM's own ZmqEventPublisher each, on ipc sockets)
publish KV events at a steady rate (a decode block stored and an old one evicted per batch), and
for each request routed to them publish its prompt's blocks and answer after a service time. This
process runs the router's real subscriber threads, index and decision path (`Router.choose`,
`sent`, `done`, as its HTTP handler calls them) on a steady stream of shared-prefix prompts.

Prints p50/p99 of the decision latency under load, split into the wait for the answering workers'
streams to catch up with their answers (`Decision.waited_s`: the workers' own wait) and the rest
(the router's), and of a no-event baseline measured in the same run (same prompts, warm index, no
stream publishing, no answer pending). Target: p99 beyond the workers' wait <= 5 ms. Then memory
over `--requests` routed back to back (answers not waited for), at 10%, 50% and 100% of them: RSS
in one pass, Python's traced memory (tracemalloc) in another. Target: flat from 10% on.

    python benchmarks/bench_router.py [--rate 50] [--seconds 20] [--event-rate 100] [--requests 100000]
"""

import argparse
import ctypes
import gc
import json
import multiprocessing
import os
import random
import tempfile
import threading
import time
import tracemalloc

import numpy as np

from timing import shared_prefix_workload

from vllm_kvbm_plugin.events.index import WorkerConfig
from vllm_kvbm_plugin.router import Router, Worker

WORKERS, UNIT = 4, 16
DECODE_KEPT, PROMPTS_KEPT = 2000, 200  # per stand-in worker: blocks held before the oldest is evicted


def workload(n: int) -> list[list[int]]:
    return shared_prefix_workload(n, systems=20, system_len=(256, 1024), body_len=(32, 512), max_len=2048)


def stand_ins(work_dir: str, n_prompts: int, event_rate: float, conn) -> None:
    """The workers (child process): steady decode events; a request's prompt blocks, then its answer."""
    import heapq

    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher

    prompts, hasher = workload(n_prompts), PromptHasher()
    hashes: dict[int, list] = {}
    pubs = [ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{work_dir}/ev{i}",
                              replay_endpoint=f"ipc://{work_dir}/rp{i}", topic="kv") for i in range(WORKERS)]
    decode = [[] for _ in range(WORKERS)]
    held = [[] for _ in range(WORKERS)]  # prompt blocks, per request, oldest first
    timers = [(time.monotonic() + i / event_rate / WORKERS, i, "step", None) for i in range(WORKERS)]
    steady, serial = False, 0

    def publish(i, runs, removed):
        events = [BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=tokens, block_size=UNIT,
                              lora_id=None, medium="GPU", lora_name=None) for hs, tokens in runs]
        if removed:
            events.append(BlockRemoved(block_hashes=removed, medium="GPU"))
        pubs[i].publish(KVEventBatch(ts=time.time(), events=events))

    conn.send_bytes(b"ready")
    while True:
        wait = max(0.0, timers[0][0] - time.monotonic()) if timers else 0.1
        if conn.poll(wait):
            msg = json.loads(conn.recv_bytes())
            if msg[0] == "stop":
                break
            if msg[0] == "steady":
                steady = msg[1]
                continue
            _, req, i, k, service_s = msg
            heapq.heappush(timers, (time.monotonic() + service_s, i, "answer", (req, k)))
            continue
        if not timers or timers[0][0] > time.monotonic():
            continue
        due, i, what, arg = heapq.heappop(timers)
        if what == "step":
            heapq.heappush(timers, (due + 1 / event_rate, i, "step", None))
            if steady:
                serial += 1
                decode[i].append(serial)
                publish(i, [([serial], [serial % 50000] * UNIT)], decode[i][:-DECODE_KEPT])
                del decode[i][:-DECODE_KEPT]
        else:
            req, k = arg
            hs = hashes.get(k)
            if hs is None:
                hs = hashes[k] = hasher.event_hashes(prompts[k], UNIT)
            held[i].append(hs)
            evicted = [h for old in held[i][:-PROMPTS_KEPT] for h in old]
            del held[i][:-PROMPTS_KEPT]
            publish(i, [(hs, prompts[k][:len(hs) * UNIT])] if hs else [], evicted)
            conn.send_bytes(json.dumps([req]).encode())  # the answer, after the events (as vLLM's step)
    for p in pubs:
        p.shutdown()


class Fleet:
    """The router and its stand-in workers; `route` sends one request and returns its latency."""

    def __init__(self, work_dir: str, n_prompts: int, event_rate: float):
        self.prompts = workload(n_prompts)
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=stand_ins, args=(work_dir, n_prompts, event_rate, child), daemon=True)
        self.proc.start()
        assert self.conn.recv_bytes() == b"ready"
        workers = [Worker.parse(f"http://127.0.0.1:{9000 + i},ipc://{work_dir}/ev{i},ipc://{work_dir}/rp{i}")
                   for i in range(WORKERS)]
        self.router = Router(workers, topic="kv", config=WorkerConfig(hash_block_size=UNIT), silence_s=0)
        self.pending: dict[int, tuple] = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.serial = 0
        self.router.start()
        threading.Thread(target=self._answers, daemon=True).start()

    def send(self, msg) -> None:
        with self.send_lock:
            self.conn.send_bytes(json.dumps(msg).encode())

    def _answers(self) -> None:
        while True:
            try:
                (req,) = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return
            with self.lock:
                i, record, sent = self.pending.pop(req)
            self.router.done(i, record, sent=sent)

    def route(self, k: int, service_s: float | None, read_your_writes: bool = True) -> tuple[float, float]:
        """(decision latency, its wait for streams to catch up), in seconds. `service_s` None: the
        request is answered at once, with no events (the baseline)."""
        prompt = self.prompts[k % len(self.prompts)]
        t0 = time.perf_counter()
        d = self.router.choose(prompt)
        took = time.perf_counter() - t0
        sent = self.router.sent(d.worker) if read_your_writes else None
        record = {"worker": d.worker, "policy": "kv", "prompt_tokens": len(prompt), "predicted": d.scores[d.worker],
                  "served": d.scores[d.worker], "scores": d.scores, "waited_ms": round(d.waited_s * 1000, 1)}
        if service_s is None:
            self.router.done(d.worker, record)
            return took, d.waited_s
        with self.lock:
            self.serial += 1
            req = self.serial
            self.pending[req] = (d.worker, record, sent)
        self.send(["request", req, d.worker, k % len(self.prompts), service_s])
        return took, d.waited_s

    def steady(self, rate: float, seconds: float, service_s: float | None) -> np.ndarray:
        """Route `rate` requests/s for `seconds`, each answered after 0.5-1.5x `service_s`: rows
        (latency, wait)."""
        out, start, rng = [], time.perf_counter(), random.Random(1)
        for n in range(int(rate * seconds)):
            time.sleep(max(0.0, start + n / rate - time.perf_counter()))
            out.append(self.route(n, None if service_s is None else service_s * rng.uniform(0.5, 1.5)))
        return np.array(out)

    def settle(self) -> None:
        """Until every answer is in and the streams are caught up with them."""
        while self.pending:
            time.sleep(0.01)
        self.router.scores([1, 2])

    def drain(self, quiet_s: float = 0.3) -> None:
        """Until every answer is in and no stream delivered anything for `quiet_s`."""
        self.settle()
        batches = None
        while batches != (batches := [s["batches"] for s in self.router.stats()["streams"]]):
            time.sleep(quiet_s)

    def close(self) -> None:
        self.send(["stop"])
        self.proc.join(timeout=10)
        self.router.stop()


def rss_bytes(trim: bool = False) -> int | None:
    """The process's resident memory; with `trim`, after glibc gave its free heap back (None
    without glibc): what is left is held, not kept for reuse by the allocator."""
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            return None
    with open("/proc/self/statm") as fp:
        return int(fp.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(a, q) -> float:
    return float(np.percentile(a, q)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=50.0, help="requests per second (all workers)")
    ap.add_argument("--seconds", type=float, default=20.0, help="per measured phase")
    ap.add_argument("--event-rate", type=float, default=100.0, help="KV event batches per second per worker")
    ap.add_argument("--service", type=float, default=0.1, help="seconds a stand-in worker takes to answer")
    ap.add_argument("--requests", type=int, default=100_000, help="routed back to back for the memory figures")
    ap.add_argument("--prompts", type=int, default=4000, help="distinct prompts in the workload")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-router-") as work_dir:
        fleet = Fleet(work_dir, args.prompts, args.event_rate)
        try:
            run(fleet, args)
        finally:
            fleet.close()


def run(fleet: Fleet, args) -> None:
    print(f"{WORKERS} stand-in workers (vLLM's ZmqEventPublisher, ipc), {args.event_rate:.0f} batches/s each "
          f"when busy, answers after {args.service * 1e3:.0f} ms +-50%; {args.rate:.0f} requests/s for "
          f"{args.seconds:.0f} s per phase; prompts 32-2048 tokens, 60% on 20 shared system prompts")
    fleet.send(["steady", True])
    fleet.steady(args.rate, min(5.0, args.seconds), args.service)  # warm: the index fills, the hashes are cached
    fleet.send(["steady", False])
    fleet.settle()
    base = fleet.steady(args.rate, args.seconds, None)
    fleet.settle()
    fleet.send(["steady", True])
    load = fleet.steady(args.rate, args.seconds, args.service)
    fleet.settle()
    beyond = load[:, 0] - load[:, 1]
    print(f"no-event baseline:  p50 {pct(base[:, 0], 50):6.2f} ms  p99 {pct(base[:, 0], 99):6.2f} ms "
          f"({len(base)} decisions)")
    print(f"under load:         p50 {pct(load[:, 0], 50):6.2f} ms  p99 {pct(load[:, 0], 99):6.2f} ms "
          f"({len(load)} decisions, {np.mean(load[:, 1] > 0) * 100:.0f}% waited for a stream)")
    print(f"  workers' own wait p50 {pct(load[:, 1], 50):6.2f} ms  p99 {pct(load[:, 1], 99):6.2f} ms")
    print(f"  beyond that wait  p50 {pct(beyond, 50):6.2f} ms  p99 {pct(beyond, 99):6.2f} ms "
          f"(target p99 <= 5 ms: {'met' if pct(beyond, 99) <= 5 else 'MISSED'})")
    print(f"ratio under load / baseline: p50 {pct(load[:, 0], 50) / pct(base[:, 0], 50):.2f}x, "
          f"p99 {pct(load[:, 0], 99) / pct(base[:, 0], 99):.2f}x; beyond the wait p99 "
          f"{pct(beyond, 99) / pct(base[:, 0], 99):.2f}x; late decisions {fleet.router.late}")
    stats = fleet.router.stats()
    print(f"streams: {[s['batches'] for s in stats['streams']]} batches; "
          f"index holds {fleet.router.index.n_held():,} hashes")

    for traced in (False, True):  # RSS without tracemalloc (its own tables grow RSS), then traced Python memory
        memory(fleet, args.requests, traced)


def memory(fleet: Fleet, requests: int, traced: bool) -> None:
    """Route `requests` back to back (answers not waited for); the router's memory at 10%, 50%, 100%."""
    if traced:
        tracemalloc.start()
    marks, t0 = {}, time.perf_counter()
    at = (requests // 10, requests // 2, requests)
    for n in range(1, requests + 1):
        fleet.route(n, 0.0, read_your_writes=False)
        if n in at:
            fleet.send(["steady", False])
            fleet.drain()
            gc.collect()  # live memory, not garbage awaiting the cycle collector
            marks[n] = (tracemalloc.get_traced_memory()[0] if traced else rss_bytes(),
                        len(json.dumps(fleet.router.stats())), fleet.router.index.n_held(),
                        None if traced else rss_bytes(trim=True))
            fleet.send(["steady", True])
    took = time.perf_counter() - t0
    tracemalloc.stop()
    what = "traced (tracemalloc)" if traced else "RSS"
    print(f"memory, {what}, over {requests:,} routed requests ({requests / took:.0f}/s back to back; measured with "
          f"every answer in, the streams drained, after gc.collect()):")
    for n, (size, stats_len, held, trimmed) in marks.items():
        print(f"  at {n:>7,}: {what} {size / 2 ** 20:7.2f} MiB" + (
              f" ({trimmed / 2 ** 20:.2f} MiB once malloc_trim returned free heap)" if trimmed else "")
              + f", /router/stats {stats_len / 1024:6.1f} KiB, index {held:,} hashes")
    (n1, m1), _, (n2, m2) = marks.items()
    print(f"  growth {n1:,} -> {n2:,}: {(m2[0] - m1[0]) / 2 ** 20:+.2f} MiB ({m2[0] / m1[0]:.3f}x)" + (
          f"; after malloc_trim {(m2[3] - m1[3]) / 2 ** 20:+.2f} MiB ({m2[3] / m1[3]:.3f}x)" if m1[3] else ""))

if __name__ == "__main__":
    main()
