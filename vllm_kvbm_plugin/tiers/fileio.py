"""Block files read and written in batches without the GIL (the I/O under tiers/block_file.py).

Why: every syscall made from Python releases the GIL and takes it back. With an engine loop that
holds the GIL, taking it back waits up to the switch interval (5 ms), so a pool thread doing
open/stat/pread/close per file from Python waited milliseconds per file (measured: a disk hit
through vLLM's OffloadingConnector took 256 ms instead of ~30). Here one numba `nogil` call does a
whole batch of files (open, type and size check, reads and MAC, or create, lock, writes,
rename, close) calling libc directly: the calling thread takes the GIL back once per batch.

The kernels know nothing of the block format beyond its header offsets; tiers/block_file.py builds
the expected header bytes and the names, and reads the results. libc is called through numba
ExternalFunctions (resolved by symbol name, so the kernels are cached on disk like the others);
pointers are passed as integers (Linux x86-64 / aarch64 calling convention). `statx` (glibc 2.28,
Linux 4.11) gives type and size in a layout that is the same on every architecture.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from vllm_kvbm_plugin.hashing.kernels import _word as _le  # little-endian integer of buf[at:at+n]
from vllm_kvbm_plugin.tiers.mac import block_mac, mac_final, mac_update

HEADER = 64  # the block header's size (tiers/block_file.py HEADER_SIZE)
CHUNK = 256 << 10  # read buffer: small enough to stay in cache
DIRECT_CHUNK = 1 << 20  # direct-write buffer

# read statuses (0: verified)
MISSING, NOT_REGULAR, WRONG_SIZE, BAD = 1, 2, 3, 4
# write statuses (0: in place); the errno comes with them
DIR_FAILED, CREATE_FAILED, WRITE_FAILED, RENAME_FAILED = 1, 2, 3, 4

_RFLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DFLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_F_GETFL, _F_SETFL = 3, 4
_LOCK_EX_NB = 2 | 4
_AT_EMPTY_PATH = 0x1000
_STATX_TYPE_SIZE = 0x1 | 0x200
_S_IFMT, _S_IFREG = 0o170000, 0o100000
_STATX_NLINK_MODE = 0x4 | 0x2
_EINTR, _EINVAL, _EIO, _EEXIST, _EAGAIN = 4, 22, 5, 17, 11
_CREATE_TRIES = 100

_i32, _u32, _ip = types.int32, types.uint32, types.intp


def _libc(name, ret, *args):
    return types.ExternalFunction(name, ret(*args))


_open = _libc("open", _i32, _ip, _i32, _i32)
_openat = _libc("openat", _i32, _i32, _ip, _i32, _i32)
_close = _libc("close", _i32, _i32)
_pread = _libc("pread", _ip, _i32, _ip, _ip, _ip)
_pwrite = _libc("pwrite", _ip, _i32, _ip, _ip, _ip)
_pwritev = _libc("pwritev", _ip, _i32, _ip, _i32, _ip)
_statx = _libc("statx", _i32, _i32, _ip, _i32, _u32, _ip)
_flock = _libc("flock", _i32, _i32, _i32)
_fchmod = _libc("fchmod", _i32, _i32, _u32)
_fsync = _libc("fsync", _i32, _i32)
_fcntl = _libc("fcntl", _i32, _i32, _i32, _ip)
_ftruncate = _libc("ftruncate", _i32, _i32, _ip)
_renameat = _libc("renameat", _i32, _i32, _ip, _i32, _ip)
_unlinkat = _libc("unlinkat", _i32, _i32, _ip, _i32)
_sched_yield = _libc("sched_yield", _i32)
_errno_location = _libc("__errno_location", types.CPointer(_i32))


@intrinsic
def _voidptr(typingctx, addr):
    """The address `addr` (an integer) as a pointer, for numba.carray."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.intp), codegen


@numba.njit(cache=True, nogil=True)
def _errno():
    return numba.carray(_errno_location(), 1)[0]


@numba.njit(cache=True, nogil=True)
def _bytes_at(addr, n):
    return numba.carray(_voidptr(addr), n, dtype=np.uint8)


@numba.njit(cache=True, nogil=True)
def _aligned(n, align):
    raw = np.empty(n + align, dtype=np.uint8)
    skip = (align - raw.ctypes.data % align) % align
    return raw[skip: skip + n]


@numba.njit(cache=True, nogil=True)
def _pread_all(fd, addr, n, off):
    """False when the file ends first or a read fails."""
    while n > 0:
        r = _pread(fd, addr, n, off)
        if r < 0 and _errno() == _EINTR:
            continue
        if r <= 0:
            return False
        addr, n, off = addr + r, n - r, off + r
    return True


@numba.njit(cache=True, nogil=True)
def _pwrite_all(fd, addr, n, off):
    """0, or the errno of the failed write (EIO when nothing could be written)."""
    while n > 0:
        r = _pwrite(fd, addr, n, off)
        if r < 0:
            e = _errno()
            if e == _EINTR:
                continue
            return e
        if r == 0:
            return _EIO
        addr, n, off = addr + r, n - r, off + r
    return 0


# ---- reads ---------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _open_regular(path_addr, plen, max_meta, st, empty):
    """(fd, metadata length, status): a regular file whose size is a header, `plen` payload bytes
    and at most max_meta bytes of metadata. No symlink is followed, no FIFO blocks the open, and
    anything else is closed unread (fd -1)."""
    fd = _open(path_addr, _RFLAGS, 0)
    if fd < 0:
        return -1, 0, MISSING
    if (_statx(fd, empty.ctypes.data, _AT_EMPTY_PATH, _STATX_TYPE_SIZE, st.ctypes.data) != 0
            or np.int64(_le(st, 28, 2)) & _S_IFMT != _S_IFREG):
        _close(fd)
        return -1, 0, NOT_REGULAR
    mlen = np.int64(_le(st, 40, 8)) - HEADER - plen  # a sparse multi-GiB file is never read
    if mlen < 0 or mlen > max_meta:
        _close(fd)
        return -1, 0, WRONG_SIZE
    return fd, mlen, 0


@numba.njit(cache=True, nogil=True)
def _read_verified(fd, expect, plen, meta, dst, buf, mac_key):
    """Chunk by chunk through `buf` (header room + CHUNK, stays in cache): the header comes with
    the first chunk and is checked against `expect` (its first 48 bytes: magic to payload length)
    and the metadata length; each chunk goes into the MAC from cache and is copied to `dst` (an
    address, 0 for none) with streaming stores; then the metadata into `meta`, and the MAC
    against the header's. False for any difference or a short read."""
    mlen = meta.shape[0]
    acc = np.zeros(3, dtype=np.uint64)
    head = np.zeros(HEADER, dtype=np.uint8)
    want = np.uint64(0)
    a = 0
    while a == 0 or a < plen:
        m = min(CHUNK, plen - a)
        if a == 0:
            if not _pread_all(fd, buf.ctypes.data, HEADER + m, 0):
                return False
            for j in range(48):
                if buf[j] != expect[j]:
                    return False
            if _le(buf, 48, 4) != np.uint64(mlen) or _le(buf, 60, 4) != 0:
                return False
            want = _le(buf, 52, 8)
            head[:] = buf[:HEADER]
        elif not _pread_all(fd, buf.ctypes.data + HEADER, m, HEADER + a):
            return False
        data = buf[HEADER: HEADER + m]
        if dst != 0:
            mac_update(acc, mac_key, data, a, _bytes_at(dst + a, m))
        else:
            mac_update(acc, mac_key, data, a)
        a += max(m, 1)
    if mlen and not _pread_all(fd, meta.ctypes.data, mlen, HEADER + plen):
        return False
    return mac_final(acc, mac_key, head, meta) == want


@numba.njit(cache=True, nogil=True)
def read_files(names: np.ndarray, name_at: np.ndarray, expect: np.ndarray, plens: np.ndarray, dsts: np.ndarray,
               keep_open: bool, max_meta: int,
               mac_key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Open, check and read the block files named in `names` (NUL-terminated, starting at
    name_at[i]); expect[i] holds the first 48 header bytes file i must have, plens[i] its payload
    length, dsts[i] the address its payload goes to (0: verify only), mac_key the tier's MAC key
    (tiers/mac.py). Returns (status, fds, metas,
    meta_at): status 0 for a verified file (its metadata is metas[meta_at[i]:meta_at[i+1]]; with
    keep_open its fd stays open in fds[i]), else the reason it is a miss. One GIL release for all."""
    n = plens.shape[0]
    status = np.zeros(n, dtype=np.int32)
    fds = np.full(n, -1, dtype=np.int32)
    meta_at = np.zeros(n + 1, dtype=np.int64)
    st, empty = np.zeros(256, dtype=np.uint8), np.zeros(1, dtype=np.uint8)
    for i in range(n):
        fd, mlen, why = _open_regular(names.ctypes.data + name_at[i], plens[i], max_meta, st, empty)
        fds[i], status[i] = fd, why
        meta_at[i + 1] = meta_at[i] + mlen
    metas = np.empty(meta_at[n], dtype=np.uint8)
    buf = _aligned(HEADER + CHUNK, 64)
    for i in range(n):
        if fds[i] < 0:
            continue
        if not _read_verified(fds[i], expect[i], plens[i], metas[meta_at[i]: meta_at[i + 1]], dsts[i], buf, mac_key):
            status[i] = BAD
        if status[i] or not keep_open:
            _close(fds[i])
            fds[i] = -1
    return status, fds, metas, meta_at


# ---- writes --------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _create_locked(dfd, tmp, st, empty):
    """A new temporary file `tmp` in `dfd`, 0600, flock'ed: its fd, or -errno. A scan() in this or
    another engine removes temporary files nobody holds, and may take one between its creation and
    our flock: then (its lock held, or the file already unlinked) a fresh one is made."""
    for attempt in range(_CREATE_TRIES):
        fd = _openat(dfd, tmp, _WFLAGS, 0o600)
        if fd < 0:
            e = _errno()
            if e == _EEXIST and attempt:  # our unlinked file's name, still held by the scanner
                _sched_yield()
                continue
            return -e
        if _flock(fd, _LOCK_EX_NB) != 0:
            if _errno() == _EAGAIN:  # a scanner holds it, to remove it
                _close(fd)
                _sched_yield()
                continue
            _fchmod(fd, 0o600)  # whatever the umask
            return fd  # a file system without locks: scan() goes by the file's age
        if _statx(fd, empty.ctypes.data, _AT_EMPTY_PATH, _STATX_NLINK_MODE, st.ctypes.data) != 0:
            st[28] = st[29] = 0  # mode unknown: set below
        elif _le(st, 16, 4) == 0:  # removed by a scanner before we locked it
            _close(fd)
            continue
        if np.int64(_le(st, 28, 2)) & 0o7777 != 0o600:
            _fchmod(fd, 0o600)  # the umask took bits away
        return fd
    return -_EAGAIN


@numba.njit(cache=True, nogil=True)
def _write_plain(fd, head, src, plen, meta):
    """Header, payload and metadata in one pwritev (resumed by pwrite after a short write)."""
    iov = np.empty(6, dtype=np.int64)
    iov[0], iov[1], iov[2], iov[3] = head.ctypes.data, HEADER, src, plen
    iov[4], iov[5] = meta.ctypes.data, meta.shape[0]
    n = _pwritev(fd, iov.ctypes.data, 3, 0)
    if n < 0:
        n = 0  # the errno comes again from the pwrite below
    e = 0
    for part in range(3):
        addr, size, at = iov[2 * part], iov[2 * part + 1], (0, HEADER, HEADER + plen)[part]
        done = min(max(n - at, 0), size)
        if e == 0 and done < size:
            e = _pwrite_all(fd, addr + done, size - done, at + done)
    return e


@numba.njit(cache=True, nogil=True)
def _write_direct(fd, head, payload, meta, buf, align):
    """The whole file with O_DIRECT through the aligned `buf`, padded to a multiple of `align` and
    cut back to its exact size: 0, or the errno (EINVAL: this file system or alignment refused)."""
    flags = _fcntl(fd, _F_GETFL, 0)
    if flags < 0 or _fcntl(fd, _F_SETFL, flags | _O_DIRECT) != 0:
        return _EINVAL
    plen, mlen = payload.shape[0], meta.shape[0]
    total = HEADER + plen + mlen
    padded = (total + align - 1) // align * align
    for off in range(0, padded, buf.shape[0]):
        piece = buf[: min(buf.shape[0], padded - off)]
        end = off + piece.shape[0]
        if off < HEADER:
            piece[: HEADER - off] = head[off:]
        a, b = max(off, HEADER), min(end, HEADER + plen)  # file offsets of payload bytes here
        if b > a:
            piece[a - off: b - off] = payload[a - HEADER: b - HEADER]
        a, b = max(off, HEADER + plen), min(end, total)  # metadata bytes
        if b > a:
            piece[a - off: b - off] = meta[a - HEADER - plen: b - HEADER - plen]
        if end > total:
            piece[max(total - off, 0):] = 0
        e = _pwrite_all(fd, piece.ctypes.data, piece.shape[0], off)
        if e:
            return e
    if padded != total and _ftruncate(fd, total) != 0:
        return _errno()
    return 0


@numba.njit(cache=True, nogil=True)
def write_files(dirs: np.ndarray, dir_at: np.ndarray, tmps: np.ndarray, tmp_at: np.ndarray, finals: np.ndarray,
                final_at: np.ndarray, heads: np.ndarray, srcs: np.ndarray, plens: np.ndarray, metas: np.ndarray,
                meta_at: np.ndarray, direct: np.ndarray, align: int, fsync: bool,
                mac_key: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Write block files, each to a new temporary file tmps[i] (0600, flock'ed until renamed) in the
    directory dirs[i] (opened without following a symlink), renamed to finals[i]. heads[i] is the
    header with a zero MAC, filled in here (under mac_key) from the header, the payload (plens[i]
    bytes at address srcs[i]) and metas[meta_at[i]:meta_at[i+1]]. direct[i]: with O_DIRECT through
    an aligned buffer, padded to `align`; a refusal (EINVAL) writes that file and the rest of the
    batch through the page cache. Returns (status, errno of each file, whether O_DIRECT was refused)."""
    n = plens.shape[0]
    status = np.zeros(n, dtype=np.int32)
    errs = np.zeros(n, dtype=np.int32)
    refused = False
    st, empty = np.zeros(256, dtype=np.uint8), np.zeros(1, dtype=np.uint8)
    buf = _aligned(DIRECT_CHUNK if direct.any() else 0, 4096)
    for i in range(n):
        dfd = _open(dirs.ctypes.data + dir_at[i], _DFLAGS, 0)
        if dfd < 0:
            status[i], errs[i] = DIR_FAILED, _errno()
            continue
        tmp = tmps.ctypes.data + tmp_at[i]
        fd = _create_locked(dfd, tmp, st, empty)
        if fd < 0:
            status[i], errs[i] = CREATE_FAILED, -fd
            _close(dfd)
            continue
        head, meta = heads[i], metas[meta_at[i]: meta_at[i + 1]]
        payload = _bytes_at(srcs[i], plens[i])
        tag = block_mac(mac_key, head, payload, meta)
        for j in range(8):
            head[52 + j] = np.uint8((tag >> np.uint64(8 * j)) & np.uint64(0xFF))
        e, done = 0, False
        if direct[i] and not refused:
            e = _write_direct(fd, head, payload, meta, buf, align)
            done = e == 0
            if e == _EINVAL:
                refused = True
                e = 0
                _fcntl(fd, _F_SETFL, _fcntl(fd, _F_GETFL, 0) & ~_O_DIRECT)
                _ftruncate(fd, 0)
        if not done and e == 0:
            e = _write_plain(fd, head, srcs[i], plens[i], meta)
        if e == 0 and fsync and _fsync(fd) != 0:
            e = _errno()
        if e:
            status[i], errs[i] = WRITE_FAILED, e
        elif _renameat(dfd, tmp, dfd, finals.ctypes.data + final_at[i]) != 0:
            status[i], errs[i] = RENAME_FAILED, _errno()
        elif fsync:
            _fsync(dfd)  # the rename too
        if status[i]:
            _unlinkat(dfd, tmp, 0)
        _close(fd)
        _close(dfd)
    return status, errs, refused
