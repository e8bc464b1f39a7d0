"""How far vLLM's own code paths differ in float: the same greedy prompts through one engine without
prefix caching, one request at a time (what soak.py's reference server does), and through one with
prefix caching, four at a time on cached prefixes (what its server does, without any connector).
Prints how many logprobs differ and by how much, and how often the reference's top-2 gap is that
small: a greedy token can flip between the two with no KV tier involved when the gap is within the
noise, which is why soak.py reports such near ties apart from mismatches.

    .venv/bin/python benchmarks/float_noise.py [--prompts 400] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(n: int, block: int) -> list[list[int]]:
    """soak.py's shape: 12 prefixes of 8 blocks, each prompt one of them and a block and 5 tokens more."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 2000) for _ in range(8 * block)] for _ in range(12)]
    return [prefixes[rng.randrange(12)] + [rng.randrange(10, 2000) for _ in range(block + 5)] for _ in range(n)]


def generate(mode: str, args, out: str) -> None:
    """One engine in this process: `reference` (no prefix caching, one request at a time) or
    `cached` (prefix caching, batches of 4); each completion's tokens and top-2 logprobs to `out`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.prompts, args.block_size)]
    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, enforce_eager=True, seed=0,
              max_model_len=11 * args.block_size + 8, enable_prefix_caching=mode == "cached")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    batch = 1 if mode == "reference" else 4
    outs = []
    for i in range(0, len(ps), batch):
        outs += llm.generate(ps[i:i + batch], sp, use_tqdm=False)
    rows = [[sorted(((lp.logprob, t) for t, lp in d.items()), reverse=True) for d in o.outputs[0].logprobs]
            for o in outs]
    pathlib.Path(out).write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--model", default=None, help="default: the tiny llama soak.py uses")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # one engine, in a child process
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode:
        generate(args.mode, args, args.out)
        return 0
    if args.model is None:
        from vllm_kvbm_plugin.testing.tiny_models import build

        args.model = str(build("llama"))
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("reference", "cached"):
            out = f"{d}/{mode}.json"
            subprocess.run([sys.executable, __file__, "--mode", mode, "--out", out, "--prompts", str(args.prompts),
                            "--dtype", args.dtype, "--block-size", str(args.block_size), "--model", args.model],
                           check=True, capture_output=True)
            runs[mode] = json.loads(pathlib.Path(out).read_text())
    positions = differing = flipped = 0
    worst, gaps = 0.0, []
    for ref, got in zip(runs["reference"], runs["cached"]):
        for a, b in zip(ref, got):
            if a[0][1] != b[0][1]:
                flipped += 1
                break  # the rest of the completion follows another token
            positions += 1
            d = abs(a[0][0] - b[0][0])
            differing += d > 0
            worst = max(worst, d)
            gaps.append(a[0][0] - a[1][0])
    print(f"[float_noise] {args.prompts} prompts x 8 greedy tokens, {args.dtype}: cached+batched vs reference")
    print(f"  logprobs that differ: {differing} of {positions} ({differing / positions:.1%}), max |diff| {worst:.3g}")
    print(f"  completions with another token: {flipped}")
    for t in (1e-6, 1e-5, 1e-4, 1e-3):
        print(f"  reference top-2 gap < {t:g}: {sum(g < t for g in gaps) / len(gaps):.2e} of positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
