"""The disk block format and file layout.

File: <root>/<layout fingerprint hex>/r<rank>/<key hex[:2]>/<key hex>.kvb, directories 0700,
files 0600, names derived only from hex. Content: a fixed 64-byte header, the payload, a msgpack
metadata blob. A file is written to a temporary name in the same directory and renamed into place,
so a crash leaves either the whole block or no block, and a file is never changed in place. Reads
check magic, version, key, fingerprint, lengths and the 64-bit checksum of payload and metadata
(tiers.checksum.checksum64): anything else is a miss, never data.

Speed: a few syscalls per block (os.open/fstat/preadv/pwritev/rename, no file objects) and a cheap
vectorized checksum (tiers.checksum). A read goes through a small per-thread buffer that stays in
cache: the kernel copies a chunk into it, the checksum reads it from cache, streaming stores move
it to its destination without reading the destination first. A write hands the payload's checksum
to a helper thread (tiers.copy.helpers) while the payload is written; the header goes in last.
Measured and not kept: reading straight into the destination (the checksum then reads it back
from memory: 0.75x of a plain read instead of 0.82x); reading half of a block on a helper (fast
with an idle second core, much slower with a busy one); mapping the file and copying it out with
the checksum (a few percent faster, but a disk error or an outside truncation would then be a
SIGBUS instead of a miss).
"""

from __future__ import annotations

import os
import struct
import threading
from concurrent.futures import wait

import msgspec
import numpy as np

from vllm_kvbm_plugin.tiers.checksum import checksum64, checksum_final, checksum_update
from vllm_kvbm_plugin.tiers.copy import helpers, run_or_cancel

MAGIC = b"KVBM"
VERSION = 2  # 2: payload before metadata, checksum64 with position keys (version 1 files are misses)
# magic, version, flags, key, layout fingerprint, payload length, meta length, checksum, reserved (0)
_HEADER = struct.Struct("<4sHH16s16sQIQI")
HEADER_SIZE = _HEADER.size  # 64: the payload starts cache-line aligned
SUFFIX = ".kvb"
_CHUNK = 256 << 10  # read buffer: small enough to stay in cache
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
                        _combine(payload_sum, meta), 0)


def encode(key: tuple[int, int], fingerprint: bytes, payload: np.ndarray, meta: bytes = b"") -> list:
    """The parts of a block file, to be written in order (the payload is not copied)."""
    payload = np.asarray(payload, dtype=np.uint8).reshape(-1)
    return [_header(key, fingerprint, payload.nbytes, meta, checksum64(payload)), payload, meta]


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
    out = out.reshape(-1)
    opened = _open_verified(path, key, fingerprint, out.nbytes, out)
    if opened is None:
        return None
    os.close(opened[0])
    return opened[1]


def open_verified(path: str, key: tuple[int, int], fingerprint: bytes, payload_bytes: int):
    """Verify the block file at `path` (as read_into, keeping no bytes) and keep it open: (fd,
    metadata) or None. A block file is never changed in place (writes replace it by a rename,
    eviction unlinks it), so later reads through this fd (read_payload) return the verified bytes,
    whatever happens to the path meanwhile."""
    return _open_verified(path, key, fingerprint, payload_bytes, None)


def _open_verified(path: str, key, fingerprint: bytes, plen: int, out: np.ndarray | None):
    try:
        fd = os.open(path, _RFLAGS)
    except OSError:
        return None
    try:
        meta = _read_verified(fd, key, fingerprint, plen, out)
    except OSError:
        meta = None
    if meta is None:
        os.close(fd)
        return None
    return fd, meta


def read_payload(fd: int, parts: list) -> bool:
    """Read the payload of the open block file `fd` (verified by open_verified) into `parts`, in
    order (e.g. one view per layer, straight into the KV cache); False on a short read."""
    try:
        return _io_exact(os.preadv, fd, parts, HEADER_SIZE)
    except OSError:
        return False


_local = threading.local()


def _bounce() -> np.ndarray:
    """This thread's read buffer: _CHUNK bytes, 64-byte aligned, reused so it stays in cache."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        raw = np.empty(_CHUNK + 64, dtype=np.uint8)
        skip = -raw.ctypes.data % 64
        buf = _local.buf = raw[skip: skip + _CHUNK]
    return buf


def _read_verified(fd: int, key, fingerprint: bytes, plen: int, out: np.ndarray | None) -> bytes | None:
    """Chunk by chunk through a small buffer that stays in cache: the kernel copies into it, the
    checksum reads it from cache and streaming stores put it into `out` (when given) without first
    reading `out`'s memory. The header comes with the first chunk, the metadata with the last."""
    mlen = os.fstat(fd).st_size - HEADER_SIZE - plen  # exact size: no truncation, no trailing bytes
    if mlen < 0:
        return None
    head, meta, acc, buf = bytearray(HEADER_SIZE), bytearray(mlen), np.zeros(2, dtype=np.uint64), _bounce()
    for a in range(0, max(plen, 1), _CHUNK):
        n = min(_CHUNK, plen - a)
        parts = ([head] if a == 0 else []) + [buf[:n]] + ([meta] if a + _CHUNK >= plen else [])
        if not _io_exact(os.preadv, fd, parts, HEADER_SIZE + a if a else 0):
            return None
        if a == 0:
            magic, version, flags, k, fp, hplen, hmlen, checksum, reserved = _HEADER.unpack(head)
            if (magic != MAGIC or version != VERSION or flags or reserved or k != key_bytes(key)
                    or fp != fingerprint or hplen != plen or hmlen != mlen):
                return None
        checksum_update(acc, buf[:n], a, None if out is None else out[a:a + n])
    return bytes(meta) if _combine(checksum_final(acc, plen), meta) == checksum else None


def read_meta(path: str) -> bytes | None:
    """The metadata blob of a block file (not verified: for inspection and indexing only)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            if len(head) != HEADER_SIZE:
                return None
            magic, version, _f, _k, _fp, plen, mlen, _c, _r = _HEADER.unpack(head)
            if magic != MAGIC or version != VERSION:
                return None
            f.seek(HEADER_SIZE + plen)
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
            _write_exact(fd, [payload, meta], HEADER_SIZE)
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


# The metadata blob of a block file: where the entry ends (token position) and the tier events it
# was announced with (each an encoded BlockStored), so a restarted engine can announce it again.
def encode_meta(end: int, events: list[bytes]) -> bytes:
    return msgspec.msgpack.encode({"end": end, "events": events})


def decode_meta(blob: bytes | None) -> tuple[int, list[bytes]] | None:
    """(end, encoded events) of a metadata blob, or None when it describes nothing we can use."""
    try:
        info = msgspec.msgpack.decode(blob) if blob else None
        if not isinstance(info, dict) or not info.get("events"):
            return None
        events = info["events"]
        if not isinstance(events, list) or not all(isinstance(e, bytes) for e in events):
            return None
        return int(info["end"]), events
    except (msgspec.DecodeError, TypeError, ValueError, KeyError):
        return None
