"""Reading the results of vllm_kvbm_plugin.testing.engine_run in engine tests."""

import io
import json

from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.validator import Validator


def batches(result) -> list:
    """The recorded KV event stream as (seq, KVEventBatch)."""
    return list(recording.read(io.StringIO("\n".join(json.dumps(r) for r in result["events"]))))


def validate(result) -> Validator:
    v = Validator()
    for seq, b in batches(result):
        v.apply(b, seq)
    return v


def outputs(result) -> list[dict]:
    return [o for s in result["steps"] for o in s.get("outputs", [])]
