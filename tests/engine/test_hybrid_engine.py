"""Tiny Qwen3-Next (GatedDeltaNet + attention) on a real engine: --block-size 32 is inflated to 160."""

import random

import pytest

from vllm_kvbm_plugin.events.types import AllBlocksCleared, BlockRemoved, BlockStored

from .helpers import batches, validate

pytestmark = pytest.mark.engine
ATTN = 1

rng = random.Random(0)
P100 = [rng.randrange(10, 2000) for _ in range(100)]
A = [rng.randrange(10, 2000) for _ in range(400)]
B = A[:200] + [rng.randrange(10, 2000) for _ in range(200)]
FILLERS = [[rng.randrange(10, 2000) for _ in range(rng.randrange(300, 700))] for _ in range(6)]
SCENARIO = {
    "model": "qwen3next",
    "llm": {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 1024},
    "steps": [{"prompts": [P100]}, {"prompts": [A]}, {"prompts": [B]}]
    + [{"prompts": [f]} for f in FILLERS]
    + [{"reset": True}, {"prompts": [A]}],
}


def flat(result):
    return [e for _, b in batches(result) for e in b.events]


def fine(events, group=ATTN):
    return [e for e in events if isinstance(e, BlockStored) and e.group_idx == group and e.block_size == 32]


def chain_tokens(events, last_hash):
    """Tokens along the announced parent chain ending at last_hash (unit events only)."""
    parent, tokens = {}, {}
    for e in events:
        prev = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            parent[h], tokens[h] = prev, e.token_ids[i * 32:(i + 1) * 32]
            prev = h
    out, h = [], last_hash
    while h is not None:
        out = tokens[h] + out
        h = parent[h]
    return out


@pytest.fixture(scope="module")
def with_plugin(run_engine):
    return run_engine(SCENARIO)


@pytest.fixture(scope="module")
def without_plugin(run_engine):
    return run_engine(SCENARIO, env={"KVBM_DISABLE": "1"})


def test_hash_granularity_is_preserved_everywhere(with_plugin):
    r = with_plugin
    assert r["block_size"] == 160 and r["hash_block_size"] == 32
    assert r["worker_hash_block_size"] == [32]
    assert [g["hash_block_size"] for g in r["group_metadata"]] == [32, 32]
    assert [g["block_size"] for g in r["group_metadata"]] == [160, 160]
    assert "hash granularity preserved at 32" in r["log"]


def test_short_prompt_yields_three_chained_units(with_plugin):
    first = fine(flat(with_plugin))[0]  # the 100-token prompt runs first
    assert len(first.block_hashes) == 3
    assert first.parent_block_hash is None
    assert first.token_ids == P100[:96]
    assert first.kv_cache_spec_kind == "full_attention"


def test_stream_validates_with_evictions_and_reset(with_plugin):
    r = with_plugin
    assert r["subscriber"]["lost"] == 0
    v = validate(r)
    assert v.errors == 0, v.report()
    events = flat(r)
    assert any(isinstance(e, BlockRemoved) and e.group_idx == ATTN for e in events), "no eviction"
    cleared = max(i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared))
    before, after = fine(events[:cleared]), fine(events[cleared:])
    # prompt A (400 tokens) is cached up to its last hash boundary (384) before and after the reset,
    # as one unbroken chain of 12 units carrying A's tokens
    assert chain_tokens(after, after[-1].block_hashes[-1]) == A[:384]
    assert any(chain_tokens(before, h) == A[:384] for e in before for h in e.block_hashes)
    # B shares A's first 200 tokens: its units 0..5 are A's and were not announced again
    assert any(chain_tokens(before, h) == B[:384] for e in before for h in e.block_hashes)


def test_plugin_changes_no_tokens(with_plugin, without_plugin):
    def tokens(r):
        return [[o["tokens"] for o in s.get("outputs", [])] for s in r["steps"]]

    assert tokens(with_plugin) == tokens(without_plugin)


def test_without_plugin_vllm_hashes_per_inflated_block(without_plugin):
    """vLLM's native behaviour: hashes per 160-token block, nothing for a 100-token prompt."""
    r = without_plugin
    assert r["hash_block_size"] == 160 and r["worker_hash_block_size"] == [160]
    assert "hash_block_size" not in r["group_metadata"][0]
    first_seq_events = batches(r)[0][1].events
    assert all(e.block_size == 160 for e in first_seq_events if isinstance(e, BlockStored))
    assert not fine(flat(r))


def test_a_full_report_reannounces_the_hit_per_unit(run_engine):
    # kv_cache_report_mode "full" (sampling extra_args): A's second request hits its first 384
    # tokens (A's last hash boundary, inside block 2); vLLM alone would crash the engine core here
    again = A + [7] * 40
    result = run_engine({"model": "qwen3next", "llm": SCENARIO["llm"], "steps": [
        {"prompts": [A]}, {"prompts": [again], "extra_args": {"kv_cache_report_mode": "full"}}]})
    assert result["steps"][1]["outputs"][0]["num_cached_tokens"] == 384
    events = flat(result)
    heads = [e for e in fine(events) if e.parent_block_hash is None]
    assert [len(e.block_hashes) for e in heads] == [10, 12]  # A's full blocks, then the hit again
    assert chain_tokens(events, heads[1].block_hashes[-1]) == A[:384]
