"""Shared timing helper for the benchmarks."""

import time


def best(repeat: int, fn) -> float:
    """The fastest of `repeat` runs of fn(), in seconds (the least disturbed by the machine)."""
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out
