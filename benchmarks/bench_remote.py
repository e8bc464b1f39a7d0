"""The shared remote tier (Redis / Valkey): time to first token of a long prompt on a second engine
process that finds it on the server, against recompute and a CPU-tier hit on the first; and our
remote read path (pipelined GETs + verification into a slot) against pipelined raw GETs of the
same values with redis-py.

Starts its own redis-server (loopback port, no persistence). Medians of --reps prompts.

    python benchmarks/bench_remote.py [--model llama-big] [--tokens 1856] [--reps 5]
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


def miss_phase(args) -> dict:
    """Recompute TTFT of prompts nobody stored: without a connector ("off"), with the remote tier
    configured and every lookup a miss ("miss"), and with the server down ("down")."""
    import random

    from bench_ttft import ttft

    rng = random.Random({"off": 11, "miss": 12, "down": 13}[args.phase])
    url = {"off": None, "miss": args.url, "down": "redis://127.0.0.1:9/0"}[args.phase]
    llm = engine(args.model, url, connector=args.phase != "off")
    times = []
    for i in range(args.reps + 1):
        t, cached, _ = ttft(llm, [rng.randrange(10, 2000) for _ in range(args.tokens)])
        assert cached == 0
        if i:
            times.append(t)
        time.sleep(0.5)  # the writes behind of the miss finish (they would compete for the 2 cores)
    llm.llm_engine.engine_core.shutdown()
    return {args.phase: times}


def phase(args) -> dict:
    from bench_ttft import ttft
    from timing import prompts

    llm = engine(args.model, args.url)
    res = {"recompute": [], "cpu": [], "remote": [], "cached": 0, "tokens": []}
    for i, p in enumerate(prompts(args.tokens, args.reps)):
        if args.phase == "store":
            t_re, _, tok = ttft(llm, p)
            llm.reset_prefix_cache()
            time.sleep(0.5)  # the writes behind finish (they would compete for the 2 cores)
            t_cpu, cached, tok2 = ttft(llm, p)
            assert tok == tok2, "a CPU-tier hit changed the output"
            llm.reset_prefix_cache()
            if i:
                res["recompute"].append(t_re)
                res["cpu"].append(t_cpu)
        else:
            t, cached, tok = ttft(llm, p)
            if i:
                res["remote"].append(t)
                res["cached"] = cached
        res["tokens"].append(tok)
    time.sleep(1)
    llm.llm_engine.engine_core.shutdown()
    return res


def read_throughput(url: str, reps: int = 5) -> tuple[float, float, int]:
    """(our GiB/s, raw GiB/s, values): every value on the server, in pipelined batches of 64."""
    import numpy as np
    import redis

    from vllm_kvbm_plugin.tiers import disk as diskfmt
    from vllm_kvbm_plugin.tiers import remote as remotefmt
    from timing import best

    c = redis.Redis.from_url(url)
    names = sorted(c.keys("kvbm:*"))
    first = c.get(names[0])
    plen = int.from_bytes(first[40:48], "little")
    fp = first[24:40]
    keys = [diskfmt.parse_key_hex(n.decode().rsplit(":", 1)[1] + ".kvb") for n in names]
    out = np.empty(plen, dtype=np.uint8)
    total = sum(len(v) for v in c.mget(names))

    def raw():
        for a in range(0, len(names), 64):
            pipe = c.pipeline(transaction=False)
            for n in names[a:a + 64]:
                pipe.get(n)
            pipe.execute()

    def ours():
        for a in range(0, len(names), 64):
            pipe = c.pipeline(transaction=False)
            for n in names[a:a + 64]:
                pipe.get(n)
            for k, v in zip(keys[a:a + 64], pipe.execute()):
                assert remotefmt.read_value(v, k, fp, out)

    ours()  # numba compiles
    t_raw, t_ours = best(reps, raw), best(reps, ours)
    return total / t_ours / 2**30, total / t_raw / 2**30, len(names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-big")
    ap.add_argument("--tokens", type=int, default=1856)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phase", choices=["store", "remote", "off", "miss", "down"])
    ap.add_argument("--url")
    ap.add_argument("--out")
    ap.add_argument("--no-miss", action="store_true", help="skip the miss / server-down overhead runs")
    args = ap.parse_args()
    if args.phase:
        json.dump(phase(args) if args.phase in ("store", "remote") else miss_phase(args), open(args.out, "w"))
        os._exit(0)
    from vllm_kvbm_plugin.testing.redis_server import RedisServer

    server = RedisServer(maxmemory="2gb").start()
    try:
        res = {}
        with tempfile.TemporaryDirectory() as d:
            for name in ("store", "remote") + (() if args.no_miss else ("off", "miss", "down")):
                f = os.path.join(d, name + ".json")
                subprocess.run([sys.executable, __file__, "--phase", name, "--url", server.url, "--out", f,
                                "--tokens", str(args.tokens), "--reps", str(args.reps), "--model", args.model],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                res[name] = json.load(open(f))
        ours, raw, n = read_throughput(server.url)
    finally:
        server.stop()
    med = {k: statistics.median(res[p][k]) for p, k in (("store", "recompute"), ("store", "cpu"), ("remote", "remote"))}
    same = res["store"]["tokens"] == res["remote"]["tokens"]
    print(f"{args.tokens}-token prompts, {args.model} (random weights), medians of {args.reps}:")
    print(f"  recompute                    {med['recompute'] * 1e3:8.1f} ms")
    print(f"  CPU-tier hit (same process)  {med['cpu'] * 1e3:8.1f} ms  -> {med['recompute'] / med['cpu']:.1f}x")
    print(f"  remote hit (second process)  {med['remote'] * 1e3:8.1f} ms  -> {med['recompute'] / med['remote']:.1f}x "
          f"vs recompute, {med['remote'] / med['cpu']:.2f}x of a CPU hit ({res['remote']['cached']} tokens)")
    print(f"  outputs identical (recompute, CPU hit, remote hit in another process): {same}")
    if not args.no_miss:
        off = statistics.median(res["off"]["off"])
        for name, what in (("miss", "every lookup a miss"), ("down", "server down")):
            m = statistics.median(res[name][name])
            print(f"  remote tier configured, {what:20s} {m * 1e3:8.1f} ms  -> {m / off:.3f}x of no connector "
                  f"({off * 1e3:.1f} ms)")
    print(f"  remote reads of {n} values: ours (GET + verify into a slot) {ours:.2f} GiB/s, "
          f"raw pipelined GETs {raw:.2f} GiB/s -> {ours / raw:.2f}")


if __name__ == "__main__":
    main()
