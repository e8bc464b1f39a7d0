"""Hit rates of the eviction policies on synthetic traces, replayed through the tier index.

Each request is a chain of block keys (a key names its whole prefix). A request hits the longest
run of its leading blocks the tier holds, then stores the rest in order (parent first). Traces:
multi-turn chat (each turn resends the conversation), shared system prompts with unique
questions, and RAG (Zipf-popular documents, each followed by a unique query). Baseline: lru.

    python benchmarks/bench_eviction.py [--capacity 2000] [--requests 4000]
"""

import argparse
import random

from vllm_kvbm_plugin.tiers.index import TierIndex
from vllm_kvbm_plugin.tiers.policies import POLICIES, make_policy


def chain(parts: list) -> list:
    """Block keys of a request made of (name, n_blocks) parts: key i = the prefix up to block i."""
    keys, prefix = [], ()
    for name, n in parts:
        for j in range(n):
            prefix = hash((prefix, name, j))
            keys.append(prefix)
    return keys


def chat(rng, n):
    convs, out = {}, []
    for _ in range(n):
        c = rng.randrange(300)
        turns = convs.setdefault(c, [])
        turns.append((f"turn{c}.{len(turns)}", rng.randrange(2, 8)))
        out.append(chain([("sys", 4)] + turns))
        if len(turns) > 12:
            convs.pop(c)
    return out


def system_prompts(rng, n):
    return [chain([(f"sys{rng.randrange(20)}", 24), (f"q{i}", rng.randrange(1, 6))]) for i in range(n)]


def rag(rng, n):
    docs = list(range(2000))
    weights = [1 / (d + 1) ** 1.1 for d in docs]
    return [chain([("sys", 2), (f"doc{rng.choices(docs, weights)[0]}", 16), (f"q{i}", 2)]) for i in range(n)]


def replay(trace, capacity: int, policy: str) -> float:
    idx = TierIndex(capacity, make_policy(policy))
    hits = total = 0
    for keys in trace:
        n = 0
        while n < len(keys) and idx.ready(keys[n]):
            idx.touch(keys[n])
            n += 1
        hits += n
        total += len(keys)
        record_miss = getattr(idx.policy, "record_miss", None)
        for i in range(n, len(keys)):
            if record_miss:
                record_miss(keys[i])
            if keys[i] in idx:
                continue
            parent = keys[i - 1] if i else None
            if parent is not None and parent not in idx:
                break  # tiers hold whole prefixes
            held = idx.pin(parent) if parent is not None else None
            entry, _ = idx.reserve(keys[i], parent)
            idx.unpin(held)
            if entry is None:
                break
            idx.complete(entry)
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=4000)
    args = ap.parse_args()
    traces = {"multi-turn chat": chat, "shared system prompts": system_prompts, "RAG documents": rag}
    print(f"block hit rate, tier of {args.capacity} blocks, {args.requests} requests per trace")
    print(f"{'trace':24}" + "".join(f"{p:>12}" for p in POLICIES))
    for name, make in traces.items():
        trace = make(random.Random(0), args.requests)
        rates = {p: replay(trace, args.capacity, p) for p in POLICIES}
        print(f"{name:24}" + "".join(f"{rates[p]:12.3f}" for p in POLICIES)
              + f"   (best vs lru: {max(rates.values()) / max(rates['lru'], 1e-9):.2f}x)")


if __name__ == "__main__":
    main()
