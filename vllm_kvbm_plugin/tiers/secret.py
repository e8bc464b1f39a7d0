"""The tier secret: the 128-bit key of the block keys (hashing/spec.py, docs/block-keys.md) and of
the MAC every stored block carries (tiers/mac.py): whoever holds it can plant KV the tiers serve.

Everyone who shares a tier must hash with the same secret, and nobody else may know it: then an
outsider choosing token ids can neither compute a key nor make two prompts collide. Where it
comes from, first match wins:

1. `KVBM_KEY_SECRET`: 32 hex characters (a fleet sets one for all its instances);
2. with a remote tier (`remote_url`): the store's entry `kvbm-key-secret`, written once by the
   first instance (SET NX) and read back by all. With a disk tier too, the secret is also kept in
   its file (3.), and that file's secret is the one offered to the store: a server restarted empty
   then gets the fleet's secret back from the first instance that starts, and the disk tier's
   entries stay reachable (a new secret would move every block to a new tier directory, the old
   one left behind). If the server cannot be reached at startup, the remote tier is off for this
   process (its keys would not match the fleet's) and the next source decides;
3. with a disk tier (`disk_path`): the file `kvbm-key-secret` at the root of disk_path, written
   once (0600, published by a hard link so nobody reads half a file) and read with the disk tier's
   checks (no symlink followed, a regular file of exactly the right size). A malformed file is a
   startup error, never replaced; a disk_path that cannot be written (the disk tier then fails
   too) falls through to 4;
4. else a random secret for this process: the CPU tier lives no longer than the process.

KVBMConnector's scheduler side loads it, once per process; its workers follow that decision
(connector/layout.py TierDecision), never load it themselves.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Mapping

from vllm_kvbm_plugin.log import get_logger, redact_url

logger = get_logger("tiers.secret")

ENV = "KVBM_KEY_SECRET"
REMOTE_NAME = "kvbm-key-secret"  # outside the kvbm: names of block values (the announcer scans those)
FILE_NAME = "kvbm-key-secret"
SECRET_BYTES = 16
_FILE_SIZE = 2 * SECRET_BYTES + 1  # hex and a newline
_HEX = re.compile(r"[0-9a-fA-F]{32}")
_RFLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FORMAT = "32 hex characters (16 random bytes, e.g. from `openssl rand -hex 16`)"


@dataclasses.dataclass(frozen=True)
class TierSecret:
    """The key that makes block keys unguessable to outsiders, and where it came from."""

    key: bytes = dataclasses.field(repr=False)
    source: str  # "env", "remote", "disk" or "process"
    remote_off: bool = False  # a remote tier is configured but its secret could not be read


def parse(text: str, where: str) -> bytes:
    """The 16 bytes of a secret spelled as 32 hex characters; a ValueError naming `where` else."""
    if not isinstance(text, str) or not _HEX.fullmatch(text.strip()):
        got = f"{len(text.strip())} characters" if isinstance(text, str) else type(text).__name__
        raise ValueError(f"{where}: a block-key secret is {_FORMAT}; got something else ({got}; the value "
                         "is not shown)")
    return bytes.fromhex(text.strip())


def from_remote(url: str, offer: bytes | None = None) -> bytes:
    """The secret kept in the remote store (written once, `offer` or a new one: the first writer
    wins, all read it back). Raises the client's error when the server cannot be used, ValueError
    when the entry is malformed."""
    from vllm_kvbm_plugin.tiers import resp

    client = resp.connect(url)
    try:
        client.set(REMOTE_NAME, (offer or secrets.token_bytes(SECRET_BYTES)).hex(), nx=True)
        value = client.get(REMOTE_NAME)
    finally:
        client.close()
    if value is None:  # evicted between the two calls (a full server): the next start writes one
        raise ConnectionError(f"{REMOTE_NAME} vanished right after it was written")
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return parse(text, f"the remote entry {REMOTE_NAME} at {redact_url(url)} (delete it only if no instance "
                       "uses it)")


def on_disk(disk_path: str | None) -> bytes | None:
    """The secret in `<disk_path>/kvbm-key-secret`, None if there is none yet (or no disk tier)."""
    if not disk_path or not os.path.lexists(os.path.join(disk_path, FILE_NAME)):
        return None
    return _read(os.path.join(disk_path, FILE_NAME))


def keep_on_disk(disk_path: str, key: bytes) -> None:
    """Make `<disk_path>/kvbm-key-secret` hold `key` (the remote store's): written once, or replaced
    (a new file renamed over it) when it holds another secret, whose disk entries are unreachable
    from now on."""
    if from_disk(disk_path, key) != key:
        path = os.path.join(disk_path, FILE_NAME)
        tmp = f"{path}.tmp{os.getpid()}.{secrets.token_hex(4)}"
        _create(tmp, key.hex() + "\n")
        os.replace(tmp, path)
        logger.warning("KVBMConnector: the remote tier's block-key secret differs from the one in %s; the "
                       "file now holds the remote's, and the disk tier's entries under the old one are "
                       "unreachable (their tier directory under %s stays until removed)", path, disk_path)


def from_disk(disk_path: str, key: bytes | None = None) -> bytes:
    """The secret in `<disk_path>/kvbm-key-secret`, written first (`key`, or a new one) if missing."""
    path = os.path.join(disk_path, FILE_NAME)
    if not os.path.lexists(path):
        os.makedirs(disk_path, mode=0o700, exist_ok=True)
        _write_once(path, (key or secrets.token_bytes(SECRET_BYTES)).hex() + "\n")
    return _read(path)


def _write_once(path: str, text: str) -> None:
    """Create `path` with `text` unless it exists: a new temporary file (0600, O_EXCL, no symlink
    followed) published by a hard link, which fails if another process published first. Where hard
    links are not supported, the file is created O_EXCL in place (readers wait for its size)."""
    tmp = f"{path}.tmp{os.getpid()}.{secrets.token_hex(4)}"
    _create(tmp, text)
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        pass  # another process won: its file is the secret
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        try:
            _create(path, text)
        except FileExistsError:
            pass
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _create(name: str, text: str) -> None:
    """A new file `name` (0600, O_EXCL, no symlink followed) holding `text`, synced."""
    fd = os.open(name, _WFLAGS, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: str) -> bytes:
    where = f"disk tier secret file {path} (remove it only if no engine uses this disk_path)"
    for _ in range(40):  # a file being written in place (no hard links) is short for a moment
        try:
            fd = os.open(path, _RFLAGS)
        except OSError as e:
            raise ValueError(f"{where}: cannot be opened without following a link: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{where}: not a regular file")
            if st.st_size == _FILE_SIZE:
                data = os.pread(fd, _FILE_SIZE + 1, 0)
                break
            if st.st_size > _FILE_SIZE or time.time() - st.st_mtime > 2:
                raise ValueError(f"{where}: {st.st_size} bytes, expected {_FILE_SIZE} ({_FORMAT} and a newline)")
        finally:
            os.close(fd)
        time.sleep(0.05)
    else:
        raise ValueError(f"{where}: stays shorter than {_FILE_SIZE} bytes")
    if len(data) != _FILE_SIZE or not data.endswith(b"\n"):
        raise ValueError(f"{where}: expected {_FORMAT} and a newline")
    if stat.S_IMODE(st.st_mode) & 0o077:
        logger.warning("KVBM: %s is mode %o: other users can read the block-key secret", path,
                       stat.S_IMODE(st.st_mode))
    return parse(data[:-1].decode("ascii", "replace"), where)


def load(remote_url: str | None, disk_path: str | None, env: Mapping[str, str] | None = None) -> TierSecret:
    """The secret for a connector with these tiers (see the module docstring), not cached."""
    raw = (os.environ if env is None else env).get(ENV)
    if raw:
        return TierSecret(parse(raw, ENV), "env")
    remote_off = False
    if remote_url:
        try:
            key = from_remote(remote_url, on_disk(disk_path))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to use the server at startup
            remote_off = True
            logger.warning("KVBM: cannot read the block-key secret from the remote tier %s (%s: %s); "
                           "the remote tier is off for this process (its keys would not match the other "
                           "instances'); set %s to share a secret without asking the server", redact_url(remote_url),
                           type(e).__name__, e, ENV)
        else:
            if disk_path:
                try:
                    keep_on_disk(disk_path, key)
                except OSError as e:  # an unusable disk_path: the disk tier is off too (the workers find out)
                    logger.warning("KVBMConnector: cannot keep the block-key secret in %s (%s)", disk_path, e)
            return TierSecret(key, "remote")
    if disk_path:
        try:
            return TierSecret(from_disk(disk_path), "disk", remote_off)
        except OSError as e:  # an unusable disk_path: the disk tier is off too (the workers find out)
            logger.warning("KVBMConnector: cannot keep the block-key secret in %s (%s); this process uses "
                           "a secret of its own", disk_path, e)
    return TierSecret(secrets.token_bytes(SECRET_BYTES), "process", remote_off)


_loaded: dict = {}
_lock = threading.Lock()


def tier_secret(remote_url: str | None, disk_path: str | None) -> TierSecret:
    """load(), once per process and configuration: the scheduler and a worker living in one process
    use one secret, even a random one, and ask the server once."""
    cache_key = (os.environ.get(ENV), remote_url, os.path.abspath(disk_path) if disk_path else None)
    with _lock:
        s = _loaded.get(cache_key)
        if s is None:
            s = _loaded[cache_key] = load(remote_url, disk_path)
        return s
