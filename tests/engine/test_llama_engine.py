"""A non-hybrid model: with KV events on, the plugin must leave vLLM's stream exactly as it is."""

import random

import pytest

pytestmark = pytest.mark.engine

rng = random.Random(5)
PROMPTS = [[rng.randrange(10, 2000) for _ in range(rng.randrange(40, 300))] for _ in range(6)]
SCENARIO = {
    "model": "llama",
    "llm": {"num_gpu_blocks_override": 20, "max_model_len": 512},
    "steps": [{"prompts": [p, p[:50] + [7] * 20]} for p in PROMPTS] + [{"reset": True},
                                                                       {"prompts": PROMPTS[:2]}],
}


def without_ts(result):
    return [[r["seq"], r["batch"][1], r["batch"][2]] for r in result["events"]]


def test_event_stream_equals_vanilla_vllm(run_engine):
    plugin = run_engine(SCENARIO)
    vanilla = run_engine(SCENARIO, env={"VLLM_PLUGINS": ""})  # vLLM loads no general plugin
    assert "vllm-kvbm-plugin" in plugin["log"] and "vllm-kvbm-plugin" not in vanilla["log"]
    assert len(plugin["events"]) > 5
    assert any(e["type"] == "BlockRemoved" for r in plugin["events"] for e in r["batch"][1])
    assert without_ts(plugin) == without_ts(vanilla)
    assert plugin["steps"] == vanilla["steps"]
    assert plugin["hash_block_size"] == vanilla["hash_block_size"] == 32
