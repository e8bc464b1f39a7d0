"""The block MAC's cost on given payloads, against format 2's checksum on the same bytes, timed in
turns in one run (for bench_remote.py and bench_tier_io.py)."""

import time

import numpy as np

from checksum_v2 import checksum_sums
from vllm_kvbm_plugin.tiers.mac import mac_final, mac_update


def mac_and_checksum_seconds(payloads: list, mac_key, rounds: int = 7) -> tuple[float, float]:
    """Best seconds of (the MAC of every payload, format 2's checksum of every payload): the same
    bytes, the two passes taking turns."""
    head = np.zeros(64, dtype=np.uint8)
    none = np.zeros(0, dtype=np.uint8)

    def mac():
        for p in payloads:
            acc = np.zeros(3, dtype=np.uint64)
            mac_update(acc, mac_key, p, 0)
            mac_final(acc, mac_key, head, none)

    def checksum():
        for p in payloads:
            checksum_sums(p)

    mac(), checksum()  # numba compiles / loads
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((mac, checksum)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]
