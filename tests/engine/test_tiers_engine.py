"""KVBMConnector on a real engine (tiny Llama): CPU and disk tiers, restarts, faults, events."""

import os
import random
import subprocess

import pytest

import msgspec

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.tiers import block_file, inspector

from .helpers import outputs, validate

pytestmark = pytest.mark.engine
rng = random.Random(11)
PROMPT = [rng.randrange(10, 2000) for _ in range(200)]  # 6 full blocks of 32 can come from a tier
HIT = 192
HEALTHY = {"checked": 6, "failed": 0, "other_fingerprint": 0}  # `tiers inspect --verify` of the 6 block files
ONE_BAD = {**HEALTHY, "failed": 1}


def connector(**extra):
    return {"kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def spec(steps, model="llama", events=False, **extra):
    llm = {"max_model_len": 1024}
    if extra is not None:
        llm["kv_transfer_config"] = connector(**extra)
    return {"model": model, "llm": llm, "events": events, "steps": steps}


REPEAT = [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}]


def block_index(path) -> int:
    return msgspec.msgpack.decode(block_file.read_meta(str(path)))["end"] // 32 - 1


@pytest.fixture(scope="module")
def baseline(run_engine):
    """The same prompts without any connector: the tokens every tier run must reproduce."""
    return run_engine({"model": "llama", "llm": {"max_model_len": 1024}, "events": False,
                       "steps": [{"prompts": [PROMPT]}]})


def test_cpu_tier_hit_after_prefix_cache_reset(run_engine, baseline):
    r = run_engine(spec(REPEAT, cpu_bytes_to_use=4 << 20))
    first, again = outputs(r)
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] == HIT  # from the CPU tier
    assert first["tokens"] == again["tokens"] == outputs(baseline)[0]["tokens"]
    assert r["connector"]["cpu"]["busy"] == 0 and r["connector"]["prefetching"] == 0


def test_disk_tier_when_cpu_is_too_small_and_after_restart(run_engine, baseline, tmp_path):
    # the blocks reach disk through a CPU tier that holds them all (with a two-slot tier each
    # block waits for the previous ones' disk writes: how many get stored depends on timing)
    r = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)))
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) == 6
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    # a new engine process with a two-slot CPU tier: two blocks come back through it (prefetched),
    # the other four straight from disk into the KV cache
    tiny_cpu = 2 * 16384
    r = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=tiny_cpu, disk_path=str(tmp_path)))
    (o,) = outputs(r)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == outputs(baseline)[0]["tokens"]
    assert r["connector"]["direct"] == 0 and r["connector"]["disk"]["busy"] == 0
    # a new engine process with the same disk_path: a disk hit, identical tokens; it measures the
    # machine's peaks first (measure_roofline) and leaves nothing of that in the tier directory
    r2 = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path),
                         measure_roofline=True))
    (o,) = outputs(r2)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == outputs(baseline)[0]["tokens"]
    roofline = next(line for line in r2["log"].splitlines() if "KVBMConnector roofline" in line)
    assert all(f"{d} " in roofline for d in ("cpu_store", "cpu_load", "disk_write", "disk_read")), roofline
    assert not [p for p in tmp_path.rglob("*") if ".roofline" in p.name]
    # and with the two-slot CPU tier: requests sharing the prefix in one batch, each loading it
    # (or part of it) straight from disk, or from vLLM's cache once another request computed it
    branch = PROMPT[:150] + [7] * 30
    r3 = run_engine(spec([{"prompts": [PROMPT, branch, PROMPT]}], cpu_bytes_to_use=tiny_cpu,
                         disk_path=str(tmp_path)))
    a, b, c = outputs(r3)
    assert [a["num_cached_tokens"], b["num_cached_tokens"], c["num_cached_tokens"]] == [HIT, 128, HIT]
    assert a["tokens"] == c["tokens"] == outputs(baseline)[0]["tokens"]
    assert r3["connector"]["direct"] == 0 and r3["connector"]["disk"]["busy"] == 0


@pytest.mark.parametrize("cpu", [4 << 20, 2 * 16384], ids=["via-cpu-slots", "direct-to-kv"])
def test_corrupt_truncated_or_missing_disk_blocks_are_misses(run_engine, baseline, tmp_path, cpu):
    run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)))
    files = sorted(tmp_path.rglob("*.kvb"), key=block_index)
    assert [block_index(f) for f in files] == list(range(6))
    # the operator's check of what the engine wrote: healthy, then one flipped payload byte
    assert cli.main(["tiers", "inspect", str(tmp_path), "--verify"]) == 0
    assert inspector.inspect(str(tmp_path), verify=True)["verify"] == HEALTHY
    data = bytearray(files[3].read_bytes())
    data[block_file.HEADER_SIZE + 100] ^= 0xFF  # block 3: one flipped payload byte
    files[3].write_bytes(bytes(data))
    assert inspector.inspect(str(tmp_path), verify=True)["verify"] == ONE_BAD
    assert cli.main(["tiers", "inspect", str(tmp_path), "--verify"]) == 1
    r = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=cpu, disk_path=str(tmp_path)))
    (o,) = outputs(r)
    assert o["num_cached_tokens"] == 3 * 32 and o["tokens"] == outputs(baseline)[0]["tokens"]
    assert "corrupt or missing" in r["log"]
    assert files[3].read_bytes() != bytes(data), "the corrupt block was dropped, then stored anew"
    files[1].write_bytes(files[1].read_bytes()[:100])  # block 1: truncated
    r = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=cpu, disk_path=str(tmp_path)))
    (o,) = outputs(r)
    assert o["num_cached_tokens"] == 32 and o["tokens"] == outputs(baseline)[0]["tokens"]
    files[0].unlink()  # block 0: deleted
    r = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=cpu, disk_path=str(tmp_path)))
    (o,) = outputs(r)
    assert o["num_cached_tokens"] == 0 and o["tokens"] == outputs(baseline)[0]["tokens"]


def test_unwritable_disk_path_keeps_serving(run_engine, baseline, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # every write below it fails, even for root
    r = run_engine(spec(REPEAT, cpu_bytes_to_use=4 << 20, disk_path=str(blocker / "kv")))
    first, again = outputs(r)
    assert again["num_cached_tokens"] == HIT, "the CPU tier keeps working"
    assert first["tokens"] == again["tokens"] == outputs(baseline)[0]["tokens"]
    assert "no more disk writes" in r["log"] and "the disk tier stops storing" in r["log"]


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_keeps_serving(run_engine, baseline, small_tmpfs):
    r = run_engine(spec(REPEAT, cpu_bytes_to_use=4 << 20, disk_path=str(small_tmpfs)))
    first, again = outputs(r)
    assert again["num_cached_tokens"] == HIT and first["tokens"] == outputs(baseline)[0]["tokens"]
    assert "No space left on device" in r["log"]
    assert 0 < len(list(small_tmpfs.rglob("*.kvb"))) < 6


def test_kill_9_during_disk_writes_then_restart(run_engine, baseline, tmp_path):
    import json
    import signal
    import sys
    import time

    prompts = [[rng.randrange(10, 2000) for _ in range(300)] for _ in range(40)]
    d = tmp_path / "run"
    d.mkdir()
    (d / "spec.json").write_text(json.dumps(spec([{"prompts": [p]} for p in prompts],
                                                 cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path / "kv"))))
    proc = subprocess.Popen([sys.executable, "-m", "vllm_kvbm_plugin.testing.engine_run", d / "spec.json",
                             d / "out.json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ})
    deadline = time.time() + 300
    while time.time() < deadline and len(list((tmp_path / "kv").rglob("*.kvb"))) < 20:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (d / "out.json").exists(), "the engine was killed mid-run"
    r = run_engine(spec([{"prompts": [PROMPT]}, {"prompts": prompts[:3]}], cpu_bytes_to_use=4 << 20,
                        disk_path=str(tmp_path / "kv")))
    assert outputs(r)[0]["tokens"] == outputs(baseline)[0]["tokens"]
    assert sum(o["num_cached_tokens"] for o in outputs(r)[1:]) > 0, "what was written survives"
    assert not list((tmp_path / "kv").rglob("*.tmp*")), "partial writes are cleaned up"


def test_models_sharing_a_disk_path_never_hit_each_other(run_engine, tmp_path):
    run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)))
    r = run_engine(spec([{"prompts": [PROMPT]}], model="llama-wide", cpu_bytes_to_use=4 << 20,
                        disk_path=str(tmp_path)))
    assert outputs(r)[0]["num_cached_tokens"] == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2  # one directory per model/layout


def test_many_overlapping_requests_small_cpu_tier(run_engine, tmp_path):
    rng2 = random.Random(3)
    systems = [[rng2.randrange(10, 2000) for _ in range(96)] for _ in range(4)]
    prompts = [rng2.choice(systems) + [rng2.randrange(10, 2000) for _ in range(rng2.randrange(10, 120))]
               for _ in range(64)]
    steps = [{"prompts": prompts[i:i + 16]} for i in range(0, 64, 16)]
    steps = steps + [{"reset": True}] + steps
    plain = run_engine({"model": "llama", "llm": {"max_model_len": 1024}, "events": False, "steps": steps})
    r = run_engine(spec(steps, cpu_bytes_to_use=24 * 16384))  # 24 blocks: far below the working set
    assert [o["tokens"] for o in outputs(r)] == [o["tokens"] for o in outputs(plain)]
    assert sum(o["num_cached_tokens"] for o in outputs(r)[64:]) > 0
    assert r["connector"]["cpu"]["busy"] == 0 and r["connector"]["prefetching"] == 0
    # with a disk tier behind it: more hits (prefetches into the 24 slots, the rest direct from
    # disk), the same tokens, nothing left pinned or open
    d = run_engine(spec(steps, cpu_bytes_to_use=24 * 16384, disk_path=str(tmp_path)))
    assert [o["tokens"] for o in outputs(d)] == [o["tokens"] for o in outputs(plain)]
    hits = sum(o["num_cached_tokens"] for o in outputs(d)[64:])
    assert hits > sum(o["num_cached_tokens"] for o in outputs(r)[64:])
    assert {k: d["connector"][k] for k in ("prefetching", "direct")} == {"prefetching": 0, "direct": 0}
    assert d["connector"]["cpu"]["busy"] == d["connector"]["disk"]["busy"] == 0


def test_tier_events_validate_on_a_mixed_stream(run_engine, tmp_path):
    r = run_engine(spec(REPEAT + [{"prompts": [PROMPT[:100] + [5] * 60]}], events=True,
                        cpu_bytes_to_use=3 * 16384, disk_path=str(tmp_path)))
    v = validate(r)
    assert v.errors == 0, v.report()["first_problems"]
    by = v.report()["stored_by"]
    assert by.get("CPU/g0/full_attention/32", 0) > 0 and by.get("STORAGE/g0/full_attention/32", 0) >= 6, by
    # vLLM's tier vocabulary: GPU, CPU and one STORAGE tier (local, named by its layout root)
    assert {k.split("/")[0] for k in by} == {"GPU", "CPU", "STORAGE"}, by
    storage = [t for t in v.report()["tiers"] if t.startswith("STORAGE")]
    assert len(storage) == 1 and storage[0].startswith("STORAGE:LOCAL:kvbm-disk:"), storage


def test_disk_blocks_of_an_earlier_run_are_announced_after_a_restart(run_engine, tmp_path):
    run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)))
    # a file of another format version (or an unreadable one) is removed at startup, never indexed
    stale = next(tmp_path.rglob("*.kvb")).parent.parent / "ab" / ("ab" * 16 + ".kvb")
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"KVBM\x01\x00" + bytes(200))
    other = [rng.randrange(10, 2000) for _ in range(70)]
    r = run_engine(spec([{"prompts": [other]}], events=True, cpu_bytes_to_use=4 << 20,
                        disk_path=str(tmp_path)))
    v = validate(r)
    assert v.errors == 0, v.report()["first_problems"]
    assert v.report()["stored_by"].get("STORAGE/g0/full_attention/32", 0) >= 6 + 2  # 6 from before, 2 new
    assert "6 announced, 1 unreadable files removed" in r["log"] and not stale.exists()


def test_disk_blocks_after_a_gpu_hit_keep_the_cpu_medium_prefix_closed(run_engine, baseline, tmp_path):
    """A hit that starts after vLLM's own cache, on a block whose parent the CPU tier no longer
    holds: its disk blocks are loaded directly rather than prefetched into CPU slots, so no CPU
    BlockStored ever names a parent the CPU medium does not hold."""
    run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)))
    other = [rng.randrange(10, 2000) for _ in range(70)]
    r = run_engine(spec([{"prompts": [PROMPT[:40]]},  # block 0 from disk, now in vLLM's cache
                         {"prompts": [other]},  # its two blocks push block 0 out of the 2-slot CPU tier
                         {"prompts": [PROMPT]}],  # vLLM hits block 0, blocks 1-5 come from disk
                        events=True, cpu_bytes_to_use=2 * 16384, disk_path=str(tmp_path)))
    *_, o = outputs(r)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == outputs(baseline)[0]["tokens"]
    v = validate(r)
    assert v.errors == 0, v.report()["first_problems"]
