"""Keyed two-stage block keys (spec in docs/block-keys.md): pure, no vLLM import.

A `Keyer` holds one tier secret (tiers/secret.py) and computes keys under it: `request_keys` is
the entry point, every unit key of a request in one numba call; `extra_hash` is spec.extra_hash
through a numba kernel (bit-exact, tested). Only the connector's scheduler side computes keys;
the workers are handed keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgspec
import numpy as np

from vllm_kvbm_plugin.hashing import spec
from vllm_kvbm_plugin.hashing.spec import NO_EXTRA, SPEC_VERSION, Key  # noqa: F401

_encode = msgspec.msgpack.Encoder().encode  # the same bytes as spec's msgspec.msgpack.encode


class Keyer:
    """Block keys under one 16-byte secret. Its repr never shows the secret."""

    def __init__(self, secret: bytes) -> None:
        k0, k1 = spec.secret_words(secret)
        self._secret = bytes(secret)
        self._k0, self._k1 = np.uint64(k0), np.uint64(k1)

    def __repr__(self) -> str:
        return "Keyer(<secret>)"

    def root(self, model: str, dtype: str, kv_layout: str, unit: int, tp_rank: int = 0, tp_size: int = 1) -> Key:
        return spec.root_key(self._secret, model, dtype, kv_layout, unit, tp_rank, tp_size)

    def extra_hash(self, extra_keys: tuple | None) -> Key:
        """spec.extra_hash: hash of one unit's extra keys in vLLM's tagged form, (0, 0) for none."""
        if not extra_keys:
            return NO_EXTRA
        from vllm_kvbm_plugin.hashing.kernels import extra_hash

        a, b = extra_hash(_encode(extra_keys), self._k0, self._k1)
        return int(a), int(b)

    def request_keys(self, tokens: Sequence[int] | np.ndarray, unit: int, root: Key,
                     extras: dict[int, Key] | None = None) -> np.ndarray:
        """uint64[n_units, 2] keys of the full units of `tokens`, chained from `root` (a root or
        the key of the unit before them); `extras` maps unit index -> extra hash."""
        from vllm_kvbm_plugin.hashing.kernels import unit_keys

        if isinstance(tokens, np.ndarray):
            toks = tokens.astype(np.int64, copy=False)
        else:  # struct unboxes a list of Python ints ~2.5x faster than array.array, ~3x np.asarray
            toks = np.frombuffer(struct.pack(f"{len(tokens)}q", *tokens), dtype=np.int64)
        ex = np.zeros((len(toks) // unit, 2), dtype=np.uint64)
        for i, (a, b) in (extras or {}).items():
            if i < len(ex):
                ex[i, 0], ex[i, 1] = a, b
        return unit_keys(toks, unit, np.uint64(root[0]), np.uint64(root[1]), ex, self._k0, self._k1)
