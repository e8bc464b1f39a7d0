"""The shared remote tier (Redis / Valkey): time to first token of a long prompt on a second engine
process that finds it on the server, against recompute and a CPU-tier hit on the first; and our
remote read path (pipelined GETs + verification into a slot) against pipelined raw GETs of the
same values with redis-py.

Also the cost of the tier when it cannot help: TTFT of prompts nobody stored with the tier
configured (every lookup a miss) and with the server down, against no connector.

Starts its own redis-server (loopback port, no persistence). Every configuration runs in its own
engine processes, --rounds times, taking turns (a noisy minute of the shared machine hits all
of them); medians and best of all measured prompts; the issue's targets are printed with them.
The block MAC's share of a remote hit's TTFT: the MAC of the hit's values, timed in this run,
against the remote hit's median TTFT, with format 2's checksum it replaced on the same bytes.

    python benchmarks/bench_remote.py [--model llama-big] [--tokens 1856] [--reps 5] [--rounds 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def engine(model: str, url: str | None, connector: bool = True):
    from vllm import LLM

    from vllm_kvbm_plugin.testing import tiny_models

    extra = {"cpu_bytes_to_use": 1 << 30}
    if url:
        extra["remote_url"] = url
    ktc = {"kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": extra} if connector else None
    return LLM(model=str(tiny_models.build(model)), dtype="bfloat16", max_model_len=2048,
               enforce_eager=True, block_size=32, enable_prefix_caching=True, seed=0, max_num_seqs=1,
               kv_transfer_config=ktc)


class ConnectorClock:
    """Time spent inside KVBMConnector's calls (scheduler and worker side, in this in-process
    engine), and when a request was first given KV from a tier (update_state_after_alloc with
    external tokens): where a TTFT goes, measured from inside the engine."""

    def __init__(self, llm):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.seconds, self.loaded_at = 0.0, None
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        for obj in (sched, get_kv_transfer_group()):
            for name in dir(type(obj)):
                if not name.startswith("_") and callable(getattr(type(obj), name, None)) \
                        and name in vars(type(obj)) and name not in ("build_kv_connector_stats", "build_prom_metrics"):
                    self._wrap(obj, name)

    def _wrap(self, obj, name: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                t1 = time.perf_counter()
                self.seconds += t1 - t0
                if name == "update_state_after_alloc" and a[-1] > 0 and self.loaded_at is None:
                    self.loaded_at = t1
        setattr(obj, name, timed)

    def start(self) -> float:
        self.seconds, self.loaded_at = 0.0, None
        return time.perf_counter()


def miss_phase(args) -> dict:
    """Recompute TTFT of prompts nobody stored: without a connector ("off"), with the remote tier
    configured and every lookup a miss ("miss"), and with the server down ("down")."""
    import random

    from bench_ttft import ttft

    rng = random.Random(100 + args.round)  # the same prompts in the three; new to the (flushed) server
    url = {"off": None, "miss": args.url, "down": "redis://127.0.0.1:9/0"}[args.phase]
    llm = engine(args.model, url, connector=args.phase != "off")
    clock = ConnectorClock(llm) if args.phase != "off" else None
    times, inside = [], []
    for i in range(args.reps + 1):
        if clock:
            clock.start()
        t, cached, _ = ttft(llm, [rng.randrange(10, 2000) for _ in range(args.tokens)])
        assert cached == 0
        if i:
            times.append(t)
            inside.append(clock.seconds if clock else 0.0)
        time.sleep(0.5)  # the writes behind of the miss finish (they would compete for the 2 cores)
    llm.llm_engine.engine_core.shutdown()
    return {args.phase: times, "inside": inside}


def phase(args) -> dict:
    from bench_ttft import ttft
    from timing import prompts

    llm = engine(args.model, args.url)
    clock = ConnectorClock(llm)
    res = {"recompute": [], "cpu": [], "remote": [], "cached": 0, "tokens": [], "until_loaded": []}
    for i, p in enumerate(prompts(args.tokens, args.reps)):
        if args.phase == "store":
            t_re, _, tok = ttft(llm, p)
            llm.reset_prefix_cache()
            time.sleep(0.5)  # the writes behind finish (they would compete for the 2 cores)
            t0 = clock.start()
            t_cpu, cached, tok2 = ttft(llm, p)
            assert tok == tok2, "a CPU-tier hit changed the output"
            llm.reset_prefix_cache()
            if i:
                res["recompute"].append(t_re)
                res["cpu"].append(t_cpu)
                if clock.loaded_at:
                    res["until_loaded"].append(clock.loaded_at - t0)
        else:
            t0 = clock.start()
            t, cached, tok = ttft(llm, p)
            if i:
                res["remote"].append(t)
                res["cached"] = cached
                if clock.loaded_at:
                    res["until_loaded"].append(clock.loaded_at - t0)
        res["tokens"].append(tok)
    time.sleep(1)
    llm.llm_engine.engine_core.shutdown()
    return res


def read_throughput(url: str, reps: int = 7) -> tuple[list, list, int, float, float]:
    """(our GiB/s per rep, raw GiB/s per rep, values, MAC and checksum seconds per payload byte):
    every value on the server in pipelined batches of 64, ours (the workers' DirectClient: GETs
    read and verified straight into slot buffers) and raw redis-py GETs taking turns."""
    import numpy as np
    import redis

    from mac_cost import mac_and_checksum_seconds
    from vllm_kvbm_plugin.tiers import block_dir, remote_value, resp
    from vllm_kvbm_plugin.tiers import secret as tiersecret
    from vllm_kvbm_plugin.tiers.mac import mac_key

    c = redis.Redis.from_url(url)
    names = sorted(c.keys("kvbm:*"))
    first = c.get(names[0])
    plen = int.from_bytes(first[40:48], "little")
    fp = first[24:40]
    keys = [block_dir.parse_key_hex(n.decode().rsplit(":", 1)[1] + ".kvb") for n in names]
    mk = mac_key(tiersecret.parse(c.get(tiersecret.REMOTE_NAME).decode(), tiersecret.REMOTE_NAME))
    total = sum(len(v) for v in c.mget(names))

    def raw():
        for a in range(0, len(names), 64):
            pipe = c.pipeline(transaction=False)
            for n in names[a:a + 64]:
                pipe.get(n)
            pipe.execute()

    reader = resp.DirectClient(url)  # the workers' read path
    outs = [np.empty(plen, dtype=np.uint8) for _ in range(64)]

    def ours():
        for a in range(0, len(names), 64):
            got = reader.fetch(names[a:a + 64], keys[a:a + 64], fp, mk, outs)
            assert got == [remote_value.OK] * len(got)

    ours()  # numba compiles
    rates = {"ours": [], "raw": []}
    for _ in range(reps):
        for name, fn in (("raw", raw), ("ours", ours)):
            t0 = time.perf_counter()
            fn()
            rates[name].append(total / (time.perf_counter() - t0) / 2**30)
    t_mac, t_sum = mac_and_checksum_seconds(outs, mk)
    per = 1 / (len(outs) * plen)
    return rates["ours"], rates["raw"], len(names), t_mac * per, t_sum * per, plen


def run_phase(name: str, args, d: str, r: int) -> dict:
    f = os.path.join(d, f"{name}{r}.json")
    subprocess.run([sys.executable, __file__, "--phase", name, "--url", args.url, "--out", f,
                    "--tokens", str(args.tokens), "--reps", str(args.reps), "--model", args.model,
                    "--round", str(r)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(f))


def spread(xs: list) -> str:
    """median (best .. worst) in ms"""
    return f"{statistics.median(xs) * 1e3:7.1f} ms (best {min(xs) * 1e3:.1f}, worst {max(xs) * 1e3:.1f})"


def target(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-big")
    ap.add_argument("--tokens", type=int, default=1856)
    ap.add_argument("--reps", type=int, default=5, help="measured prompts per engine process")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of engine processes taking turns")
    ap.add_argument("--phase", choices=["store", "remote", "off", "miss", "down"])
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--url")
    ap.add_argument("--out")
    ap.add_argument("--no-miss", action="store_true", help="skip the miss / server-down overhead runs")
    args = ap.parse_args()
    if args.phase:
        json.dump(phase(args) if args.phase in ("store", "remote") else miss_phase(args), open(args.out, "w"))
        os._exit(0)
    from vllm_kvbm_plugin.testing.redis_server import RedisServer

    server = RedisServer(maxmemory="2gb").start()
    args.url = server.url
    overhead = [] if args.no_miss else ["off", "miss", "down"]
    res: dict = {k: [] for k in ("recompute", "cpu", "remote", "off", "miss", "down", "cpu_until", "remote_until",
                                 "miss_inside", "down_inside")}
    same, cached = True, set()
    try:
        with tempfile.TemporaryDirectory() as d:
            for r in range(args.rounds):
                server.client().flushall()  # each round's first process stores everything again
                store, remote = run_phase("store", args, d, r), run_phase("remote", args, d, r)
                res["recompute"] += store["recompute"]
                res["cpu"] += store["cpu"]
                res["remote"] += remote["remote"]
                res["cpu_until"] += store["until_loaded"]
                res["remote_until"] += remote["until_loaded"]
                cached.add(remote["cached"])
                same &= store["tokens"] == remote["tokens"]
                for name in overhead[r % 3:] + overhead[:r % 3]:  # the overhead runs take turns
                    out = run_phase(name, args, d, r)
                    res[name] += out[name]
                    if name != "off":
                        res[name + "_inside"] += out["inside"]
        ours, raw, n, mac_s, sum_s, plen = read_throughput(server.url)
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in res.items() if v}
    best = {k: min(v) for k, v in res.items() if v}
    print("load average (1, 5, 15 min) at the end: %.2f %.2f %.2f on %d cores (other work on the machine "
          "slows the forward passes, and the ratios with them)" % (*os.getloadavg(), os.cpu_count()))
    print(f"{args.tokens}-token prompts, {args.model} (random weights), {args.rounds} rounds x {args.reps} prompts "
          f"per engine process; TTFT median (best, worst):")
    print(f"  recompute                    {spread(res['recompute'])}")
    print(f"  CPU-tier hit (same process)  {spread(res['cpu'])}")
    print(f"    of which until its KV was ready in CPU slots (lookups, promotion)   {spread(res['cpu_until'])}")
    print(f"  remote hit (second process)  {spread(res['remote'])}, cached tokens {sorted(cached)}")
    print(f"    of which until its KV was ready in CPU slots (lookups, remote reads) {spread(res['remote_until'])}")
    print(f"  outputs identical (recompute, CPU hit, remote hit in another process): {same}")
    vs_re = (med["recompute"] / med["remote"], best["recompute"] / best["remote"])
    vs_cpu = (med["remote"] / med["cpu"], best["remote"] / best["cpu"])
    print(f"  remote hit vs recompute   {vs_re[0]:5.1f}x median, {vs_re[1]:5.1f}x best  "
          f"(target >= 8x: {target(vs_re[0] >= 8)})")
    print(f"  remote hit / CPU-tier hit {vs_cpu[0]:5.2f}x median, {vs_cpu[1]:5.2f}x best  "
          f"(target <= 1.5x: {target(vs_cpu[0] <= 1.5)})")
    if overhead:
        print(f"  no connector                 {spread(res['off'])}")
        for name, what in (("miss", "tier configured, every lookup a miss"), ("down", "tier configured, server down")):
            m, b = med[name] / med["off"], best[name] / best["off"]
            print(f"  {what:37s} {spread(res[name])} -> {m:.3f}x median, {b:.3f}x best of no connector "
                  f"(target <= 1.05x: {target(m <= 1.05)})")
            share = statistics.median(i / t for i, t in zip(res[name + "_inside"], res[name]))
            print(f"    of which inside the connector's calls {spread(res[name + '_inside'])}: {share:.2%} of a TTFT")
    o, w = statistics.median(ours), statistics.median(raw)
    print(f"  remote reads of {n} values, {len(ours)} turns each: ours (GETs read and verified into slot buffers) {o:.2f} GiB/s "
          f"(best {max(ours):.2f}), raw pipelined GETs {w:.2f} GiB/s (best {max(raw):.2f}) -> {o / w:.2f} median, "
          f"{max(ours) / max(raw):.2f} best (target >= 0.8: {target(o / w >= 0.8)})")
    hit = max(cached) // 32 * plen  # the payload bytes of a remote hit (one rank)
    mac, was = hit * mac_s, hit * sum_s
    print(f"  block MAC of a remote hit ({hit / 2**20:.1f} MiB): {mac * 1e3:.2f} ms = {mac / med['remote']:.2%} of its "
          f"median TTFT (target <= 5%: {target(mac / med['remote'] <= 0.05)}); format 2's checksum of the same bytes "
          f"{was * 1e3:.2f} ms, so the MAC adds {(mac - was) / med['remote']:.2%}")


if __name__ == "__main__":
    main()
