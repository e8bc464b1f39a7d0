"""sha256 of what KVBMConnector's scheduler side makes observable on recorded workloads: every
published KV event (vLLM's and the tiers', timestamps left out) and the tokens each request
started with. A refactor of the scheduler side's bookkeeping must leave every digest unchanged:
run this before and after (e.g. PYTHONPATH at an exported copy of the old commit) and compare.

Workloads (bench_connector_scheduler's requests, vLLM's real Scheduler, the connector's real
WorkerSide checking the KV of every load): Llama-like and hybrid 2176/64, each with a CPU tier
that holds everything and one that evicts (LRU, lineage, multi_lru for Llama). Three passes: the
requests, the same again after a prefix cache reset (tier hits), then half of them again.
Disk tiers are left out: their writes finish asynchronously, so their events are not ordered
deterministically.

`--native`: the same passes through vLLM's OffloadingConnector with KVBMOffloadingSpec
(testing.offloading_scheduler, the KV oracle on, our offload_events patch applied): self-describing
tier events, LineageCachePolicy, a CPU tier that holds everything and one that evicts.

    PYTHONHASHSEED=0 python benchmarks/event_digest.py [--requests 60] [--only llama] [--native]
"""

import argparse
import hashlib
import os

import msgspec

from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

from bench_connector_scheduler import GEOMETRIES, workload

LLAMA, HYBRID = GEOMETRIES["llama-like (32)"], GEOMETRIES["nemotron-like (2176/64)"]
WORKLOADS = {
    "llama": (LLAMA, {"cpu_bytes_to_use": 3 << 30}),
    "llama-evicting": (LLAMA, {"cpu_bytes_to_use": 24 << 20}),
    "llama-lineage": (LLAMA, {"cpu_bytes_to_use": 24 << 20, "eviction_policy": "lineage"}),
    "llama-multi_lru": (LLAMA, {"cpu_bytes_to_use": 24 << 20, "eviction_policy": "multi_lru"}),
    "hybrid": (HYBRID, {"cpu_bytes_to_use": 3 << 30}),
    "hybrid-evicting": (HYBRID, {"cpu_bytes_to_use": 48 << 20}),
}


NATIVE_WORKLOADS = {
    "native-llama": (LLAMA, {"cpu_bytes_to_use": 1 << 30}),
    "native-llama-evicting": (LLAMA, {"cpu_bytes_to_use": 24 << 20}),
    "native-hybrid": (HYBRID, {"cpu_bytes_to_use": 1 << 30}),
    "native-hybrid-evicting": (HYBRID, {"cpu_bytes_to_use": 48 << 20}),
}


def native_harness(geometry: dict, offloading: dict):
    """vLLM's OffloadingConnector with KVBMOffloadingSpec, as bench_connector_scheduler.run_native
    builds it, with the KV oracle checking every load."""
    from vllm_kvbm_plugin.testing.offloading_scheduler import OffloadingHarness, OffloadingHarnessConfig

    return OffloadingHarness(OffloadingHarnessConfig(
        max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=16, mamba_layers=1,
        kvbm_spec=True, offloading=offloading, **geometry))


def digest(geometry: dict, connector: dict, prompts, native: bool = False) -> tuple[str, int, int]:
    """(sha256 hex of the events and cached tokens, events, tokens served)."""
    if native:
        h = native_harness(geometry, connector)
    else:
        h = SchedulerHarness(HarnessConfig(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=16,
                                           connector=connector, **geometry))
    served = 0
    for n, batch in enumerate((prompts, prompts, prompts[: len(prompts) // 2])):
        if n:
            h.settle()
            h.reset_prefix_cache()
        ids = [h.add(p, max_tokens=2) for p in batch]
        h.run(timeout=600)
        served += sum(h.cached_tokens[r] for r in ids)
    h.settle()
    enc = msgspec.msgpack.Encoder()
    sha, events = hashlib.sha256(), 0
    for batch in h._published:
        for ev in batch.events:
            sha.update(enc.encode(ev))
            events += 1
        sha.update(b"|")
    sha.update(enc.encode(sorted(h.cached_tokens.items())))
    if native:
        h.close()
    return sha.hexdigest(), events, served


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--only", default="", help="only workloads whose name contains this")
    ap.add_argument("--native", action="store_true", help="vLLM's OffloadingConnector with KVBMOffloadingSpec")
    args = ap.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("set PYTHONHASHSEED=0: vLLM's first block hash is random otherwise")
    # a fixed tier secret: multi_lru's frequency sketch hashes the block keys, which a random
    # per-process secret (the default without disk or remote tier) would make differ run to run
    os.environ.setdefault("KVBM_KEY_SECRET", "6b76626d2d6576656e742d6469676573")
    prompts = workload(args.requests)
    for name, (geometry, connector) in (NATIVE_WORKLOADS if args.native else WORKLOADS).items():
        if args.only in name:
            sha, events, served = digest(geometry, connector, prompts, args.native)
            print(f"{name:18s} {sha}  {events} events, {served} tokens served")


if __name__ == "__main__":
    main()
