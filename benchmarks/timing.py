"""Shared timing helper for the benchmarks."""

import time


def best(repeat: int, fn, clock=time.perf_counter) -> float:
    """The fastest of `repeat` runs of fn(), in seconds of `clock` (the least disturbed by the
    machine; time.process_time: the CPU time of this process, all its threads)."""
    out = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        out = min(out, clock() - t0)
    return out


def prompts(n: int, reps: int) -> list[list[int]]:
    """reps + 1 random prompts of n token ids (the first one warms up), the same in every benchmark."""
    import random

    rng = random.Random(7)
    return [[rng.randrange(10, 2000) for _ in range(n)] for _ in range(reps + 1)]


def shared_prefix_workload(n: int, *, systems: int, system_len: tuple, body_len: tuple, max_len: int,
                           seed: int = 0) -> list[list[int]]:
    """n prompts, 60% of them one of `systems` shared system prompts followed by a random body
    (lengths drawn from the given ranges), cut at max_len: a serving workload with prefix reuse,
    the same for a given seed."""
    import random

    rng = random.Random(seed)
    heads = [[rng.randrange(50000) for _ in range(rng.randrange(*system_len))] for _ in range(systems)]
    out = []
    for _ in range(n):
        body = [rng.randrange(50000) for _ in range(rng.randrange(*body_len))]
        out.append((rng.choice(heads) + body if rng.random() < 0.6 else body)[:max_len])
    return out
