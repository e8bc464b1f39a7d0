"""The disk block format and file layout.

File: <root>/<layout fingerprint hex>/r<rank>/<key hex[:2]>/<key hex>.kvb, directories 0700,
files 0600, names derived only from hex. Content: a fixed header, a msgpack metadata blob, the
payload. A file is written to a temporary name in the same directory and renamed into place, so a
crash leaves either the whole block or no block. Reads check magic, version, key, fingerprint,
lengths and the 64-bit checksum of metadata and payload (hashing.kernels.checksum64, memory
speed): anything else is a miss, never data. A block is read straight into its destination.

Speed: a few syscalls per block (os.open/fstat/preadv/pwritev/rename, no file objects), no
intermediate bytes, and the checksum pass over the payload kept cheap: a write hands it to a helper
thread (tiers.copy.helpers) while the payload is written, the header going in last; a read
checksums chunk by chunk right after each chunk is read, while it is still in cache. (Reading half
of a block on a helper was faster with an idle second core but much slower with a busy one.)
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import wait

import numpy as np

from vllm_kvbm_plugin.hashing.kernels import CHECKSUM_LANES, checksum64, checksum_step
from vllm_kvbm_plugin.tiers.copy import helpers, run_or_cancel

MAGIC = b"KVBM"
VERSION = 1
# magic, version, flags, key, layout fingerprint, payload length, meta length, checksum
_HEADER = struct.Struct("<4sHH16s16sQIQ")
HEADER_SIZE = _HEADER.size
SUFFIX = ".kvb"
_CHUNK = 128 << 10  # read + checksum step: small enough to be checksummed while still in cache
_HELP_MIN = 256 << 10  # a smaller payload is not worth a helper hand-off
_RFLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


def key_hex(key: tuple[int, int]) -> str:
    return f"{key[0]:016x}{key[1]:016x}"


def key_bytes(key: tuple[int, int]) -> bytes:
    return key[0].to_bytes(8, "big") + key[1].to_bytes(8, "big")


def parse_key_hex(name: str) -> tuple[int, int] | None:
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None
    if stem is None or len(stem) != 32:
        return None
    try:
        return int(stem[:16], 16), int(stem[16:], 16)
    except ValueError:
        return None


def block_dir(root: str, fingerprint: bytes, rank: int) -> str:
    return os.path.join(root, fingerprint.hex(), f"r{rank}")


def block_path(base: str, key: tuple[int, int]) -> str:
    h = key_hex(key)
    return os.path.join(base, h[:2], h + SUFFIX)


def _combine(payload_sum: int, meta) -> int:
    """The header's checksum from the payload's checksum64 and the metadata."""
    cm = int(checksum64(np.frombuffer(meta, dtype=np.uint8))) if len(meta) else 0
    return (int(payload_sum) * 0x9E3779B97F4A7C15 + cm) & 0xFFFFFFFFFFFFFFFF


def _header(key: tuple[int, int], fingerprint: bytes, plen: int, meta: bytes, payload_sum: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, 0, key_bytes(key), fingerprint, plen, len(meta),
                        _combine(payload_sum, meta))


def encode(key: tuple[int, int], fingerprint: bytes, payload: np.ndarray, meta: bytes = b"") -> list:
    """The parts of a block file, to be written in order (the payload is not copied)."""
    payload = np.asarray(payload, dtype=np.uint8).reshape(-1)
    return [_header(key, fingerprint, payload.nbytes, meta, checksum64(payload)), meta, payload]


def _io_exact(op, fd: int, parts: list, offset: int) -> bool:
    """os.preadv / os.pwritev of all of `parts` at `offset`, resumed after short transfers; False
    when the file ends first."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = op(fd, views, offset)
        if n <= 0:
            return False
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]
    return True


def read_into(path: str, key: tuple[int, int], fingerprint: bytes, out: np.ndarray) -> bytes | None:
    """Read the block file at `path` into `out` (uint8, its exact payload size); returns its
    metadata, or None when the file is missing, truncated, corrupt, or for another key or layout
    (then `out` holds garbage and must not be used)."""
    try:
        fd = os.open(path, _RFLAGS)
    except OSError:
        return None
    try:
        return _read_verified(fd, key, fingerprint, out.reshape(-1))
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_verified(fd: int, key, fingerprint: bytes, out: np.ndarray) -> bytes | None:
    """Header and metadata come with the first chunk; each whole chunk is checksummed right after it
    is read, while still in cache (a second pass over `out` would read it from memory again)."""
    plen = out.nbytes
    mlen = os.fstat(fd).st_size - HEADER_SIZE - plen  # exact size: no truncation, no trailing bytes
    if mlen < 0:
        return None
    base, view = HEADER_SIZE + mlen, memoryview(out).cast("B")
    head, lanes, done = bytearray(base), CHECKSUM_LANES.copy(), 0
    if not _io_exact(os.preadv, fd, [head, view[:_CHUNK]], 0):
        return None
    magic, version, _flags, k, fp, hplen, hmlen, checksum = _HEADER.unpack_from(head)
    if (magic != MAGIC or version != VERSION or k != key_bytes(key) or fp != fingerprint or hplen != plen
            or hmlen != mlen):
        return None
    for a in range(0, plen, _CHUNK):
        b = min(a + _CHUNK, plen)
        if a and not _read_part(fd, view[a:b], base + a):
            return None
        if b - a == _CHUNK:  # a short last chunk goes with the final step
            checksum_step(lanes, out[a:b], plen, False)
            done = b
    meta = bytes(head[HEADER_SIZE:])
    return meta if _combine(checksum_step(lanes, out[done:], plen, True), meta) == checksum else None


def _read_part(fd: int, view: memoryview, offset: int) -> bool:
    return _io_exact(os.preadv, fd, [view], offset)


def read_meta(path: str) -> bytes | None:
    """The metadata blob of a block file (not verified: for inspection and indexing only)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            if len(head) != HEADER_SIZE:
                return None
            magic, version, _f, _k, _fp, _plen, mlen, _c = _HEADER.unpack(head)
            if magic != MAGIC or version != VERSION:
                return None
            meta = f.read(mlen)
            return meta if len(meta) == mlen else None
    except OSError:
        return None


def _write_via_temp(path: str, fill, fsync: bool) -> None:
    """fill(fd) a temporary file next to `path` (0600), then rename it into place; the directory
    (0700) is made only when the file cannot be created."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        fd = os.open(tmp, _WFLAGS, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, _WFLAGS, 0o600)
    try:
        fill(fd)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)


def _write_exact(fd: int, parts: list, offset: int) -> None:
    if not _io_exact(os.pwritev, fd, parts, offset):
        raise OSError("short write")


def write_atomic(path: str, parts: list, fsync: bool = False) -> None:
    """Write `parts` to `path` through a temporary file and a rename (0600 file, 0700 dirs)."""
    _write_via_temp(path, lambda fd: _write_exact(fd, parts, 0), fsync)


def write_block(path: str, key: tuple[int, int], fingerprint: bytes, payload: np.ndarray, meta: bytes = b"",
                fsync: bool = False) -> None:
    """write_atomic(path, encode(...)) with the same bytes, faster: a helper checksums the payload
    while it is written, the header follows at offset 0."""
    payload = np.asarray(payload, dtype=np.uint8).reshape(-1)
    pool, _ = helpers()

    def fill(fd: int) -> None:
        fut = pool.submit(checksum64, payload) if pool is not None and payload.nbytes >= _HELP_MIN else None
        try:
            _write_exact(fd, [meta, payload], HEADER_SIZE)
        except BaseException:
            if fut is not None and not fut.cancel():
                wait([fut])  # the caller may reuse the payload's memory once we return
            raise
        payload_sum = run_or_cancel(fut, checksum64, payload)
        _write_exact(fd, [_header(key, fingerprint, payload.nbytes, meta, payload_sum)], 0)

    _write_via_temp(path, fill, fsync)


def scan(base: str) -> list[tuple[tuple[int, int], int]]:
    """(key, file size) of every block file under `base`; leftover temporary files are removed."""
    out = []
    try:
        subdirs = os.listdir(base)
    except OSError:
        return out
    for sub in subdirs:
        d = os.path.join(base, sub)
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            if ".tmp" in name:
                try:
                    os.unlink(path)  # a write that never finished
                except OSError:
                    pass
                continue
            key = parse_key_hex(name)
            if key is not None:
                try:
                    out.append((key, os.stat(path).st_size))
                except OSError:
                    pass
    return out
