#!/usr/bin/env python3
"""Does vLLM's prefix cache resume a hybrid model's recurrent state correctly on this machine?

Serves the same prompts twice over: once with prefix caching off (the oracle: nothing cached,
nothing resumed) and once with prefix caching on and hits at `--hash-unit` tokens, which land inside
vLLM's inflated attention block (the plugin's default for hybrid models). Prints each request's hit,
the oracle's top-2 margin and the largest first-token logprob difference, and exits 1 if any
request's tokens differ where the margin is clear (above --tie) or its logprobs drift (above --tol:
a zeroed state moves the tiny Qwen3-Next's by ~0.03; a correct resume measured 0.0000 here). Plain vLLM by default (the plugin
off, `prefix_match_unit` set by hand), so it doubles as a reproduction for vLLM maintainers:

    python scripts/check_hybrid_prefix_cache.py                       # tiny Qwen3-Next, SSM state as vLLM picks it
    python scripts/check_hybrid_prefix_cache.py --model DIR --ssm-dtype bfloat16 --with-plugin

Each engine runs in its own process (in-process vLLM, VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile


def prompts(n: int, seed: int) -> list[list[int]]:
    """A prompt, a repeat (mid-block hit), a branch and a second branch at the same point, again."""
    rng = random.Random(seed)
    p = [rng.randrange(10, 2000) for _ in range(n)]
    cut = n * 2 // 3
    q = p[:cut] + [rng.randrange(10, 2000) for _ in range(n - cut)]
    q2 = p[:cut] + [rng.randrange(10, 2000) for _ in range(n // 4)]
    return [p, p, q, q2, q, p]


def serve(args, caching: bool) -> list[dict]:
    """Run one engine in a child process (this script with --child) and return its outputs."""
    job = {"model": args.model, "dtype": args.dtype, "block_size": args.block_size, "caching": caching,
           "hash_unit": args.hash_unit, "ssm_dtype": args.ssm_dtype, "budget": args.budget,
           "prompts": prompts(args.prompt_len, args.seed)}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not args.with_plugin:
        env["KVBM_DISABLE"] = "1"
    with tempfile.TemporaryDirectory() as d:
        spec, out = os.path.join(d, "job.json"), os.path.join(d, "out.json")
        with open(spec, "w") as f:
            json.dump(job, f)
        if subprocess.run([sys.executable, __file__, "--child", spec, out], env=env).returncode:
            sys.exit(f"the engine with prefix caching {'on' if caching else 'off'} failed (its log is above)")
        with open(out) as f:
            return json.load(f)


def child(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.load(open(spec_path))
    kwargs = dict(model=job["model"], dtype=job["dtype"], block_size=job["block_size"], enforce_eager=True,
                  max_model_len=len(job["prompts"][0]) + 64, max_num_batched_tokens=job["budget"], seed=0,
                  enable_prefix_caching=job["caching"])
    if job["ssm_dtype"]:
        kwargs["mamba_ssm_cache_dtype"] = job["ssm_dtype"]
    if job["caching"] and job["hash_unit"]:
        kwargs["prefix_match_unit"] = job["hash_unit"]
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=5)
    outs = []
    for p in job["prompts"]:
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
        outs.append({"tokens": list(o.outputs[0].token_ids), "hit": o.num_cached_tokens,
                     "logprobs": {str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}})
    outs.append({"block_size": llm.llm_engine.vllm_config.cache_config.block_size})
    json.dump(outs, open(out_path, "w"))
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the tiny Qwen3-Next, built locally)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (vLLM's CPU GDN kernel needs it) or float32")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--hash-unit", type=int, default=32, help="prefix_match_unit: where hits may land")
    ap.add_argument("--ssm-dtype", default="", help="mamba_ssm_cache_dtype (default: vLLM's choice)")
    ap.add_argument("--budget", type=int, default=96, help="max_num_batched_tokens")
    ap.add_argument("--prompt-len", type=int, default=1100)
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--tie", type=float, default=0.005, help="top-2 margins at or below this are near-ties")
    ap.add_argument("--tol", type=float, default=0.01, help="largest first-token logprob difference accepted")
    ap.add_argument("--with-plugin", action="store_true", help="load vllm-kvbm-plugin (default: plain vLLM)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    if args.model is None:
        from vllm_kvbm_plugin.testing import tiny_models

        args.model = str(tiny_models.build("qwen3next"))
    oracle, cached = serve(args, caching=False), serve(args, caching=True)
    block = cached.pop()["block_size"]
    oracle.pop()
    print(f"model {args.model}: block {block}, hits at {args.hash_unit}-token units")
    print(f"{'prompt':>6} {'hit':>6} {'in block':>9} {'margin':>7} {'gap':>7}  verdict")
    wrong = 0
    for p, ref, got in zip(prompts(args.prompt_len, args.seed), oracle, cached):
        top = sorted(ref["logprobs"].values(), reverse=True)
        common = ref["logprobs"].keys() & got["logprobs"].keys()
        gap = max((abs(ref["logprobs"][t] - got["logprobs"][t]) for t in common), default=float("inf"))
        same = ref["tokens"] == got["tokens"]
        verdict = "ok" if same else ("near-tie" if top[0] - top[1] <= args.tie else "WRONG")
        if gap > args.tol:
            verdict += ", logprobs drift"
        wrong += verdict != "ok" and verdict != "near-tie"
        print(f"{len(p):>6} {got['hit']:>6} {got['hit'] % block:>9} {top[0] - top[1]:>7.3f} {gap:>7.4f}  {verdict}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
