"""Two-stage block keys: the plain-Python reference of docs/block-keys.md.

Stage 1 hashes each hash unit on its own: a token hash over its token ids and an extra hash over
its extra keys (image identifiers with offsets, LoRA name, cache salt, prompt-embed digests).
Stage 2 chains them: key_i = H(key_{i-1}, token_hash_i, extra_hash_i), with key_{-1} = a root
salted by a fingerprint of everything that makes KV bytes differ (model, dtype, KV layout, unit
size, tensor-parallel rank and size). Keys are 128-bit (two 64-bit lanes), independent of
PYTHONHASHSEED and of vLLM's hash algorithm. The numba kernel in `kernels.py` must match this
module bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

SPEC_VERSION = 1
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
# lane seeds: token hash (A, B), chaining (A, B), byte-string hash (A, B)
TOKEN_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)
CHAIN_SEEDS = (0xA4093822299F31D0, 0x082EFA98EC4E6C89)
BYTES_SEEDS = (0x452821E638D01377, 0xBE5466CF34E90C6C)

Key = tuple[int, int]
NO_EXTRA: Key = (0, 0)


def mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit words with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def lane(seed: int, words: Sequence[int]) -> int:
    """Absorb 64-bit words one at a time through the bijective mixer, then the length."""
    h = seed
    for w in words:
        h = mix64(((h ^ (w & M64)) + GOLDEN) & M64)
    return mix64(h ^ len(words))


def hash128(seeds: tuple[int, int], words: Sequence[int]) -> Key:
    return lane(seeds[0], words), lane(seeds[1], words)


def bytes_words(data: bytes) -> list[int]:
    """Little-endian 64-bit words of `data` (zero-padded), then its length in bytes."""
    padded = data + b"\0" * (-len(data) % 8)
    return [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)] + [len(data)]


def hash_bytes(data: bytes) -> Key:
    return hash128(BYTES_SEEDS, bytes_words(data))


def token_hash(tokens: Sequence[int]) -> Key:
    return hash128(TOKEN_SEEDS, tokens)


def extra_hash(extra_keys: tuple | None) -> Key:
    """Hash of one unit's extra keys, in vLLM's tagged form, e.g. (("mm", "<id>", 5),).

    Canonical bytes are msgpack of the tuple (tuples as arrays; str, int and bytes as themselves).
    A unit without extra keys hashes to (0, 0), so text-only units cost nothing here.
    """
    if not extra_keys:
        return NO_EXTRA
    return hash_bytes(msgspec.msgpack.encode(extra_keys))


def chain(parent: Key, tokens: Key, extra: Key) -> Key:
    return hash128(CHAIN_SEEDS, (*parent, *tokens, *extra))


def root_key(model: str, dtype: str, kv_layout: str, unit: int, tp_rank: int = 0, tp_size: int = 1,
             salt: str = "") -> Key:
    """The root every request's chain starts from. `salt` is an optional deployment secret:
    without it keys are collision-resistant for honest inputs only (the hash is not keyed)."""
    fingerprint = ["vllm-kvbm-block-key", SPEC_VERSION, model, dtype, kv_layout, unit, tp_rank,
                   tp_size, salt]
    return hash_bytes(msgspec.msgpack.encode(fingerprint))


def unit_keys(tokens: Sequence[int], unit: int, root: Key,
              extras: Sequence[Key] | None = None) -> list[Key]:
    """Keys of every full `unit`-token unit of `tokens` (extras: one extra hash per unit)."""
    keys, parent = [], root
    for i in range(len(tokens) // unit):
        extra = extras[i] if extras is not None else NO_EXTRA
        parent = chain(parent, token_hash(tokens[i * unit : (i + 1) * unit]), extra)
        keys.append(parent)
    return keys
