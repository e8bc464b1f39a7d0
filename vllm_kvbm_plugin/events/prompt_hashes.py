"""vLLM's block hashes of a prompt, reproduced without vLLM (`PromptHasher`), and vLLM's extra keys
per hash unit (`unit_extra_keys`, `event_extra_keys`). Used by the router-side index
(events/index.py) to place a prompt among the hashes that workers announce.

The prompt's hashes are computed as vLLM computes them (`vllm/v1/core/kv_cache_utils.py`
`hash_block_tokens`, `init_none_hash`; `vllm/utils/hashing.py`) for sha256 and sha256_cbor (and
xxhash variants when the `xxhash` package is present and the seed is known): a numba kernel writes
the exact pickle / canonical CBOR bytes of every unit, and OpenSSL's SHA-256 chains them (hashlib
when libcrypto cannot be loaded, or with KVBM_INDEX_NO_LIBCRYPTO set). Where the hashes cannot be
computed (xxhash with vLLM's random per-process seed, or without the package), `computable` is
False and the index learns hashes from the stream instead. Bit-equal to vLLM 0.32 and 0.33
(tests/vllm/test_index_hashes.py).
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import hashlib
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

Digest = Callable[[bytes | memoryview], bytes]  # a hash function's digest of a buffer

import numba
import numpy as np

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed for cryptographic algorithms
_PICKLE, _CBOR = 0, 1
_PARENT_AT = (13, 3)  # offset of the parent hash in a unit's serialized bytes
_MAX_FAST_UNIT = 8192  # pickle splits frames past 64 KiB: longer units take the pickle path


@numba.njit(cache=True, nogil=True)
def _serialize_units(tokens, n_units, unit, fmt):
    """The bytes vLLM hashes for each unit, `(parent, tuple(tokens), None)` as pickle protocol 5
    or canonical CBOR, with a zero parent; returns (buffer, offsets). Token ids in [0, 2**31)."""
    sizes = np.empty(n_units, np.int64)
    for u in range(n_units):
        s = 0
        for i in range(u * unit, (u + 1) * unit):
            t = tokens[i]
            if fmt == 0:
                s += 2 if t < 256 else (3 if t < 65536 else 5)
            else:
                s += 1 if t < 24 else (2 if t < 256 else (3 if t < 65536 else 5))
        if fmt == 0:
            s += 53  # header 11, C 0x20, parent 32, MEMOIZE MARK ... TUPLE MEMOIZE NONE TUPLE3 MEMOIZE STOP
        else:
            s += 35 + (1 if unit < 24 else (2 if unit < 256 else 3)) + 1  # 0x83, bytes(32), array, null
        sizes[u] = s
    offs = np.zeros(n_units + 1, np.int64)
    for u in range(n_units):
        offs[u + 1] = offs[u] + sizes[u]
    buf = np.zeros(offs[n_units], np.uint8)
    for u in range(n_units):
        p = offs[u]
        if fmt == 0:
            buf[p] = 0x80
            buf[p + 1] = 5
            buf[p + 2] = 0x95  # FRAME, 8-byte little-endian length of what follows
            frame = sizes[u] - 11
            for k in range(8):
                buf[p + 3 + k] = (frame >> (8 * k)) & 0xFF
            buf[p + 11] = 0x43  # SHORT_BINBYTES
            buf[p + 12] = 32
            p += 45
            buf[p] = 0x94  # MEMOIZE
            buf[p + 1] = 0x28  # MARK
            p += 2
            for i in range(u * unit, (u + 1) * unit):
                t = tokens[i]
                if t < 256:
                    buf[p] = 0x4B  # BININT1
                    buf[p + 1] = t
                    p += 2
                elif t < 65536:
                    buf[p] = 0x4D  # BININT2
                    buf[p + 1] = t & 0xFF
                    buf[p + 2] = t >> 8
                    p += 3
                else:
                    buf[p] = 0x4A  # BININT
                    for k in range(4):
                        buf[p + 1 + k] = (t >> (8 * k)) & 0xFF
                    p += 5
            buf[p] = 0x74  # TUPLE
            buf[p + 1] = 0x94
            buf[p + 2] = 0x4E  # NONE
            buf[p + 3] = 0x87  # TUPLE3
            buf[p + 4] = 0x94
            buf[p + 5] = 0x2E  # STOP
        else:
            buf[p] = 0x83  # array(3)
            buf[p + 1] = 0x58  # bytes, 1-byte length
            buf[p + 2] = 32
            p += 35
            if unit < 24:
                buf[p] = 0x80 | unit
                p += 1
            elif unit < 256:
                buf[p] = 0x98
                buf[p + 1] = unit
                p += 2
            else:
                buf[p] = 0x99
                buf[p + 1] = unit >> 8
                buf[p + 2] = unit & 0xFF
                p += 3
            for i in range(u * unit, (u + 1) * unit):
                t = tokens[i]
                if t < 24:
                    buf[p] = t
                    p += 1
                elif t < 256:
                    buf[p] = 0x18
                    buf[p + 1] = t
                    p += 2
                elif t < 65536:
                    buf[p] = 0x19
                    buf[p + 1] = t >> 8
                    buf[p + 2] = t & 0xFF
                    p += 3
                else:
                    buf[p] = 0x1A
                    for k in range(4):
                        buf[p + 1 + k] = (t >> (8 * (3 - k))) & 0xFF
                    p += 5
            buf[p] = 0xF6  # null
    return buf, offs


def _int64(token_ids: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """The first n token ids as int64 (array.array: ~2x faster than numpy from a list)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids[:n].astype(np.int64, copy=False)
    return np.frombuffer(array.array("q", token_ids[:n] if n < len(token_ids) else token_ids), np.int64)


def _load_sha256():
    """OpenSSL's low-level SHA-256 (no per-call EVP context: ~4x hashlib per small input), or None."""
    if os.environ.get("KVBM_INDEX_NO_LIBCRYPTO"):
        return None
    name = ctypes.util.find_library("crypto")
    try:
        lib = ctypes.CDLL(name or "libcrypto.so.3")
        init, update, final = lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final
    except (OSError, AttributeError):
        return None
    init.restype, init.argtypes = ctypes.c_int, [ctypes.c_void_p]
    update.restype, update.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    final.restype, final.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]
    return init, update, final


_sha_chain = None  # compiled lazily: a kernel calling ctypes functions cannot be cached on disk


def _sha256_chain_kernel():
    global _sha_chain
    if _sha_chain is None:
        fns = _load_sha256()
        if fns is None:
            _sha_chain = False
        else:
            init, update, final = fns

            @numba.njit(nogil=True)
            def chain(buf, offs, parent_at, first_parent, out):
                ctx = np.zeros(256, np.uint8)  # SHA256_CTX is 112 bytes
                for u in range(len(offs) - 1):
                    s = offs[u]
                    if u == 0:
                        buf[s + parent_at:s + parent_at + 32] = first_parent
                    else:
                        buf[s + parent_at:s + parent_at + 32] = out[u - 1]
                    init(ctx.ctypes.data)
                    update(ctx.ctypes.data, buf[s:].ctypes.data, offs[u + 1] - s)
                    final(out[u].ctypes.data, ctx.ctypes.data)

            _sha_chain = chain
    return _sha_chain


def _xxh3_128() -> Digest | None:
    try:
        import xxhash
    except ImportError:
        return None
    return getattr(xxhash, "xxh3_128_digest", None)


def _cbor_dumps() -> Callable[[Any], bytes] | None:
    try:
        import cbor2
    except ImportError:
        return None
    return lambda obj: cbor2.dumps(obj, canonical=True)


class PromptHasher:
    """vLLM's block hashes (full digests) of a prompt's hash units for one algorithm and seed.

    `seed`: the worker's PYTHONHASHSEED, or None for vLLM's default (a fixed seed for sha256 and
    sha256_cbor; a random one for the xxhash algorithms, so those cannot be computed).

    One per worker of a KVIndex (a router's process), and used by tests and benchmarks; holds only
    the algorithm, seed and the seed's hash (`none_hash`)."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in ALGOS:
            raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; one of {', '.join(ALGOS)}")
        self.algo, self.seed = algo, seed
        self.fmt = _CBOR if algo.endswith("_cbor") else _PICKLE
        digest: Digest | None = (lambda b: hashlib.sha256(b).digest()) if algo.startswith("sha256") else _xxh3_128()
        dumps = _cbor_dumps() if self.fmt == _CBOR else (lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))
        self.none_hash: bytes | None = None
        self.computable = (digest is not None and dumps is not None
                           and (algo.startswith("sha256") or seed is not None))
        if digest is None or dumps is None or not self.computable:
            return
        self._digest = digest
        self._dumps: Callable[[Any], bytes] = dumps
        self.none_hash = self.hash_fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)

    def hash_fn(self, obj: Any) -> bytes:
        """vLLM's hash function of this algorithm (`vllm.utils.hashing`)."""
        return self._digest(self._dumps(obj))

    def hashes(self, token_ids: Sequence[int] | np.ndarray, unit: int, n_units: int | None = None,
               unit_keys: Sequence[tuple | None] | None = None) -> list[bytes]:
        """The digests of the first `n_units` units (all full units by default); `unit_keys`: vLLM's
        extra keys per unit (`generate_block_hash_extra_keys`), None entries for none."""
        buf, offs = self.serialized(token_ids, unit, n_units, unit_keys)
        if buf is None:
            return self._hashes_python(token_ids, unit, len(offs) - 1, unit_keys)
        out = self._chain(buf, offs)
        return [bytes(row) for row in out]

    def event_hashes(self, token_ids: Sequence[int] | np.ndarray, unit: int, n_units: int | None = None,
                     unit_keys: Sequence[tuple | None] | None = None, as_int: bool = True) -> list[Any]:
        """The hashes as KV events carry them: the low 64 bits as an int (vLLM's default,
        `maybe_convert_block_hash`) or the digest bytes."""
        buf, offs = self.serialized(token_ids, unit, n_units, unit_keys)
        if buf is None:
            digests = self._hashes_python(token_ids, unit, len(offs) - 1, unit_keys)
            if not as_int:
                return digests
            return [int.from_bytes(d[-8:], "big") for d in digests]
        out = self._chain(buf, offs)
        if not as_int:
            return [bytes(row) for row in out]
        w = out.shape[1]
        return out[:, w - 8:].copy().view(">u8").ravel().tolist()

    def event_hash_chunks(self, token_ids: Sequence[int] | np.ndarray, unit: int, n_units: int,
                          as_int: bool = True, chunk: int = 64) -> Iterator[list[Any]]:
        """`event_hashes` in chunks of `chunk` units, computed only as far as they are consumed
        (a router stops at the first block nobody holds)."""
        tokens = _int64(token_ids, n_units * unit) if n_units else np.zeros(0, np.int64)
        if not (4 <= unit <= _MAX_FAST_UNIT) or (len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**31)):
            yield self.event_hashes(token_ids, unit, n_units, None, as_int)
            return
        assert self.none_hash is not None, "hashes of an algorithm that cannot be computed"
        parent = np.frombuffer(self.none_hash, np.uint8)
        for start in range(0, n_units, chunk):
            end = min(start + chunk, n_units)
            buf, offs = _serialize_units(tokens[start * unit:end * unit], end - start, unit, self.fmt)
            out = self._chain(buf, offs, parent)
            parent = out[-1].copy()
            w = out.shape[1]
            yield out[:, w - 8:].copy().view(">u8").ravel().tolist() if as_int else [bytes(r) for r in out]

    def serialized(self, token_ids: Sequence[int] | np.ndarray, unit: int, n_units: int | None = None,
                   unit_keys: Sequence[tuple | None] | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """(buffer, offsets) of the units' bytes for the numba path, or (None, None) when a unit
        needs the general path (extra keys, token ids out of range, odd unit sizes)."""
        if n_units is None:
            n_units = len(token_ids) // unit
        n_units = max(0, min(n_units, len(token_ids) // unit))
        if unit_keys is not None and any(unit_keys[:n_units]):
            return None, np.zeros(n_units + 1)
        if not 4 <= unit <= _MAX_FAST_UNIT or n_units == 0:
            return None, np.zeros(n_units + 1)
        tokens = _int64(token_ids, n_units * unit)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**31):
            return None, np.zeros(n_units + 1)
        return _serialize_units(tokens, n_units, unit, self.fmt)

    def _chain(self, buf: np.ndarray, offs: np.ndarray, first: np.ndarray | None = None) -> np.ndarray:
        parent_at = _PARENT_AT[self.fmt]
        if first is None:
            assert self.none_hash is not None, "hashes of an algorithm that cannot be computed"
            first = np.frombuffer(self.none_hash, np.uint8)
        kernel = _sha256_chain_kernel() if self.algo.startswith("sha256") else None
        if kernel:
            out = np.empty((len(offs) - 1, 32), np.uint8)
            kernel(buf, offs, parent_at, first, out)
            return out
        digest = self._digest
        mv = buf.data
        parent, rows = bytes(first), []
        for u in range(len(offs) - 1):
            s = int(offs[u])
            buf[s + parent_at:s + parent_at + 32] = np.frombuffer(parent, np.uint8)
            parent = digest(mv[s:int(offs[u + 1])])
            rows.append(parent)
        return np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), -1) if rows else np.empty((0, 32), np.uint8)

    def _hashes_python(self, token_ids: Sequence[int] | np.ndarray, unit: int, n_units: int,
                       unit_keys: Sequence[tuple | None] | None) -> list[bytes]:
        """vLLM's `hash_block_tokens` chain, one unit at a time (the reference for the kernel)."""
        parent, out = self.none_hash, []
        for u in range(n_units):
            keys = unit_keys[u] if unit_keys is not None and u < len(unit_keys) else None
            parent = self.hash_fn((parent, tuple(token_ids[u * unit:(u + 1) * unit]), keys or None))
            out.append(parent)
        return out


def unit_extra_keys(n_units: int, unit: int, images: Iterable[tuple[int, int, str]] = (),
                    lora: tuple[str, str] | None = None, cache_salt: str | None = None) -> list[tuple | None] | None:
    """vLLM's extra keys per hash unit (`generate_block_hash_extra_keys`): LoRA (name, path), the
    images `(offset, length, identifier)` overlapping the unit with their offset from its start,
    and the cache salt on the first unit. None when no unit has any."""
    images = sorted(images)
    lora_keys = [("lora", lora[0], lora[1])] if lora else []
    out: list[tuple | None] = []
    for u in range(n_units):
        start, end = u * unit, (u + 1) * unit
        mm = [("mm", ident, off - start) for off, length, ident in images if off < end and start < off + length]
        salt = [("cache_salt", cache_salt)] if cache_salt and u == 0 else []
        keys = lora_keys + mm + salt
        out.append(tuple(keys) if keys else None)
    return out if any(out) else None


def event_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One unit's extra keys as KV events carry them (vLLM's `to_event_extra_keys`), hashable."""
    if keys is None:
        return None
    return tuple(tuple(k[1:]) if k[0] == "mm" else k[1] for k in keys)
