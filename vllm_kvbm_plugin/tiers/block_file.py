"""The block file format: one block (payload and metadata) per file, read and written in batches.

Content: a fixed 64-byte header, the payload, a msgpack metadata blob. A file is written to a
temporary name in the same directory and renamed into place, so a crash leaves either the whole
block or no block, and a file is never changed in place. Reads check magic, version, key,
fingerprint, lengths and the 64-bit MAC of header, payload and metadata under the tier secret
(tiers/mac.py): anything else is a miss, never data. Without the secret, nobody can write a file
the tier will serve. Where the files lie (names, directories, scan, tidy): tiers/block_dir.py.

Speed: reads and writes go in batches through tiers/fileio.py: one numba call that holds no GIL
does a batch's files from open to close (libc directly), so a pool thread takes the GIL back once
per batch, not once per syscall (with an engine loop holding the GIL, each take-back waited up to
5 ms). A read goes through a small buffer that stays in cache: the kernel copies a chunk into it,
the MAC reads it from cache, streaming stores move it to its destination without reading the
destination first. A write computes the MAC of payload and metadata from memory, then writes
header, payload and metadata into the new temporary file. Optionally (`direct`) a write goes with O_DIRECT
through an aligned buffer, padded to a page multiple and cut back to its exact size before the
rename (same bytes, same file). Measured on ext4 (one thread, 256 KiB blocks): it costs more CPU
per file than a page-cache write (~450 vs ~280 us, file creation included) and a re-read then
comes from the device; what it saves is the page cache's second copy of every stored block.
Measured and not kept: reading straight into the destination (the MAC then reads it back
from memory: 0.75x of a plain read instead of 0.82x); reading half of a block on a helper (fast
with an idle second core, much slower with a busy one); mapping the file and copying it out with
the MAC (a few percent faster, but a disk error or an outside truncation would then be a
SIGBUS instead of a miss).

Foreign content: no open follows a symlink or blocks (`O_NOFOLLOW | O_NONBLOCK`), and a file is
read only if fstat (statx in fileio) says it is a regular file whose size is exactly header +
payload + metadata with the metadata at most MAX_META bytes. Regular files named like block files
that are unreadable or of another version are misses (read_meta returns None; the scheduler
removes them at startup).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import fileio
from vllm_kvbm_plugin.tiers.block_dir import READ_FLAGS, make_missing_dirs, parse_key_hex
from vllm_kvbm_plugin.tiers.mac import block_mac, mac_final, mac_update

logger = get_logger("disk")

MAGIC = b"KVBM"
VERSION = 3  # 3: a MAC under the tier secret instead of a checksum (files of versions 1 and 2 are misses)
# magic, version, flags, key, layout fingerprint, payload length, meta length, MAC, reserved (0)
_HEADER = struct.Struct("<4sHH16s16sQIQI")
HEADER_SIZE = _HEADER.size  # 64: the payload starts cache-line aligned
_CHUNK = fileio.CHUNK  # read buffer: small enough to stay in cache
_DIRECT_ALIGN = 4096  # O_DIRECT offsets and lengths: a multiple of the page size
_DIRECT_CHUNK = fileio.DIRECT_CHUNK  # direct-write buffer
_DIRECT_MIN = 64 << 10  # a smaller payload is written through the page cache
_DIRECT_O = getattr(os, "O_DIRECT", 0)  # Linux
WRITE_PAUSE_S = 10.0  # s without new block files after writes failed as a whole (full disk), then retried
MAX_META = 8 << 20  # a header claiming more metadata is not ours (real blobs are a few KiB)
FS_BLOCK = 4096  # the unit files take space in on common file systems (ext4, xfs, tmpfs pages)


class BlockRefused(OSError):
    """One block could not be stored because its name or directory is taken by something the tier
    did not make (a directory, a symlink, a FIFO...), or its metadata is too large: a failed store
    of that block, the tier itself is fine."""


def key_bytes(key: tuple[int, int]) -> bytes:
    return key[0].to_bytes(8, "big") + key[1].to_bytes(8, "big")


def _header(key: tuple[int, int], fingerprint: bytes, plen: int, mlen: int, mac: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, 0, key_bytes(key), fingerprint, plen, mlen, mac, 0)


def _u8(b: bytes | bytearray | memoryview) -> np.ndarray:
    return np.frombuffer(b, dtype=np.uint8)


class Header(NamedTuple):
    """The fixed-size header of one block file, as parse_header reads it."""

    key: bytes  # key_bytes of the block's key
    fingerprint: bytes
    payload_bytes: int
    meta_bytes: int
    mac: int


def parse_header(head: bytes | bytearray | memoryview) -> Header | None:
    """The fields of a block header (the first HEADER_SIZE bytes of `head`) of this format version,
    or None for another magic, version or flags. Callers check the fields they expect."""
    magic, version, flags, key, fp, plen, mlen, mac, reserved = _HEADER.unpack_from(head, 0)
    if magic != MAGIC or version != VERSION or flags or reserved:
        return None
    return Header(key, fp, plen, mlen, mac)


def encode(key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray, payload: np.ndarray,
           meta: bytes = b"") -> list:
    """The parts of a block file, to be written in order (the payload is not copied); `mac_key`
    is tiers.mac.mac_key(tier secret)."""
    payload = np.asarray(payload, dtype=np.uint8).reshape(-1)
    head = _header(key, fingerprint, payload.nbytes, len(meta))
    mac = int(block_mac(mac_key, _u8(head), payload, _u8(meta)))
    return [_header(key, fingerprint, payload.nbytes, len(meta), mac), payload, meta]


def _io_exact(op: Callable[[int, list[memoryview], int], int], fd: int, parts: list, offset: int) -> bool:
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


def read_into(path: str, key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray,
              out: np.ndarray) -> bytes | None:
    """Read the block file at `path` into `out` (contiguous, its exact payload size); returns its
    metadata, or None when the file is missing, truncated, corrupt, not written under this tier
    secret (`mac_key`), or for another key or layout (then `out` holds garbage and must not be used)."""
    return read_blocks([path], [key], fingerprint, mac_key, [out])[0]


def read_blocks(paths: list, keys: list, fingerprint: bytes, mac_key: np.ndarray, outs: list) -> list:
    """read_into for many files in one call that holds no GIL (tiers/fileio.py): the metadata of
    each verified file, None for each miss."""
    status, _, metas, at = _read_files(paths, keys, fingerprint, mac_key, [o.nbytes for o in outs],
                                       [_address(o) for o in outs], keep_open=False)
    return [None if status[i] else bytes(metas[at[i]: at[i + 1]]) for i in range(len(paths))]


def open_verified(path: str, key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray,
                  payload_bytes: int) -> tuple[int, bytes] | None:
    """Verify the block file at `path` (as read_into, keeping no bytes) and keep it open: (fd,
    metadata) or None. This tier never changes a block file in place (writes replace it by a rename,
    eviction unlinks it), so later reads through this fd (read_payload) return the verified bytes,
    whatever happens to the path meanwhile; read_payload checks them again all the same."""
    return open_verified_blocks([path], [key], fingerprint, mac_key, payload_bytes)[0]


def open_verified_blocks(paths: list, keys: list, fingerprint: bytes, mac_key: np.ndarray, payload_bytes: int) -> list:
    """open_verified for many files in one call that holds no GIL: (fd, metadata) or None each."""
    status, fds, metas, at = _read_files(paths, keys, fingerprint, mac_key, [payload_bytes] * len(paths),
                                         [0] * len(paths), keep_open=True)
    return [None if status[i] else (int(fds[i]), bytes(metas[at[i]: at[i + 1]])) for i in range(len(paths))]


def _address(out: np.ndarray) -> int:
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("a block is read into a contiguous, writable array")
    return out.ctypes.data


def _names(paths: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """NUL-terminated file names in one array, and where each starts."""
    raw = [os.fsencode(p) + b"\0" for p in paths]
    at = np.zeros(len(raw), dtype=np.int64)
    np.cumsum([len(r) for r in raw[:-1]], out=at[1:])
    return np.frombuffer(bytearray(b"".join(raw)), dtype=np.uint8), at


def _read_files(paths: Sequence[str], keys: Sequence[tuple[int, int]], fingerprint: bytes, mac_key: np.ndarray,
                plens: list, dsts: list, keep_open: bool) -> tuple:
    """fileio.read_files, with the header bytes each file must start with (magic to payload length)."""
    names, at = _names(paths)
    expect = np.frombuffer(bytearray(b"".join(
        _HEADER.pack(MAGIC, VERSION, 0, key_bytes(k), fingerprint, n, 0, 0, 0)[:48] for k, n in zip(keys, plens))),
        dtype=np.uint8).reshape(len(paths), 48)
    if len(fingerprint) != 16:  # a header holds 16 bytes of it: no file can match
        expect[:, 0] ^= 0xFF
    return fileio.read_files(names, at, expect, np.array(plens, dtype=np.int64), np.array(dsts, dtype=np.int64),
                             keep_open, MAX_META, mac_key)


def _open_regular(path: str) -> tuple[int, int] | None:
    """(fd, size) of `path` opened for reading if it is a regular file, else None: a symlink is not
    followed, a FIFO or device never blocks the open, anything but a regular file is closed unread."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            return fd, st.st_size
    except OSError:
        pass
    os.close(fd)
    return None


def read_payload(fd: int, parts: list, mac_key: np.ndarray) -> bool:
    """Read the payload of the open block file `fd` (verified by open_verified) into `parts`, in
    order (e.g. one view per layer, straight into the KV cache), and check what arrived against
    the header's MAC once more: we never change a file in place, but someone else may have
    since it was verified (a flipped byte there would otherwise be a wrong token). False on a
    short read or any difference; `parts` then hold garbage."""
    try:
        head = bytearray(HEADER_SIZE)
        if not _io_exact(os.preadv, fd, [head], 0):
            return False
        h = parse_header(head)
        views = [memoryview(p).cast("B") for p in parts]  # contiguous parts only: no silent copies
        if h is None or sum(v.nbytes for v in views) != h.payload_bytes:
            return False
        meta = bytearray(h.meta_bytes)
        if not _io_exact(os.preadv, fd, [*views, meta], HEADER_SIZE):
            return False
    except OSError:
        return False
    acc, at = np.zeros(3, dtype=np.uint64), 0
    for v in views:
        mac_update(acc, mac_key, np.frombuffer(v, dtype=np.uint8), at)
        at += v.nbytes
    return int(mac_final(acc, mac_key, _u8(head), _u8(meta))) == h.mac


def read_meta(path: str) -> bytes | None:
    """The metadata blob of a block file (MAC not verified: for inspection and indexing only),
    or None unless `path` is a regular file of this format version whose header lengths add up to
    its size exactly and, when its name is a block file name, whose header holds that key."""
    opened = _open_regular(path)
    if opened is None:
        return None
    fd, size = opened
    try:
        h = _read_head(fd, size)
        named = parse_key_hex(os.path.basename(path))
        if (h is None or h.meta_bytes > MAX_META or HEADER_SIZE + h.payload_bytes + h.meta_bytes != size
                or (named is not None and h.key != key_bytes(named))):
            return None
        meta = bytearray(h.meta_bytes)
        return bytes(meta) if _io_exact(os.preadv, fd, [meta], HEADER_SIZE + h.payload_bytes) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_header(path: str) -> Header | None:
    """The header of a block file (nothing verified: for inspection), or None unless `path` is a
    regular file starting with a header of this format version."""
    opened = _open_regular(path)
    if opened is None:
        return None
    fd, size = opened
    try:
        return _read_head(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_head(fd: int, size: int) -> Header | None:
    """The header at the start of an open file of `size` bytes, if it is one of this format version."""
    head = bytearray(HEADER_SIZE)
    return parse_header(head) if size >= HEADER_SIZE and _io_exact(os.preadv, fd, [head], 0) else None


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


_no_direct: set[str] = set()  # block directories' parents whose file system refused O_DIRECT


def _refuse_direct(where: str) -> None:
    if where not in _no_direct:
        _no_direct.add(where)
        logger.info("KVBM disk tier: O_DIRECT refused under %s: writes go through the page cache", where)


def write_block(path: str, key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray, payload: np.ndarray,
                meta: bytes = b"", fsync: bool = False, direct: bool = False) -> None:
    """One block file, encode(...)'s bytes, written without the GIL (write_blocks).
    OSError (BlockRefused for this block alone) when it could not be stored."""
    error = write_blocks([path], [key], fingerprint, mac_key, [payload], [meta], fsync, direct)[0]
    if error is not None:
        raise error


def write_blocks(paths: list, keys: list, fingerprint: bytes, mac_key: np.ndarray, payloads: list, metas: list,
                 fsync: bool = False, direct: bool = False) -> list:
    """Write block files in one call that holds no GIL (tiers/fileio.py write_files): each to a
    temporary file (0600, flock'ed until renamed so scan() knows its writer is alive), renamed into
    place; missing directories are made (0700), a directory that is a symlink or not a directory is
    never written through. Returns None for each stored block, else its OSError (BlockRefused: that
    block's name or directory is taken by something not ours, or its metadata is too large).
    With `direct`, payloads of at least _DIRECT_MIN bytes go with O_DIRECT (no second copy of the
    block in the page cache, but a later read of it comes from the device); where the file system
    refuses (EINVAL), the block goes through the page cache, and so do later ones under that root."""
    errors: list = [None] * len(paths)
    payloads = [np.ascontiguousarray(np.asarray(p, dtype=np.uint8).reshape(-1)) for p in payloads]
    for i, meta in enumerate(metas):
        if len(meta) > MAX_META:
            errors[i] = BlockRefused(errno.EFBIG, f"block metadata of {len(meta)} bytes (at most {MAX_META})")
    todo = [i for i in range(len(paths)) if errors[i] is None]
    for attempt in range(2):
        if not todo:
            break
        status, errs = _write_files([paths[i] for i in todo], [keys[i] for i in todo], fingerprint, mac_key,
                                    [payloads[i] for i in todo], [metas[i] for i in todo], fsync, direct)
        retry = []
        for i, st, err in zip(todo, status, errs):
            if st == fileio.DIR_FAILED and err == errno.ENOENT and attempt == 0:
                retry.append(i)
            elif st:
                errors[i] = _write_error(paths[i], int(st), int(err))
        made = set()
        for i in retry:
            d = os.path.dirname(paths[i])
            try:
                if d not in made:
                    make_missing_dirs(d)
                    made.add(d)
            except OSError as e:
                errors[i] = e
        todo = [i for i in retry if errors[i] is None]
    return errors


def _write_files(paths: Sequence[str], keys: Sequence[tuple[int, int]], fingerprint: bytes, mac_key: np.ndarray,
                 payloads: Sequence[np.ndarray], metas: Sequence[bytes], fsync: bool,
                 direct: bool) -> tuple[np.ndarray, np.ndarray]:
    wheres = [os.path.dirname(os.path.dirname(p)) for p in paths]
    use_direct = np.array([direct and bool(_DIRECT_O) and p.nbytes >= _DIRECT_MIN and w not in _no_direct
                           for p, w in zip(payloads, wheres)], dtype=np.bool_)
    dirs, finals = zip(*(os.path.split(p) for p in paths))
    rand = os.urandom(4 * len(paths)).hex()
    tmps = [f"{name}.tmp{os.getpid()}.{rand[8 * i: 8 * i + 8]}" for i, name in enumerate(finals)]
    heads = np.frombuffer(bytearray(b"".join(
        _HEADER.pack(MAGIC, VERSION, 0, key_bytes(k), fingerprint, p.nbytes, len(m), 0, 0)
        for k, p, m in zip(keys, payloads, metas))), dtype=np.uint8).reshape(len(paths), HEADER_SIZE)
    meta_at = np.zeros(len(metas) + 1, dtype=np.int64)
    np.cumsum([len(m) for m in metas], out=meta_at[1:])
    status, errs, refused = fileio.write_files(
        *_names(dirs), *_names(tmps), *_names(finals), heads,
        np.array([p.ctypes.data for p in payloads], dtype=np.int64), np.array([p.nbytes for p in payloads], dtype=np.int64),
        np.frombuffer(bytearray(b"".join(bytes(m) for m in metas)), dtype=np.uint8), meta_at,
        use_direct, _DIRECT_ALIGN, fsync, mac_key)
    if refused:
        for w in {w for w, d in zip(wheres, use_direct) if d}:
            _refuse_direct(w)
    return status, errs


def _write_error(path: str, status: int, err: int) -> OSError:
    d = os.path.dirname(path)
    if status == fileio.DIR_FAILED:
        if err in (errno.ELOOP, errno.ENOTDIR) and os.path.lexists(d) and not _is_real_dir(d):
            return BlockRefused(err, f"{d} is not a directory the disk tier made (a symlink or a file)")
        return OSError(err, f"cannot open the directory {d}: {os.strerror(err)}")
    if status == fileio.RENAME_FAILED and err == errno.EISDIR:
        return BlockRefused(err, f"{path} is a directory, not a block file")
    what = {fileio.CREATE_FAILED: "create a temporary file for", fileio.WRITE_FAILED: "write",
            fileio.RENAME_FAILED: "rename into place"}.get(status, "store")
    return OSError(err, f"cannot {what} {path}: {os.strerror(err)}")



def file_footprint(payload_bytes: int, meta_bytes: int) -> int:
    """The disk space one block file takes: header, payload and metadata in whole FS_BLOCKs, as
    `du` counts it. Tiers hold bytes_to_use // footprint files, so they stay within it."""
    return -(-(HEADER_SIZE + payload_bytes + meta_bytes) // FS_BLOCK) * FS_BLOCK


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
