"""Reading the results of vllm_kvbm_plugin.testing.engine_run in engine tests."""

import io
import json

from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.validator import Validator


def batches(result) -> list:
    """The recorded KV event stream as (seq, KVEventBatch)."""
    return list(recording.read(io.StringIO("\n".join(json.dumps(r) for r in result["events"]))))


def validate(*results) -> Validator:
    """One run's stream, or several runs' streams one after another as one router would merge
    them (each its own publisher: a remote tier is one index shared by all)."""
    v = Validator()
    for i, result in enumerate(results):
        for seq, b in batches(result):
            v.apply(b, seq, stream=i if len(results) > 1 else None)
    return v


def outputs(result) -> list[dict]:
    return [o for s in result["steps"] for o in s.get("outputs", [])]


def index_predictions(result, prompts: list, config=None, instance="engine", index=None,
                      extra_keys: list | None = None) -> list[tuple[int, int]]:
    """(what events.index.KVIndex predicts, num_cached_tokens served) per output, the index fed
    the batches recorded before that output's step was sent (`prompts`: the token ids of every
    output, in order; `config`: the index's WorkerConfig; `index`: one already fed other
    instances' streams, to which this run is `instance`; `extra_keys`: per output, its per-unit
    keys as `KVIndex.match` takes them, or None)."""
    from vllm_kvbm_plugin.events.index import KVIndex

    if index is None:
        index = KVIndex(config)
    index.add_instance(instance, config, ranks=(0,))  # matched before its first event
    recorded, applied, out = batches(result), 0, []
    prompts = iter(prompts)
    keys = iter(extra_keys or [])
    for step in result["steps"]:
        if "outputs" not in step:
            continue
        for seq, b in recorded[applied:step["events_before"]]:
            index.apply(instance, b, seq)
        applied = step["events_before"]
        for o in step["outputs"]:
            m = index.match(next(prompts), extra_keys=next(keys, None)).get((instance, 0))
            out.append((m.tokens if m else 0, o["num_cached_tokens"]))
    for seq, b in recorded[applied:]:  # the rest of the stream: the index as a router has it now
        index.apply(instance, b, seq)
    return out
