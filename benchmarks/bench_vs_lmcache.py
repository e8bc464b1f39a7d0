"""TTFT of a repeated long prompt after vLLM's prefix cache is reset: KVBMConnector's CPU tier
against LMCache 0.5.6 (multi-process mode: `lmcache server` + vLLM's LMCacheMPConnector over
shared memory), same model, prompts and chunk = block size, alternating contenders, same run.
Target: our CPU-tier hit at most a third of LMCache's.

--remote: the shared remote tier on one redis-server. One engine process stores the prompts,
a second one (new CPU tier; for LMCache a new `lmcache server`, so its L1 is empty) finds them on
the server: our remote tier against LMCache's RESP L2 adapter (`--l2-adapter '{"type": "resp"}'`,
its C++ Redis client) in multi-process mode. Target: our remote hit at most half of LMCache's.

    ./benchmarks/lmcache_venv.sh          # once: a separate venv with lmcache (never a project dep)
    benchmarks/.venv-lmcache/bin/python benchmarks/bench_vs_lmcache.py [--rounds 2] [--reps 5] [--remote]
"""

import argparse
import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
BLOCK = 32
LOGS = tempfile.gettempdir()
SHM = "/dev/shm/lmcache_kv_*"  # LMCache's lmcache_driven mode moves vLLM's KV cache there; nobody unlinks it


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def contender_run(name: str, port: int, tokens: int, reps: int, seed: int, redis_url: str = "",
                  mode: str = "") -> dict:
    """One engine process: per prompt, a cold run, a prefix-cache reset, and the measured hit.
    With `mode` (remote): "store" runs each prompt once, "hit" times each prompt's run (a second
    process: the remote tier's hit)."""
    import random

    import vllm.triton_utils.dispatcher as dispatcher

    def safe_vars(obj):  # vLLM bug with LMCache's import of llvmlite in-process (see notes)
        d = getattr(obj, "__dict__", None)
        return d if isinstance(d, dict) else {}

    dispatcher.vars = safe_vars
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_kvbm_plugin.testing import tiny_models

    if name == "kvbm":
        kvt = {"kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
               "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
        if redis_url:
            kvt["kv_connector_extra_config"]["remote_url"] = redis_url
    else:
        kvt = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                             "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    llm = LLM(model=str(tiny_models.build("llama-big")), dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, block_size=BLOCK, enable_prefix_caching=True, seed=0, max_num_seqs=1,
              kv_transfer_config=kvt)
    sp = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(seed)
    if mode:
        return _remote_run(llm, sp, [[rng.randrange(10, 2000) for _ in range(tokens)] for _ in range(reps + 1)], mode)
    out = {"hit": [], "cold": [], "cached": [], "tokens": []}
    for i in range(reps + 1):  # the first prompt warms up
        p = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 2000) for _ in range(tokens)])]
        t0 = time.perf_counter()
        a = llm.generate(p, sp, use_tqdm=False)[0]
        t_cold = time.perf_counter() - t0
        while not llm.reset_prefix_cache():  # LMCache delays freeing until its save is reported
            llm.llm_engine.step()
        t0 = time.perf_counter()
        b = llm.generate(p, sp, use_tqdm=False)[0]
        t_hit = time.perf_counter() - t0
        while not llm.reset_prefix_cache():
            llm.llm_engine.step()
        if i:
            out["cold"].append(t_cold)
            out["hit"].append(t_hit)
            out["cached"].append(b.num_cached_tokens)
            out["tokens"].append([list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)])
    return out


def _remote_run(llm, sp, prompts: list, mode: str) -> dict:
    from vllm.inputs import TokensPrompt

    out = {"hit": [], "cached": [], "tokens": []}
    for i, p in enumerate(prompts):  # the first prompt warms up
        t0 = time.perf_counter()
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        t = time.perf_counter() - t0
        while not llm.reset_prefix_cache():  # LMCache delays freeing until its save is reported
            llm.llm_engine.step()
        out["tokens"].append(list(o.outputs[0].token_ids))
        if i and mode == "hit":
            out["hit"].append(t)
            out["cached"].append(o.num_cached_tokens)
        time.sleep(0.5)  # writes behind finish (they would compete for the 2 cores)
    return out


def lmcache_server(bindir: str, port: int, redis_port: int = 0) -> subprocess.Popen:
    l2 = ["--l2-adapter", json.dumps({"type": "resp", "host": "127.0.0.1", "port": redis_port})] if redis_port else []
    server = subprocess.Popen(
        [os.path.join(bindir, "lmcache"), "server", "--host", "localhost", "--port", str(port),
         "--chunk-size", str(BLOCK), "--l1-size-gb", "2", "--eviction-policy", "LRU",
         "--supported-transfer-mode", "auto", "--http-port", str(free_port()), "--disable-observability", *l2],
        stdout=open(os.path.join(LOGS, f"lmcache-server-{port}.log"), "w"), stderr=subprocess.STDOUT,
        start_new_session=True, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    time.sleep(8)
    if server.poll() is not None:
        raise RuntimeError(f"lmcache server exited ({server.returncode}); see {LOGS}")
    return server


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, 15)
    server.wait(timeout=30)


def settle(client, timeout: float = 30) -> int:
    """Wait until the server's key count stops growing (writes behind done); the count."""
    n, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = client.dbsize()
        if m == n:
            return m
        n = m
        time.sleep(1)
    return n


def remote_main(args) -> None:
    from vllm_kvbm_plugin.testing.redis_server import RedisServer

    bindir = os.path.dirname(sys.executable)
    redis = RedisServer(maxmemory="4gb").start()
    results: dict = {"kvbm": [], "lmcache": []}
    stored: dict = {"kvbm": [], "lmcache": []}

    def child(name, mode, port, out, env):
        log = open(os.path.join(LOGS, os.path.basename(out) + ".log"), "w")
        before = set(glob.glob(SHM))
        try:
            subprocess.run([sys.executable, __file__, "--child", name, str(port), out, "--tokens", str(args.tokens),
                            "--reps", str(args.reps), "--redis", redis.url, "--mode", mode],
                           check=True, stdout=log, stderr=subprocess.STDOUT, timeout=900, env=env)
        finally:
            for f in set(glob.glob(SHM)) - before:  # the engine's KV cache segment outlives it
                os.unlink(f)
        return json.load(open(out))

    try:
        with tempfile.TemporaryDirectory() as d:
            for r in range(args.rounds):
                for name in (("kvbm", "lmcache") if r % 2 == 0 else ("lmcache", "kvbm")):
                    redis.client().flushall()
                    env = {**os.environ, **({"KVBM_DISABLE": "1"} if name == "lmcache" else {})}
                    port, server = free_port(), None
                    try:
                        if name == "lmcache":
                            server = lmcache_server(bindir, port, redis.port)
                        a = child(name, "store", port, os.path.join(d, f"{name}{r}-store.json"), env)
                        stored[name].append(settle(redis.client()))
                        if server is not None:  # a new server: its L1 is empty, the L2 (redis) is not
                            stop(server)
                            port = free_port()
                            server = lmcache_server(bindir, port, redis.port)
                        b = child(name, "hit", port, os.path.join(d, f"{name}{r}-hit.json"), env)
                    finally:
                        if server is not None:
                            stop(server)
                    b["same"] = a["tokens"] == b["tokens"]
                    results[name].append(b)
    finally:
        redis.stop()
    print("load average (1, 5, 15 min) at the end: %.2f %.2f %.2f on %d cores (other work on the machine "
          "slows the forward passes, and the ratios with them)" % (*os.getloadavg(), os.cpu_count()))
    print(f"{args.tokens}-token prompts, llama 8x1024, block/chunk {BLOCK}, one redis-server; a second engine "
          f"process reads what the first stored; {args.rounds} alternating rounds x {args.reps} prompts:")
    med = {}
    for name, runs in results.items():
        hits = [t for run in runs for t, c in zip(run["hit"], run["cached"]) if c > 0]
        missed = sum(1 for run in runs for c in run["cached"] if c == 0)
        cached = sorted({c for run in runs for c in run["cached"]})
        if not hits:
            print(f"  {name:8} no remote hit at all (cached tokens {cached}; values stored {stored[name]})")
            continue
        med[name] = statistics.median(hits)
        print(f"  {name:8} remote hit {med[name] * 1e3:7.1f} ms (best {min(hits) * 1e3:.1f}, worst "
              f"{max(hits) * 1e3:.1f}; {missed} prompts missed), cached tokens {cached}, values on the server "
              f"{stored[name]}, outputs identical to the storing process {all(run['same'] for run in runs)}")
    if len(med) == 2:
        ratio = med["kvbm"] / med["lmcache"]
        print(f"  KVBM remote hit / LMCache remote hit = {ratio:.2f} (target <= 0.5: {'met' if ratio <= 0.5 else 'MISSED'})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1856)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--remote", action="store_true", help="the shared remote tier on one redis-server")
    ap.add_argument("--child", nargs=3)  # name port out
    ap.add_argument("--redis", default="")
    ap.add_argument("--mode", default="")
    args = ap.parse_args()
    if args.child:
        name, port, out = args.child
        json.dump(contender_run(name, int(port), args.tokens, args.reps, seed=1, redis_url=args.redis,
                                mode=args.mode), open(out, "w"))
        os._exit(0)
    if args.remote:
        return remote_main(args)
    bindir = os.path.dirname(sys.executable)
    results = {"kvbm": [], "lmcache": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for name in ("kvbm", "lmcache"):
                port, server = free_port(), None
                if name == "lmcache":  # a fresh server per engine: it leaks the engine's SHM segment
                    server = subprocess.Popen(
                        [os.path.join(bindir, "lmcache"), "server", "--host", "localhost", "--port", str(port),
                         "--chunk-size", str(BLOCK), "--l1-size-gb", "2", "--eviction-policy", "LRU",
                         "--supported-transfer-mode", "auto", "--http-port", str(free_port()),
                         "--disable-observability"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
                    time.sleep(8)
                out = os.path.join(d, f"{name}{r}.json")
                before = set(glob.glob(SHM))
                try:
                    env = {**os.environ, **({"KVBM_DISABLE": "1"} if name == "lmcache" else {})}
                    subprocess.run([sys.executable, __file__, "--child", name, str(port), out,
                                    "--tokens", str(args.tokens), "--reps", str(args.reps)],
                                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   timeout=900, env=env)
                finally:
                    if server is not None:
                        os.killpg(server.pid, 15)
                        server.wait(timeout=30)
                    for f in set(glob.glob(SHM)) - before:  # the engine's KV cache segment outlives it
                        os.unlink(f)
                results[name].append(json.load(open(out)))
    print(f"{args.tokens}-token prompts, llama 8x1024, block/chunk {BLOCK}, {args.rounds} alternating "
          f"rounds x {args.reps} prompts:")
    med = {}
    for name, runs in results.items():
        # only repeats that really hit count (LMCache occasionally misses a just-saved prompt)
        pairs = [(t, c) for run in runs for t, c in zip(run["hit"], run["cached"])]
        hits = [t for t, c in pairs if c > 0]
        misses = sum(1 for _, c in pairs if c == 0)
        cold = [t for run in runs for t in run["cold"]]
        cached = sorted({c for run in runs for c in run["cached"]})
        same = all(a == b for run in runs for a, b in run["tokens"])
        med[name] = statistics.median(hits)
        print(f"  {name:8} recompute {statistics.median(cold) * 1e3:7.1f} ms, hit {med[name] * 1e3:7.1f} ms "
              f"(min {min(hits) * 1e3:.1f}; {misses}/{len(pairs)} repeats missed), cached tokens {cached}, "
              f"identical outputs {same}")
    print(f"  KVBM CPU-tier hit / LMCache hit = {med['kvbm'] / med['lmcache']:.2f} (target <= 0.33)")


if __name__ == "__main__":
    main()
