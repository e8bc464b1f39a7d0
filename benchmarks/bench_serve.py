"""Our tiers as a user sees them: `vllm serve` on the tiny `llama-big` (float32: bf16 on a CPU
without AVX-512 is several times slower), measured by vLLM's own client `vllm bench serve`, once per
server: no connector; KVBMConnector with CPU, CPU+disk, CPU+disk+remote (a redis-server of our own);
vLLM's OffloadingConnector + KVBMOffloadingSpec with the same tiers; LMCache 0.5.6 (multi-process
mode) where benchmarks/.venv-lmcache runs. vLLM's own KV cache is sized (`--num-gpu-blocks-override`)
to hold ~2/3 of the working set, so the tiers matter. Prints one table (req/s, TTFT p50/p90/p99,
vLLM's and the connector's hit rates, bytes moved per tier, ratios vs no connector), saves JSON and
a PNG (TTFT CDF per server, throughput bars) when matplotlib imports (here or in --plot-python).

    .venv/bin/python benchmarks/bench_serve.py                       # issue 31's workload (~1 h here)
    .venv/bin/python benchmarks/bench_serve.py --prompts 24 --prefixes 8 --prefix-len 1024 \\
        --servers none,kvbm-cpu,offload-cpu --datasets prefix_repetition

Same-run ratios only: every server runs the same seeded prompts on the same machine in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_kvbm_plugin.testing.redis_server import RedisServer  # noqa: E402
from vllm_kvbm_plugin.testing.serving import (SERVERS, VLLM, Serve, cpu_seconds, delta,  # noqa: E402
                                              kv_transfer_config, scrape, summarize)
from vllm_kvbm_plugin.testing.tiny_models import build  # noqa: E402

LMCACHE_VENV = ROOT / "benchmarks" / ".venv-lmcache"
# `vllm serve` in LMCache's venv, with bench_vs_lmcache.py's workaround for vLLM's triton dispatcher
# calling vars() on an llvmlite object that LMCache's import brings in
LMCACHE_SERVE = """
import sys
import vllm.triton_utils.dispatcher as dispatcher
dispatcher.vars = lambda obj: d if isinstance(d := getattr(obj, "__dict__", None), dict) else {}
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def kv_blocks(args) -> int:
    """vLLM's own cache: ~2/3 of the prefixes' blocks, never fewer than the running requests need."""
    per_prompt = math.ceil((args.prefix_len + args.suffix_len + args.output_len) / args.block_size)
    working = args.prefixes * math.ceil(args.prefix_len / args.block_size)
    return max(round(working * args.cache_fraction), args.max_concurrency * per_prompt + 16)


def client_args(args, dataset: str, url: str, out: pathlib.Path) -> list[str]:
    cmd = [str(VLLM), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", "model",
           "--tokenizer", args.model, "--dataset-name", dataset, "--num-prompts", str(args.prompts),
           "--seed", str(args.seed), "--max-concurrency", str(args.max_concurrency),
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
           "--temperature", "0", "--ignore-eos", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    if args.request_rate:
        cmd += ["--request-rate", str(args.request_rate)]
    if dataset == "prefix_repetition":
        cmd += ["--prefix-repetition-num-prefixes", str(args.prefixes),
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-output-len", str(args.output_len)]
    else:
        cmd += ["--random-input-len", str(args.prefix_len + args.suffix_len),
                "--random-output-len", str(args.output_len)]
    return cmd


def warm_up(url: str) -> None:
    """One short request outside the measured prompts (the first forward is slow)."""
    body = {"model": "model", "prompt": list(range(100, 140)), "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=300).close()


def lmcache_runs() -> str | None:
    """Why LMCache cannot run here, or None."""
    py = LMCACHE_VENV / "bin" / "python"
    if not py.exists():
        return f"{LMCACHE_VENV} missing (benchmarks/lmcache_venv.sh builds it)"
    probe = subprocess.run([str(py), "-c", "from lmcache.integration.vllm import vllm_multi_process_adapter"],
                           capture_output=True, text=True, timeout=300)
    return None if probe.returncode == 0 else "lmcache does not import: " + probe.stderr.strip()[-300:]


def run_server(name: str, args, work: pathlib.Path) -> dict:
    """Start one server, run every dataset against it, stop it."""
    d = work / name
    d.mkdir(mode=0o700)
    redis = lmcache = None
    env, extra = {}, ()
    try:
        if name == "lmcache":
            from vllm_kvbm_plugin.testing.serving import free_port

            port = free_port()
            lmcache = subprocess.Popen(
                [str(LMCACHE_VENV / "bin" / "lmcache"), "server", "--host", "localhost", "--port", str(port),
                 "--chunk-size", str(args.block_size), "--l1-size-gb", str(max(1, args.cpu_bytes >> 30)),
                 "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
                 "--http-port", str(free_port()), "--disable-observability"],
                stdout=open(d / "lmcache.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
            ktc = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                                 "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
            env = {"KVBM_DISABLE": "1", "PATH": f"{LMCACHE_VENV / 'bin'}:{os.environ['PATH']}"}
        else:
            if "remote" in SERVERS[name][1]:
                redis = RedisServer(maxmemory=f"{max(64, (2 * args.disk_bytes) >> 20)}mb").start()
            ktc = kv_transfer_config(name, args.cpu_bytes, str(d / "disk"), args.disk_bytes,
                                     redis.url if redis else None)
        server = Serve(args.model, d / "server.log", dtype=args.dtype, block_size=args.block_size,
                       num_gpu_blocks=kv_blocks(args), ktc=ktc, env=env, extra=extra,
                       max_model_len=args.prefix_len + args.suffix_len + args.output_len + 64)
        if name == "lmcache":
            server.args[:1] = [str(LMCACHE_VENV / "bin" / "python"), "-c", LMCACHE_SERVE]
        startup = server.start()
        try:
            warm_up(server.url)
            out = {"startup_s": startup, "datasets": {}}
            for dataset in args.datasets:
                before = scrape(server.url)
                result = d / f"{dataset}.json"
                helper = [redis.proc.pid] if redis else [lmcache.pid] if lmcache else []
                cpu0 = server.cpu_seconds(), cpu_seconds(helper)
                t0 = time.monotonic()
                proc = subprocess.run(client_args(args, dataset, server.url, result), capture_output=True,
                                      text=True, timeout=args.client_timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"vllm bench serve failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                cpu = server.cpu_seconds() - cpu0[0], cpu_seconds(helper) - cpu0[1]
                r = json.loads(result.read_text())
                time.sleep(2)  # the last steps' connector stats reach the metrics
                stats = summarize(delta(scrape(server.url), before))
                out["datasets"][dataset] = {
                    "wall_s": time.monotonic() - t0, "req_s": r["request_throughput"],
                    "completed": r["completed"], "failed": r.get("failed", args.prompts - r["completed"]),
                    **{f"ttft_{p}_ms": r[f"p{p}_ttft_ms"] for p in (50, 90, 99)},
                    "server_cpu_s": cpu[0], "helper_cpu_s": cpu[1],
                    "mean_ttft_ms": r["mean_ttft_ms"], "ttfts_ms": [t * 1000 for t in r.get("ttfts", []) if t],
                    **stats}
                print(f"[bench] {name} {dataset}: {r['request_throughput']:.3f} req/s, "
                      f"TTFT p50 {r['p50_ttft_ms']:.0f} ms, {stats}", flush=True)
            return out
        finally:
            server.stop()
    finally:
        if redis:
            redis.stop()
        if lmcache and lmcache.poll() is None:
            os.killpg(lmcache.pid, 15)
            lmcache.wait(30)


def table(results: dict, dataset: str) -> str:
    base = results.get("none", {}).get("datasets", {}).get(dataset)
    rows = ["| server | req/s | x req/s | TTFT p50 ms | x p50 | p90 | p99 | vLLM hit | conn. hit | CPU s/req | "
            "bytes moved (MiB) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        r = res.get("datasets", {}).get(dataset)
        if r is None:
            rows.append(f"| {name} | {res.get('error', 'skipped')} ||||||||||")
            continue
        xr = f"{r['req_s'] / base['req_s']:.2f}" if base else "-"
        xt = f"{r['ttft_50_ms'] / base['ttft_50_ms']:.2f}" if base else "-"
        moved = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(r["bytes_moved"].items())) or "-"
        rows.append(f"| {name} | {r['req_s']:.3f} | {xr} | {r['ttft_50_ms']:.0f} | {xt} | {r['ttft_90_ms']:.0f} | "
                    f"{r['ttft_99_ms']:.0f} | {r['vllm_hit_rate']:.0%} | {r['connector_hit_rate']:.0%} | "
                    f"{cpu_per_request(r)} | {moved} |")
    return "\n".join(rows)


def cpu_per_request(r: dict) -> str:
    """The server's CPU seconds per completed request, and its redis/LMCache server's after a +."""
    if "server_cpu_s" not in r or not r["completed"]:
        return "-"
    helper = f" + {r['helper_cpu_s'] / r['completed']:.2f}" if r["helper_cpu_s"] else ""
    return f"{r['server_cpu_s'] / r['completed']:.2f}{helper}"


PLOT = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
res = json.load(open(sys.argv[1]))
datasets = res["config"]["datasets"]
fig, axes = plt.subplots(2, len(datasets), figsize=(7 * len(datasets), 9), squeeze=False)
for i, ds in enumerate(datasets):
    names, rates = [], []
    for name, r in res["servers"].items():
        d = r.get("datasets", {}).get(ds)
        if not d:
            continue
        t = sorted(d["ttfts_ms"])
        axes[0][i].step(t, [(k + 1) / len(t) for k in range(len(t))], where="post", label=name)
        names.append(name); rates.append(d["req_s"])
    axes[0][i].set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"TTFT CDF, {ds}")
    axes[0][i].legend(fontsize=8)
    axes[1][i].barh(names, rates)
    axes[1][i].set(xlabel="requests / s", title=f"throughput, {ds}")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
"""


def plot(json_path: pathlib.Path, png: pathlib.Path, python: str | None) -> None:
    for py in [sys.executable, python]:
        if py and os.access(py, os.X_OK) and \
                subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode == 0:
            subprocess.run([py, "-c", PLOT, str(json_path), str(png)], check=True)
            print(f"[bench] plot: {png}")
            return
    print("[bench] no PNG: matplotlib is not in this venv (never install it into the shared .venv); "
          "pass --plot-python with a python that has it, e.g. python3 -m venv .cache/plot-venv && "
          ".cache/plot-venv/bin/pip install matplotlib")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the tiny --model-kind, built locally)")
    p.add_argument("--model-kind", default="llama-big", help="tiny model to build: llama-big, or qwen3next (hybrid)")
    p.add_argument("--dtype", default=None, help="default float32; bfloat16 for qwen3next (vLLM's CPU GDN "
                   "attention takes nothing else)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--prompts", type=int, default=120)
    p.add_argument("--prefixes", type=int, default=30)
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=None, help="requests/s (default: all at once, "
                   "bounded by --max-concurrency)")
    p.add_argument("--cache-fraction", type=float, default=2 / 3,
                   help="vLLM's own KV cache as a fraction of the prefixes' blocks")
    p.add_argument("--cpu-bytes", type=int, default=2 << 30)
    p.add_argument("--disk-bytes", type=int, default=4 << 30)
    p.add_argument("--datasets", default="prefix_repetition,random")
    p.add_argument("--servers", default=",".join([*SERVERS, "lmcache"]),
                   help=f"comma-separated, from: {', '.join([*SERVERS, 'lmcache'])}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-timeout", type=float, default=3600)
    p.add_argument("--out", default="bench_serve", help="JSON and PNG path prefix")
    p.add_argument("--plot-python", default=str(ROOT / ".cache" / "plot-venv" / "bin" / "python"))
    args = p.parse_args()
    args.datasets = [d for d in args.datasets.split(",") if d]
    bad = [d for d in args.datasets if d not in ("prefix_repetition", "random")]
    servers = [s for s in args.servers.split(",") if s]
    bad += [s for s in servers if s not in SERVERS and s != "lmcache"]
    if bad:
        p.error(f"unknown {bad}; datasets: prefix_repetition, random; servers: {', '.join([*SERVERS, 'lmcache'])}")
    args.dtype = args.dtype or ("bfloat16" if args.model_kind == "qwen3next" else "float32")
    args.model = args.model or str(build(args.model_kind))
    print(f"[bench] {args.prompts} prompts, {args.prefixes} prefixes of {args.prefix_len}+{args.suffix_len} tokens, "
          f"output {args.output_len}, concurrency {args.max_concurrency}, rate {args.request_rate or 'inf'}; "
          f"vLLM's cache {kv_blocks(args)} blocks of {args.block_size}; {args.model_kind} in {args.dtype}", flush=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvbm-bench-serve-"))
    results = {}
    try:
        for name in servers:
            if name == "lmcache" and (why := lmcache_runs()):
                print(f"[bench] LMCache column skipped: {why}")
                results[name] = {"error": f"skipped: {why}"}
                continue
            try:
                results[name] = run_server(name, args, work)
            except Exception as e:  # noqa: BLE001 - one server failing still leaves the others' table
                print(f"[bench] {name} failed: {e}", flush=True)
                results[name] = {"error": f"failed: {str(e)[:200]}"}
    finally:
        if os.environ.get("KEEP_WORKDIR") != "1":
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"[bench] logs kept in {work}")
    out = pathlib.Path(args.out)
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps({"config": vars(args), "servers": results}, indent=1))
    for dataset in args.datasets:
        print(f"\n{dataset}:\n{table(results, dataset)}")
    print(f"\n[bench] JSON: {json_path}")
    plot(json_path, out.with_suffix(".png"), args.plot_python)


if __name__ == "__main__":
    main()
