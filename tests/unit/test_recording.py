import io
import json
import subprocess
import sys

from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.types import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    storage_tier,
    tier_of,
)


def sample():
    return KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[1, 2**63 + 5], parent_block_hash=b"\x00\xff", token_ids=[1] * 64,
                    block_size=32, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[None, [["img", -3]]], group_idx=1, kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[b"\x01\x02"], medium="GPU", group_idx=1)])


def test_msgpack_and_jsonl_round_trip():
    b = sample()
    assert decode_batch(encode_batch(b)) == b
    buf = io.StringIO()
    recording.write(buf, [(3, b)])
    buf.seek(0)
    assert list(recording.read(buf)) == [(3, b)]


def test_tier_fields_are_in_the_json_lines_only_when_set():
    disk = storage_tier("disk-0f3a")
    b = KVEventBatch(ts=0.0, events=[
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                    lora_name=None, medium=disk.medium, locality=disk.locality, ownership=disk.ownership),
        BlockRemoved(block_hashes=[1], medium=disk.medium, locality=disk.locality, ownership=disk.ownership),
        BlockRemoved(block_hashes=[2], medium=MEDIUM_CPU)])
    line = recording.dump_line(0, b)
    stored, gone, cpu = json.loads(line)["batch"][1]
    for ev in (stored, gone):
        assert (ev["medium"], ev["locality"], ev["ownership"]) == ("STORAGE", "LOCAL", "disk-0f3a")
    assert "locality" not in cpu and "ownership" not in cpu and cpu["medium"] == "CPU"
    assert list(recording.read([line])) == [(0, b)]


def test_legacy_disk_recordings_still_read():
    line = ('{"seq":7,"batch":[1.0,[{"type":"BlockStored","block_hashes":[5],"parent_block_hash":null,'
            '"token_ids":[1,2],"block_size":2,"lora_id":null,"medium":"DISK","lora_name":null}],null]}')
    [(seq, b)] = recording.read([line])
    assert seq == 7 and b.events[0].medium == MEDIUM_DISK and tier_of(b.events[0]).label == "DISK"


def test_event_tools_do_not_import_vllm():
    code = ("import sys; import vllm_kvbm_plugin.events.validator, vllm_kvbm_plugin.events.subscriber, "
            "vllm_kvbm_plugin.events.recording, vllm_kvbm_plugin.cli; assert 'vllm' not in sys.modules and "
            "'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('vllm', 'torch')))")
    subprocess.run([sys.executable, "-c", code], check=True)
