"""Plain-Python definitions of the sub-sequence index's results, which tests hold the numba kernels
(`reuse/subseq_kernels.py`) and `SubseqIndex.find` to."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from vllm_kvbm_plugin.reuse.subseq_index import Run
from vllm_kvbm_plugin.reuse.subseq_kernels import DEFAULT_BASE


def coverage(runs: Iterable[Run], n: int) -> tuple[int, int]:
    """(prefix tokens, reusable non-prefix tokens) of a request of n tokens (see `subseq_index.Match`), by
    marking covered tokens: the plain-Python definition the kernel `_runs` is tested against."""
    runs = list(runs)
    prefix = max((r.length for r in runs if r.new_start == 0 and r.old_start == 0), default=0)
    covered = np.zeros(n, np.bool_)
    for r in runs:
        covered[r.new_start:r.new_start + r.length] = True
    return prefix, int(covered[prefix:].sum())


def reference_window_hashes(tokens: Sequence[int], unit: int, base: int = DEFAULT_BASE) -> list[int]:
    m = 1 << 64
    return [sum((t % m) * pow(base, unit - 1 - i, m) for i, t in enumerate(tokens[s:s + unit])) % m
            for s in range(len(tokens) - unit + 1)]


def reference_find(units: dict, tokens: Sequence[int], unit: int) -> list[Run]:
    """`SubseqIndex.find`'s runs by brute force over `units` {key: (tokens, parent key, position)}:
    compare tokens directly at every offset, chain parent -> child hits, keep the maximal runs."""
    by_tokens: dict[tuple, list] = {}
    for key, (toks, _, _) in units.items():
        by_tokens.setdefault(tuple(toks), []).append(key)
    hits: dict[tuple[int, Hashable], list] = {}  # (offset, key) -> run of keys ending here
    for s in range(len(tokens) - unit + 1):
        for key in by_tokens.get(tuple(tokens[s:s + unit]), ()):
            parent = units[key][1]
            before = hits.get((s - unit, parent)) if parent in units else None
            hits[(s, key)] = (before or []) + [key]
    continued = {(s - unit, units[k][1]) for (s, k) in hits if units[k][1] in units}
    runs = []
    for (s, key), chain in hits.items():
        if (s, key) in continued:
            continue
        start = s - (len(chain) - 1) * unit
        runs.append(Run(start, units[chain[0]][2], len(chain) * unit, tuple(chain)))
    return sorted(runs)
