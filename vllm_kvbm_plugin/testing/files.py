"""Files other processes hold, for the disk tier's tests."""

from __future__ import annotations

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
