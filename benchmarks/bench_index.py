"""events.index throughput on a synthetic fleet: events applied per second and `match` calls per
second of long prompts. Targets: >= 1M units/s applied, >= 1,000 matches/s of 32k-token prompts.

Fleet: 8 workers (hybrid geometry: 32-token units, 160-token blocks), each caching 100k units as
per-unit attention events plus a Mamba checkpoint per block, chained over 32k-token prompts that
share a system prefix across workers. Baselines in the same run: the validator on the same
batches, and (if vLLM is importable) vLLM's own sha256 request hasher on the same prompts.

    python benchmarks/bench_index.py [--workers 8] [--units 100000] [--prompt 32768] [--repeat 3]
"""

import argparse
import random
import time

import numpy as np

from vllm_kvbm_plugin.events.index import KVIndex
from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher
from vllm_kvbm_plugin.events.types import BlockRemoved, BlockStored, KVEventBatch
from vllm_kvbm_plugin.events.validator import Validator

from timing import best

UNIT, BLOCK = 32, 160


def fleet(workers: int, units: int, prompt_len: int, rng: random.Random):
    """(per-worker batches, cached prompts per worker): events as the plugin emits them, 32 units
    per BlockStored, a checkpoint per 160-token block, plus removals of 5% of the units."""
    hasher = PromptHasher()
    system = [rng.randrange(100000) for _ in range(4096)]
    per_worker = units // (prompt_len // UNIT)
    streams, prompts = [], []
    for _ in range(workers):
        batches, mine = [], []
        for _ in range(per_worker):
            p = system + [rng.randrange(100000) for _ in range(prompt_len - len(system))]
            mine.append(p)
            hs = hasher.event_hashes(p, UNIT)
            events = []
            for s in range(0, len(hs), 32):
                events.append(BlockStored(block_hashes=hs[s:s + 32], parent_block_hash=hs[s - 1] if s else None,
                                          token_ids=p[s * UNIT:(s + 32) * UNIT], block_size=UNIT, lora_id=None,
                                          medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="full_attention"))
            events.append(BlockStored(block_hashes=hs[BLOCK // UNIT - 1::BLOCK // UNIT], parent_block_hash=None,
                                      token_ids=p[:len(hs) // 5 * BLOCK], block_size=BLOCK, lora_id=None, medium="GPU",
                                      lora_name=None, group_idx=0, kv_cache_spec_kind="mamba"))
            batches.append(KVEventBatch(0.0, events))
        streams.append(batches)
        prompts.append(mine)
    return streams, prompts


def units_in(streams) -> int:
    return sum(len(e.block_hashes) for s in streams for b in s for e in b.events)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--units", type=int, default=100_000)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--matches", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    t0 = time.perf_counter()
    streams, prompts = fleet(args.workers, args.units, args.prompt, rng)
    n_units = units_in(streams)
    print(f"fleet: {args.workers} workers, {n_units:,} announced hashes, built in {time.perf_counter() - t0:.1f}s")

    def apply_all():
        index = KVIndex()
        for w, batches in enumerate(streams):
            for seq, b in enumerate(batches):
                index.apply(f"w{w}", b, seq)
        return index

    t = best(args.repeat, apply_all)
    print(f"index apply:      {n_units / t / 1e6:6.2f} M hashes/s ({t:.2f}s)")

    def validate_all():
        v = Validator()
        for batches in streams:
            for b in batches:
                v.apply(b)

    t = best(args.repeat, validate_all)
    print(f"validator apply:  {n_units / t / 1e6:6.2f} M hashes/s ({t:.2f}s)")

    index = apply_all()
    # 5% of units removed, then matched: cached prompts of random workers, half of them branching
    # off mid-way, and unseen prompts sharing only the system prefix
    queries = []
    for _ in range(args.matches):
        w = rng.randrange(args.workers)
        p = prompts[w][rng.randrange(len(prompts[w]))]
        kind = rng.random()
        if kind < 0.5:
            queries.append(p)
        elif kind < 0.8:
            cut = rng.randrange(len(p))
            queries.append(p[:cut] + [rng.randrange(100000) for _ in range(len(p) - cut)])
        else:
            queries.append(p[:4096] + [rng.randrange(100000) for _ in range(len(p) - 4096)])
    removals = [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=1)
                for h in rng.sample(sorted(index.held_by), len(index.held_by) // 20)]
    index.apply("w0", KVEventBatch(0.0, removals))
    served = [max(m.tokens for m in index.match(q).values()) for q in queries]
    t = best(args.repeat, lambda: [index.match(q) for q in queries])
    print(f"match (lists):    {len(queries) / t:8.0f} prompts/s of {args.prompt} tokens "
          f"({t / len(queries) * 1e3:.2f} ms each; mean best hit {np.mean(served):.0f} tokens)")
    arrays = [np.array(q, dtype=np.int64) for q in queries]
    t = best(args.repeat, lambda: [index.match(q) for q in arrays])
    print(f"match (arrays):   {len(queries) / t:8.0f} prompts/s")
    h = PromptHasher()
    t = best(args.repeat, lambda: [h.event_hashes(q, UNIT) for q in queries])
    print(f"prompt hashes:    {len(queries) / t:8.0f} prompts/s (events.index, lists)")
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request
    except ImportError:
        print("vLLM's hasher:    (vLLM not importable)")
        return
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(UNIT, fn)
    sp = SamplingParams(max_tokens=1)
    t = best(args.repeat, lambda: [Request("r", q, sp, None, block_hasher=hasher) for q in queries[:50]])
    print(f"vLLM's hasher:    {50 / t:8.0f} prompts/s (sha256, {UNIT}-token units, Request construction included)")


if __name__ == "__main__":
    main()
