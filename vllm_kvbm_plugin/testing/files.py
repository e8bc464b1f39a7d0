"""Files other processes hold, for the disk tier's tests."""

from __future__ import annotations

import os
import subprocess
import sys


def locked_writer(path: str, seconds: int) -> subprocess.Popen:
    """A process that creates `path` the way a block writer makes its temporary file (O_EXCL,
    0600) and holds an exclusive flock on it for `seconds`; returns once the lock is held."""
    writer = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({path!r}, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        f"time.sleep({seconds})\n")], stdout=subprocess.PIPE, text=True)
    if writer.stdout.readline().strip() != "locked":
        writer.kill()
        raise RuntimeError(f"the writer could not lock {path}")
    return writer


def write_reference(path: str, parts: list) -> None:
    """The block file format written by plain Python (a temporary file renamed into place, 0600,
    missing directories 0700): the reference the disk tier's own writer is compared against."""
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)
