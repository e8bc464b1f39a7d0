"""CPU-tier loads behind the forward, layer by layer, on a real engine under concurrency: every step
batches CPU-tier hits (loaded while each attention waits for its layer) with requests that
compute, hits that end inside a block, hits to a prompt's last token (vLLM writes that token into
the last loaded block), two requests of one batch sharing a prefix that one of them loads,
chunked prefills, and evictions in vLLM's cache and in the CPU tier. Greedy tokens must equal an
engine without connector. ~15 s plus the baseline engine's ~15 s."""

import random

import pytest

from .helpers import outputs

pytestmark = pytest.mark.engine

B = 32
rng = random.Random(29)
SYSTEMS = [[rng.randrange(10, 2000) for _ in range(4 * B)] for _ in range(6)]  # 4 blocks each


def _tail(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def _round(i: int) -> list[list[int]]:
    """16 prompts: each system with a tail ending inside a block, each system cut at a block
    boundary (a hit to its last token), two duplicates in the batch, and two fresh prompts."""
    order = SYSTEMS[i % 6:] + SYSTEMS[:i % 6]
    prompts = [s + _tail(rng.randrange(1, 2 * B)) for s in order]
    prompts += [s[:B * (1 + (i + j) % 4)] for j, s in enumerate(order[:6])]
    prompts += [prompts[1], prompts[7]]
    prompts += [_tail(rng.randrange(B, 4 * B)) for _ in range(2)]
    rng.shuffle(prompts)
    return prompts


ROUNDS = [{"prompts": _round(i)} for i in range(4)]
STEPS = ROUNDS[:2] + [{"reset": True}] + ROUNDS[2:] + [{"reset": True}] + ROUNDS[:1]
# float32 (batch shapes differ with and without hits); vLLM's cache of 40 blocks evicts systems
# between rounds; chunked prefills of 256 tokens spread a batch over several steps
LLM = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 256,
       "num_gpu_blocks_override": 40}
SLOT = 2 * 2 * B * 2 * 32 * 4  # tiny llama, float32: layers x K/V x tokens x heads x head dim x bytes


@pytest.fixture(scope="module")
def plain(run_engine):
    return run_engine({"model": "llama", "llm": LLM, "events": False, "steps": STEPS})


def test_layered_loads_under_concurrency_match_no_connector(run_engine, plain):
    conn = {"kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 20 * SLOT}}
    r = run_engine({"model": "llama", "llm": {**LLM, "kv_transfer_config": conn}, "events": False,
                    "steps": STEPS})
    got, want = outputs(r), outputs(plain)
    assert [o["tokens"] for o in got] == [o["tokens"] for o in want]
    assert "loads run behind the forward, layer by layer" in r["log"]
    assert sum(o["num_cached_tokens"] for o in got[16:]) > sum(o["num_cached_tokens"] for o in want[16:])
    assert r["connector"]["cpu"]["busy"] == 0
