import io
import subprocess
import sys

from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.types import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch


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


def test_event_tools_do_not_import_vllm():
    code = ("import sys; import vllm_kvbm_plugin.events.validator, vllm_kvbm_plugin.events.subscriber, "
            "vllm_kvbm_plugin.events.recording, vllm_kvbm_plugin.cli; assert 'vllm' not in sys.modules and "
            "'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('vllm', 'torch')))")
    subprocess.run([sys.executable, "-c", code], check=True)
