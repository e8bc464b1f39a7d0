"""TTFT of a repeated long prompt after vLLM's prefix cache is reset: KVBMConnector's CPU tier
against LMCache 0.5.6 (multi-process mode: `lmcache server` + vLLM's LMCacheMPConnector over
shared memory), same model, prompts and chunk = block size, alternating contenders, same run.
Target: our CPU-tier hit at most a third of LMCache's.

    ./benchmarks/lmcache_venv.sh          # once: a separate venv with lmcache (never a project dep)
    benchmarks/.venv-lmcache/bin/python benchmarks/bench_vs_lmcache.py [--rounds 2] [--reps 5]
"""

import argparse
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


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def contender_run(name: str, port: int, tokens: int, reps: int, seed: int) -> dict:
    """One engine process: per prompt, a cold run, a prefix-cache reset, and the measured hit."""
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
    else:
        kvt = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                             "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    llm = LLM(model=str(tiny_models.build("llama-big")), dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, block_size=BLOCK, enable_prefix_caching=True, seed=0, max_num_seqs=1,
              kv_transfer_config=kvt)
    sp = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(seed)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1856)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=3)  # name port out
    args = ap.parse_args()
    if args.child:
        name, port, out = args.child
        json.dump(contender_run(name, int(port), args.tokens, args.reps, seed=1), open(out, "w"))
        os._exit(0)
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
