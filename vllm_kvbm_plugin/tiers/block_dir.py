"""Where block files lie: the directory tree of a tier, its paths, scan and tidy, its private
directories.

File: <root>/<layout fingerprint hex>/r<rank>/<key hex[:2]>/<key hex>.kvb, directories 0700,
files 0600, names derived only from hex. The file format itself: tiers/block_file.py.

Foreign content: anything can end up in a directory (FIFOs, sockets, device nodes, symlinks,
directories or sparse multi-GiB files named like block files, other names, files of another
version). No open follows a symlink or blocks (`O_NOFOLLOW | O_NONBLOCK`); scan() only lstat()s
(it opens nothing but temporary files) and lists regular files named `<key>.kvb` in their
`<key hex[:2]>/` directory. Everything else is left alone, never followed, never removed, symlinks
included: it is not ours. A writer holds an flock on its temporary file until it is
renamed into place, so scan() removes only temporary files nobody writes any more (a crash's
leftovers), even for writers in another engine, container or host sharing the directory (a writer
whose new file a scan took before the flock makes another).
Directories the tier makes are 0700 whatever the umask; prepare_block_dir() also tightens the
existing ones it owns below the user's disk_path (never disk_path itself).
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from collections.abc import Iterator

from vllm_kvbm_plugin.log import get_logger

logger = get_logger("disk")

SUFFIX = ".kvb"
# open a file to read: never follow a link, never block (a FIFO)
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DFLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KEY_NAME = re.compile(r"[0-9a-f]{32}\.kvb")
_TEMP_NAME = re.compile(r"[0-9a-f]{32}\.kvb\.tmp[0-9]+(\.[0-9a-f]+)?")  # <block name>.tmp<pid>.<random>
_PREFIX_NAME = re.compile(r"[0-9a-f]{2}")
_STALE_TEMP = 600  # s: without file locks, a temporary file untouched that long has no writer


def key_hex(key: tuple[int, int]) -> str:
    return f"{key[0]:016x}{key[1]:016x}"


def parse_key_hex(name: str) -> tuple[int, int] | None:
    """The key of a block file name, exactly as block_path spells it (else None)."""
    if not _KEY_NAME.fullmatch(name):
        return None
    return int(name[:16], 16), int(name[16:32], 16)


def block_dir(root: str, fingerprint: bytes, rank: int) -> str:
    return os.path.join(root, fingerprint.hex(), f"r{rank}")


def block_path(base: str, key: tuple[int, int]) -> str:
    h = key_hex(key)
    return os.path.join(base, h[:2], h + SUFFIX)


def scan(base: str, tidy: bool = True, stats: dict | None = None) -> list[tuple[tuple[int, int], int]]:
    """(key, file size) of every regular file named like a block file in its key-prefix directory
    under `base`, found by lstat alone: symlinks, directories, FIFOs, sockets, devices and other
    names are skipped and left alone. Temporary files whose writer is gone are removed (`tidy`;
    off for a read-only look). `stats`, if given, gets the lstat result of each block file under
    "st" and a count of the skipped entries under "skipped"."""
    out: list[tuple[tuple[int, int], int]] = []
    try:
        for sub, dfd in _prefix_dirs(base):
            try:
                with os.scandir(dfd) as it:
                    for e in it:
                        _scan_entry(e, sub, dfd, out, tidy, stats)
            except OSError:
                pass  # this prefix directory only
    except OSError:
        pass
    return out


def _prefix_dirs(base: str) -> Iterator[tuple[str, int]]:
    """(name, fd) of each key-prefix directory of `base`, found by lstat and opened without
    following links; each fd is closed when the caller moves on. OSError if `base` cannot be opened."""
    bfd = os.open(base, _DFLAGS)
    try:
        with os.scandir(bfd) as it:
            names = [e.name for e in it if _PREFIX_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        for name in names:
            try:
                fd = os.open(name, _DFLAGS, dir_fd=bfd)
            except OSError:
                continue  # replaced meanwhile: not followed
            try:
                yield name, fd
            finally:
                os.close(fd)
    finally:
        os.close(bfd)


def _scan_entry(e: os.DirEntry, prefix: str, dfd: int, out: list, tidy: bool, stats: dict | None) -> None:
    try:
        if _KEY_NAME.fullmatch(e.name):
            st = e.stat(follow_symlinks=False)
            if e.name.startswith(prefix) and stat.S_ISREG(st.st_mode):
                out.append((parse_key_hex(e.name), st.st_size))
                if stats is not None:
                    stats.setdefault("st", []).append(st)
                return
        elif _TEMP_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False):
            if tidy:
                _remove_if_abandoned(e.name, dfd)
            return
    except OSError:
        return  # gone meanwhile
    if stats is not None:
        stats["skipped"] = stats.get("skipped", 0) + 1


def _remove_if_abandoned(name: str, dfd: int) -> None:
    """Remove a temporary file that no writer holds any more (a crash's leftover)."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dfd)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and not _held_by_writer(fd, st):
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _held_by_writer(fd: int, st: os.stat_result) -> bool:
    """Whether a writer still holds the temporary file open as `fd`. Writers flock it until it is
    renamed into place, so a live writer in another engine, container or host keeps its file;
    where flock fails (no locks on that file system) age decides."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return time.time() - st.st_mtime < _STALE_TEMP


# ---- a whole tier directory (the leftovers of an earlier key spec) -----------------------------
_RANK_NAME = re.compile(r"r[0-9]+")


def remove_tier_dir(disk_path: str, name: str) -> tuple[int, str | None]:
    """Remove the tier directory `<disk_path>/<name>` if it holds nothing but ours: rank directories
    of key-prefix directories of block files, no temporary file held by a writer. Every open is
    relative to an open directory and follows no link. Returns (block files removed, None), or
    (0, what is not ours) when anything else, a symlink anywhere included, leaves it whole;
    (0, None) when there is no such directory."""
    try:
        top = os.open(disk_path, _DFLAGS)
    except OSError:
        return 0, None
    try:
        try:
            tfd = os.open(name, _DFLAGS, dir_fd=top)
        except OSError:
            return 0, None  # missing, or not a real directory: not ours
        try:
            foreign = _walk_tier_dir(tfd, remove=False)
            if foreign:
                return 0, str(foreign)
            removed = int(_walk_tier_dir(tfd, remove=True) or 0)
        finally:
            os.close(tfd)
        _rmdir_if_empty(name, top)
        return removed, None
    finally:
        os.close(top)


def _walk_tier_dir(tfd: int, remove: bool) -> int | str | None:
    """remove=False: a description of the first thing in the tree that is not ours, or None.
    remove=True: remove the tree's block files and directories (not the top); the count of files."""
    removed = 0
    for rank, rfd in _own_subdirs(tfd, _RANK_NAME):
        if isinstance(rfd, str):
            return rfd
        try:
            for prefix, pfd in _own_subdirs(rfd, _PREFIX_NAME):
                if isinstance(pfd, str):
                    return f"{rank}/{pfd}"
                try:
                    for e in os.scandir(pfd):
                        temp = _TEMP_NAME.fullmatch(e.name)
                        if not ((temp or _KEY_NAME.fullmatch(e.name)) and e.name.startswith(prefix)
                                and e.is_file(follow_symlinks=False)):
                            if not remove:
                                return f"{rank}/{prefix}/{e.name}"
                            continue
                        if temp and _writer_holds(e.name, pfd):
                            if not remove:
                                return f"a file being written ({rank}/{prefix}/{e.name})"
                            continue
                        if remove:
                            try:
                                os.unlink(e.name, dir_fd=pfd)
                                removed += 1
                            except OSError:
                                pass
                finally:
                    os.close(pfd)
                if remove:
                    _rmdir_if_empty(prefix, rfd)
        finally:
            os.close(rfd)
        if remove:
            _rmdir_if_empty(rank, tfd)
    return removed if remove else None


def _rmdir_if_empty(name: str, dfd: int) -> None:
    try:
        os.rmdir(name, dir_fd=dfd)
    except OSError:  # not empty (something not ours stays), or gone
        pass


def _own_subdirs(dfd: int, pattern: re.Pattern[str]) -> Iterator[tuple[str, int | str]]:
    """(name, fd) of each entry of the directory `dfd`: an fd when it is a real directory named by
    `pattern`, else a description of it (the caller stops there). The caller closes the fds."""
    for e in os.scandir(dfd):
        if not (pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)):
            yield e.name, f"{e.name!r}, not one of our directories"
            return
        try:
            yield e.name, os.open(e.name, _DFLAGS, dir_fd=dfd)
        except OSError:
            yield e.name, f"{e.name!r}, which cannot be opened as a directory"
            return


def _writer_holds(name: str, dfd: int) -> bool:
    """Whether a writer holds the temporary file `name` of the directory `dfd`."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dfd)
    except OSError:
        return False
    try:
        return _held_by_writer(fd, os.fstat(fd))
    except OSError:
        return False
    finally:
        os.close(fd)


# ---- private directories ---------------------------------------------------------------------
def make_private_dir(root: str, path: str) -> None:
    """Make `path` and every directory between it and `root` (the user's disk_path) 0700, whatever
    the umask: missing ones are created, existing ones this user owns are tightened (logged), other
    users' are left as they are (logged). `root` itself is never changed (created 0700 when it is
    missing) and no symlink below it is followed: OSError when a level is not a real directory."""
    root, path = os.path.abspath(root), os.path.abspath(path)
    rel = os.path.relpath(path, root)
    if rel == os.curdir or rel.split(os.sep)[0] == os.pardir:
        raise ValueError(f"{path} is not below {root}")
    if not os.path.lexists(root):
        make_missing_dirs(root)
    cur = root
    for part in rel.split(os.sep):
        cur = os.path.join(cur, part)
        if _mkdir_private(cur):
            continue
        try:
            fd = os.open(cur, _DFLAGS)
        except OSError as e:
            raise OSError(e.errno, f"disk tier: {cur} is not a directory (a symlink or a file?): "
                                   f"{e.strerror}") from e
        try:
            _tighten(fd, cur)
        finally:
            os.close(fd)


def prepare_block_dir(root: str, base: str) -> None:
    """At startup, for the rank directory `base` below the user's `root` (disk_path): make_private_dir,
    and tighten base's existing key-prefix directories the same way (one log line)."""
    make_private_dir(root, base)
    tightened = 0
    for name, fd in _prefix_dirs(base):
        tightened += _tighten(fd, os.path.join(base, name), quiet=True)
    if tightened:
        logger.info("KVBM disk tier: %d key-prefix directories under %s were open to other users; "
                    "now 0700", tightened, base)


def _tighten(fd: int, path: str, quiet: bool = False) -> bool:
    """Take group and other bits off the directory `fd` if this user owns it; True when changed."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077:
        return False
    if st.st_uid != os.geteuid():
        logger.warning("KVBM disk tier: %s is mode %o and belongs to uid %d, not us: left as it is",
                       path, mode, st.st_uid)
        return False
    os.fchmod(fd, mode & 0o700)
    if not quiet:
        logger.info("KVBM disk tier: %s was mode %o, open to other users; now %o", path, mode, mode & 0o700)
    return True


def _mkdir_private(path: str) -> bool:
    """Create the directory `path` 0700 whatever the umask; False when something exists there."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    fd = os.open(path, _DFLAGS)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # the umask took bits away
    finally:
        os.close(fd)
    return True


def make_missing_dirs(path: str) -> None:
    """Create the missing directories of `path`, parents first, each 0700; existing ones are left
    as they are."""
    missing, p = [], os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    for p in reversed(missing):
        _mkdir_private(p)
