"""Stable two-stage block keys (spec in docs/block-keys.md): pure, no vLLM import.

`request_keys` is the entry point: every unit key of a request in one numba call.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

from vllm_kvbm_plugin.hashing.spec import NO_EXTRA, Key, extra_hash, root_key  # noqa: F401


def request_keys(tokens: Sequence[int] | np.ndarray, unit: int, root: Key,
                 extras: dict[int, Key] | None = None) -> np.ndarray:
    """uint64[n_units, 2] keys of the full units of `tokens`; `extras` maps unit index -> extra hash."""
    from vllm_kvbm_plugin.hashing.kernels import unit_keys

    if isinstance(tokens, np.ndarray):
        toks = tokens.astype(np.int64, copy=False)
    else:  # array.array unboxes a list of Python ints about twice as fast as np.asarray
        toks = np.frombuffer(array.array("q", tokens), dtype=np.int64)
    ex = np.zeros((len(toks) // unit, 2), dtype=np.uint64)
    for i, (a, b) in (extras or {}).items():
        if i < len(ex):
            ex[i, 0], ex[i, 1] = a, b
    return unit_keys(toks, unit, np.uint64(root[0]), np.uint64(root[1]), ex)
