"""What a disk or remote tier holds (`vllm-kvbm tiers inspect`): entries, bytes, layouts, an age
histogram and, on request, how many entries fail verification. Read-only: the disk tier's own
readers (block_dir.scan without tidying, block_file.read_header and open_verified: lstat first, no
link followed, only regular files opened) and, for a server, SCAN / STRLEN / OBJECT IDLETIME and GET.

A layout is a directory `<disk_path>/<fingerprint>/r<rank>/` or a key prefix
`kvbm:<version>:<fingerprint>:r<rank>:`; the fingerprint hashes the model, dtype, KV cache spec and
hash unit, so one layout is one model configuration. Disk ages are since a file was written (block
files are never changed in place); a server does not keep that, so remote ages are idle times (since
the last read or write; OBJECT IDLETIME, unknown under an LFU eviction policy).

What --verify can tell without the engine: each entry is read as a load reads it (key = its name,
lengths = its size, MAC of payload and metadata under the tier secret) under the fingerprint its
own header names, and the entries of one rank must all name one fingerprint (a load under that
rank's layout misses the others). That fingerprint is the layout name itself in the
OffloadingConnector's tiers; in KVBMConnector's it also hashes the KV cache tensors' names and
shapes (connector/layout.py tensor_fingerprint), which only the engine knows: whether it is this
model's is not checked here. Verifying needs the tier secret: KVBM_KEY_SECRET, else the one the
tier keeps (the disk tier's secret file, the store's entry).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_kvbm_plugin.log import redact_url
from vllm_kvbm_plugin.tiers import block_dir, block_file, remote_value, resp
from vllm_kvbm_plugin.tiers import secret as tiersecret
from vllm_kvbm_plugin.tiers.mac import mac_key
from vllm_kvbm_plugin.tiers.secret import FILE_NAME as SECRET_FILE

if TYPE_CHECKING:
    import redis

AGES = ((60, "<1m"), (3600, "<1h"), (86400, "<1d"), (7 * 86400, "<7d"), (float("inf"), ">=7d"))
BATCH = 512  # entries verified or asked about per call / round trip
_LAYOUT_NAME = re.compile(r"[0-9a-f]{32}")
_RANK_NAME = re.compile(r"r([0-9]+)")


class Report:
    """The totals, per layout and per age bucket; `progress(n)` is called now and then."""

    def __init__(self, target: str, kind: str, age_basis: str, verify: bool,
                 progress: Callable[[int], None] | None = None) -> None:
        self.out: dict[str, Any] = {"target": target, "kind": kind, "entries": 0, "bytes": 0, "layouts": {},
                    "age": {"basis": age_basis, "histogram": {name: 0 for _, name in AGES}, "unknown": 0,
                            "oldest_s": None},
                    "skipped": 0, "verify": {"checked": 0, "failed": 0, "other_fingerprint": 0} if verify else None}
        self.mac_key: np.ndarray | None = None  # the tier's MAC key, to verify with
        self._progress, self._next = progress, time.monotonic() + 0.5  # short scans print nothing
        # (layout, rank) -> {fingerprint: [entries naming it, of them verified]}
        self._fingerprints: dict[tuple[str, int], dict[bytes, list[int]]] = {}

    def add(self, fingerprint: str, rank: int, nbytes: int, age: float | None) -> None:
        o = self.out
        o["entries"] += 1
        o["bytes"] += nbytes
        lay = o["layouts"].setdefault(fingerprint, {"entries": 0, "bytes": 0, "ranks": []})
        lay["entries"] += 1
        lay["bytes"] += nbytes
        if rank not in lay["ranks"]:
            lay["ranks"].append(rank)
        ages = o["age"]
        if age is None:
            ages["unknown"] += 1
        else:
            ages["histogram"][next(name for limit, name in AGES if age < limit)] += 1
            ages["oldest_s"] = max(ages["oldest_s"] or 0.0, round(age, 1))
        if self._progress is not None and time.monotonic() >= self._next:
            self._next = time.monotonic() + 0.5
            self._progress(o["entries"])

    def verified(self, layout: str, rank: int, fingerprint: bytes | None, ok: bool) -> None:
        """One entry checked: the fingerprint its header names (None: no header of ours) and
        whether it verified under it."""
        v = self.out["verify"]
        v["checked"] += 1
        v["failed"] += not ok
        if fingerprint is not None:
            counts = self._fingerprints.setdefault((layout, rank), {}).setdefault(fingerprint, [0, 0])
            counts[0] += 1
            counts[1] += ok

    def finish(self) -> dict[str, Any]:
        """The report, with each rank's fingerprint: the layout name when its entries name it, else
        the one most of them name; its intact entries naming another one fail too."""
        v = self.out["verify"]
        for (layout, rank), counts in sorted(self._fingerprints.items()):
            name = bytes.fromhex(layout)
            fp = name if name in counts else max(sorted(counts), key=lambda f: counts[f][0])
            others = sum(ok for f, (_, ok) in counts.items() if f != fp)
            v["failed"] += others
            v["other_fingerprint"] += others
            self.out["layouts"][layout].setdefault("fingerprints", {})[str(rank)] = fp.hex()
        return self.out


def _real_dirs(path: str, pattern: re.Pattern[str]) -> tuple[list[str], int]:
    """Names of the real directories (lstat: no symlink) in `path` named by `pattern`, and how many
    other entries there are (the tier secret's regular file is ours: not counted)."""
    names, other = [], 0
    with os.scandir(path) as it:
        for e in it:
            if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                names.append(e.name)
            elif not (e.name == SECRET_FILE and e.is_file(follow_symlinks=False)):
                other += 1
    return sorted(names), other


def inspect_disk(disk_path: str, verify: bool = False,
                 progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The report of a disk tier's directory (the `disk_path` setting)."""
    if not stat.S_ISDIR(os.lstat(disk_path).st_mode):
        raise NotADirectoryError(f"{disk_path} is not a directory (a symlink is not followed)")
    rep = Report(disk_path, "disk", "written", verify, progress)
    mk = _mac_key(lambda: tiersecret.on_disk(disk_path)) if verify else None
    layouts, other = _real_dirs(disk_path, _LAYOUT_NAME)
    rep.out["skipped"] += other
    now = time.time()
    for fp in layouts:
        ranks, other = _real_dirs(os.path.join(disk_path, fp), _RANK_NAME)
        rep.out["skipped"] += other
        for rank in ranks:
            base = os.path.join(disk_path, fp, rank)
            stats: dict[str, Any] = {}
            found = block_dir.scan(base, tidy=False, stats=stats)
            rep.out["skipped"] += stats.get("skipped", 0)
            for (key, size), st in zip(found, stats.get("st", [])):
                rep.add(fp, int(rank[1:]), size, max(0.0, now - st.st_mtime))
            if mk is not None:
                for i in range(0, len(found), BATCH):
                    for named, ok in _verify_files(base, mk, [k for k, _ in found[i:i + BATCH]]):
                        rep.verified(fp, int(rank[1:]), named, ok)
    return rep.finish()


def _mac_key(kept: Callable[[], bytes | None]) -> np.ndarray:
    """The MAC key to verify with: KVBM_KEY_SECRET's, else the secret the tier keeps (`kept()`)."""
    raw = os.environ.get(tiersecret.ENV)
    if raw:
        return mac_key(tiersecret.parse(raw, tiersecret.ENV))
    secret = kept()
    if secret is None:
        raise ValueError(f"verifying needs the tier secret: set {tiersecret.ENV} (the tier keeps none)")
    return mac_key(secret)


def _verify_files(base: str, mk: np.ndarray, keys: list[tuple[int, int]]) -> list[tuple[bytes | None, bool]]:
    """For each block file, the fingerprint its header names (None: no header of this format) and
    whether the file verifies under it and the MAC key, read as a load reads it (open_verified);
    each fd is closed at once."""
    paths = [block_dir.block_path(base, k) for k in keys]
    named: list[bytes | None] = [None] * len(keys)
    ok = [False] * len(keys)
    groups: dict[tuple[bytes, int], list[int]] = {}
    for i, p in enumerate(paths):
        h = block_file.read_header(p)
        if h is not None:
            named[i] = h.fingerprint
            groups.setdefault((h.fingerprint, h.payload_bytes), []).append(i)
    for (fingerprint, plen), idx in groups.items():
        for i, got in zip(idx, block_file.open_verified_blocks([paths[i] for i in idx], [keys[i] for i in idx],
                                                            fingerprint, mk, plen)):
            if got is not None:
                os.close(got[0])
                ok[i] = True
    return list(zip(named, ok))


def inspect_remote(url: str, verify: bool = False,
                   progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The report of the values under `kvbm:` on a Redis / Valkey server (or cluster)."""
    resp.check_url(url)
    client = resp.connect(url)
    rep = Report(redact_url(url), "remote", "idle", verify, progress)
    names: list[bytes] = []
    try:
        if verify:
            rep.mac_key = _mac_key(lambda: _remote_secret(client))
        for name in client.scan_iter(match=b"kvbm:*", count=1000):
            names.append(name)
            if len(names) == BATCH:
                _remote_batch(client, names, rep, verify)
                names = []
        if names:
            _remote_batch(client, names, rep, verify)
    finally:
        client.close()
    return rep.finish()


def _remote_secret(client: redis.Redis | redis.RedisCluster) -> bytes | None:
    kept = client.get(tiersecret.REMOTE_NAME)
    if not isinstance(kept, bytes) or not kept:
        return None
    return tiersecret.parse(kept.decode("ascii", "replace"), tiersecret.REMOTE_NAME)


def _remote_batch(client: redis.Redis | redis.RedisCluster, names: list[bytes], rep: Report, verify: bool) -> None:
    parsed = [remote_value.parse_value_name(n) for n in names]
    ours = [(n, p) for n, p in zip(names, parsed) if p is not None]
    rep.out["skipped"] += len(names) - len(ours)  # our other keys (announcer marker, secret), other versions
    replies = resp.run(client, [c for n, _ in ours for c in (("STRLEN", n), ("OBJECT", "IDLETIME", n))])
    kept = []
    for j, (name, (root, rank, key_hex)) in enumerate(ours):
        size, idle = replies[2 * j], replies[2 * j + 1]
        if isinstance(size, Exception):  # WRONGTYPE: not a value
            rep.out["skipped"] += 1
            continue
        if size == 0:  # evicted or expired meanwhile
            continue
        rep.add(root.decode(), rank, int(size), None if isinstance(idle, Exception) or idle is None else float(idle))
        kept.append((name, root, rank, key_hex))
    if verify and kept:
        assert rep.mac_key is not None  # set by inspect_remote when verifying
        values = resp.run(client, [("GET", n) for n, _, _, _ in kept])
        for v, (_, root, rank, key_hex) in zip(values, kept):
            rep.verified(root.decode(), rank, *_verify_value(v, key_hex, rep.mac_key))


def _verify_value(value: object, key_hex: bytes, mk: np.ndarray) -> tuple[bytes | None, bool]:
    """The fingerprint the value's header names (None: no header of this format) and whether the
    value verifies under it and the MAC key."""
    if not isinstance(value, (bytes, bytearray)) or len(value) < block_file.HEADER_SIZE:
        return None, False
    h = block_file.parse_header(value)
    if h is None:
        return None, False
    key = block_dir.parse_key_hex(key_hex.decode() + block_dir.SUFFIX)
    if key is None:  # not a name of ours
        return h.fingerprint, False
    out = np.empty(min(h.payload_bytes, len(value)), dtype=np.uint8)
    return h.fingerprint, remote_value.read_value(bytes(value), key, h.fingerprint, mk, out)


def inspect(target: str, verify: bool = False, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """A tier's report: `target` is a remote_url or a disk_path."""
    if target.startswith(resp.URL_SCHEMES + resp.CLUSTER_SCHEMES):
        return inspect_remote(target, verify, progress)
    return inspect_disk(target, verify, progress)


def summary(report: dict) -> str:
    """The report for people."""
    r = report
    lines = [f"{r['kind']} tier {r['target']}: {r['entries']} entries, {r['bytes']:,} bytes"
             + (f", {r['skipped']} entries not ours skipped" if r["skipped"] else "")]
    for fp, lay in sorted(r["layouts"].items()):
        ranks = ",".join(str(k) for k in sorted(lay["ranks"]))
        lines.append(f"  layout {fp} (ranks {ranks}): {lay['entries']} entries, {lay['bytes']:,} bytes")
        for rank, got in sorted(lay.get("fingerprints", {}).items(), key=lambda x: int(x[0])):
            lines.append(f"    rank {rank}: fingerprint {got}" + (" (the layout name)" if got == fp else
                         " (KVBMConnector's: with the KV cache tensors' shapes, not checked against a model here)"))
    age = r["age"]
    hist = "  ".join(f"{k} {v}" for k, v in age["histogram"].items())
    lines.append(f"  age ({'since written' if age['basis'] == 'written' else 'idle'}): {hist}"
                 + (f"  unknown {age['unknown']}" if age["unknown"] else ""))
    v = r["verify"]
    if v is not None:
        lines.append(f"  verified {v['checked']}: {v['failed']} failed"
                     + (f" ({v['other_fingerprint']} of another fingerprint than their rank's)"
                        if v["other_fingerprint"] else ""))
        lines.append("  (checked: each entry read as a load reads it, under the fingerprint its header names: key, "
                     "lengths, checksum of payload and metadata; one fingerprint per rank)")
    return "\n".join(lines)
