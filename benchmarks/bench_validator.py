"""Validator throughput on a recorded stream, in hashes per second. Target: 1M hashes/s.

The stream comes from vLLM's real Scheduler (in-process, simulated outputs) with the plugin's
per-unit events on a hybrid geometry, pushed through the wire format. Baselines in the same run:
msgspec decoding of the same payloads, and a bare Python set add/discard of the same hashes (the
floor for any per-hash index written in Python).

    python benchmarks/bench_validator.py [--requests 300] [--repeat 5]
"""

import argparse
import random
import time

import msgspec

from vllm_kvbm_plugin import plugin
from vllm_kvbm_plugin.events.types import BlockRemoved, BlockStored, decode_batch
from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

from timing import best


def record(n_requests: int) -> list[bytes]:
    plugin.register()
    rng = random.Random(0)
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32, num_blocks=400,
                                       max_model_len=16384, max_num_batched_tokens=8192, max_num_seqs=32))
    system = [rng.randrange(50000) for _ in range(2000)]
    for _ in range(n_requests):
        body = [rng.randrange(50000) for _ in range(rng.randrange(500, 8000))]
        h.add(system + body if rng.random() < 0.5 else body, max_tokens=2)
    h.run()
    enc = msgspec.msgpack.Encoder()
    return [enc.encode(b) for b in h._published]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    payloads = record(args.requests)
    batches = [decode_batch(p) for p in payloads]
    n_hashes = sum(len(e.block_hashes) for b in batches for e in b.events if hasattr(e, "block_hashes"))
    print(f"recorded {len(payloads)} batches, {sum(len(b.events) for b in batches)} events, "
          f"{n_hashes} hashes, {sum(map(len, payloads)) / 1e6:.1f} MB")

    def validate():
        v = Validator()
        for i, b in enumerate(batches):
            v.apply(b, i)
        assert v.errors == 0, v.report()

    def decode():
        for p in payloads:
            decode_batch(p)

    def bare_set():
        held = set()
        for b in batches:
            for e in b.events:
                if isinstance(e, BlockStored):
                    held.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    held.difference_update(e.block_hashes)

    t_val, t_dec, t_set = (best(args.repeat, f) for f in (validate, decode, bare_set))
    rate = lambda t: n_hashes / t / 1e6  # noqa: E731
    print(f"validator apply:      {rate(t_val):6.2f} M hashes/s")
    print(f"decode (msgspec):     {rate(t_dec):6.2f} M hashes/s")
    print(f"decode + validate:    {n_hashes / (t_val + t_dec) / 1e6:6.2f} M hashes/s")
    print(f"bare set baseline:    {rate(t_set):6.2f} M hashes/s -> validator at {t_set / t_val:.2f}x of it")


if __name__ == "__main__":
    main()
