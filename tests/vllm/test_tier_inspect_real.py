"""`vllm-kvbm tiers inspect` on what the real tiers wrote under vLLM's tiering manager (KVBMDiskTier's
files, KVBMRemoteTier's values on a real server): counts and layout match the tier, and a value the
inspector finds corrupt is one the tier will not serve."""

import numpy as np
import pytest

from vllm_kvbm_plugin.testing import offloading_drive
from vllm_kvbm_plugin.testing.offloading_drive import chunk_key, payload
from vllm_kvbm_plugin.tiers import block_file
from vllm_kvbm_plugin.tiers import inspector

CHUNK = 4096


def Tiered(kind, **opts) -> offloading_drive.Tiered:
    return offloading_drive.Tiered({"type": kind, "module_path": "vllm_kvbm_plugin.offloading", **opts}, 8, CHUNK)


def keys_of(name, n):
    return [chunk_key(f"{name}{i}") for i in range(n)]


def test_the_disk_tiers_files(tiered, tmp_path):
    t = tiered("KVBMDiskTier", path=str(tmp_path), bytes_to_use=1 << 20)
    keys = keys_of("d", 5)
    t.store(keys)
    r = inspector.inspect(str(tmp_path), verify=True)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert r["entries"] == 5 == len(files) and r["bytes"] == sum(f.stat().st_size for f in files)
    assert list(r["layouts"]) == [t.tier.fingerprint.hex()] and r["layouts"][t.tier.fingerprint.hex()]["ranks"] == [0]
    assert r["verify"] == {"checked": 5, "failed": 0, "other_fingerprint": 0} and r["skipped"] == 0
    with open(files[0], "r+b") as f:  # one payload byte flipped
        f.seek(block_file.HEADER_SIZE + 7)
        b = f.read(1)
        f.seek(block_file.HEADER_SIZE + 7)
        f.write(bytes([b[0] ^ 1]))
    r = inspector.inspect(str(tmp_path), verify=True)
    assert r["verify"] == {"checked": 5, "failed": 1, "other_fingerprint": 0}
    served = t.load(keys)
    assert sum(v is None for v in served.values()) >= 1  # the tier does not serve it either
    assert all(v is None or np.array_equal(v, payload(k)) for k, v in served.items())


def test_the_remote_tiers_values(tiered, server):
    pytest.importorskip("redis")
    t = tiered("KVBMRemoteTier", url=server.url)
    t.store(keys_of("r", 4))
    r = inspector.inspect(server.url, verify=True)
    assert r["kind"] == "remote" and r["entries"] == 4
    assert list(r["layouts"]) == [t.tier.fingerprint.hex()]
    assert r["verify"] == {"checked": 4, "failed": 0, "other_fingerprint": 0}
    assert r["bytes"] == sum(server.client().strlen(k) for k in server.client().keys("kvbm:*:r0:*"))
