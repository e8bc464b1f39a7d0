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


def prompts(n: int, reps: int) -> list[list[int]]:
    """reps + 1 random prompts of n token ids (the first one warms up), the same in every benchmark."""
    import random

    rng = random.Random(7)
    return [[rng.randrange(10, 2000) for _ in range(n)] for _ in range(reps + 1)]
