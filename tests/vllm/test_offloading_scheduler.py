"""vLLM's own OffloadingConnector with KVBMOffloadingSpec (our CPU worker, policies, KVBMDiskTier)
inside vLLM's real Scheduler, in-process, on 0.32 and 0.33 (testing.offloading_scheduler): the KV
cache planned and allocated by vLLM, dense (two attention layers) and hybrid (two Mamba-style state
groups in align mode and an attention group, pages padded to one size over the same bytes, as
tiny Qwen3-Next / Granite-4-H give). Every step checks every attention block and the state page
a request resumes from against what a recompute would have written."""

import random

import pytest

from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.offloading_drive import primary_rows
from vllm_kvbm_plugin.testing.offloading_scheduler import OffloadingHarness, OffloadingHarnessConfig

rng = random.Random(29)
P = [rng.randrange(10, 2000) for _ in range(300)]
Q = [rng.randrange(10, 2000) for _ in range(100)]
MODULE = "vllm_kvbm_plugin.offloading"


@pytest.fixture
def make():
    """harness(hybrid, **config): an OffloadingHarness (hybrid: blocks of 64 tokens, hash units of
    16; dense: blocks of 16), closed after the test."""
    made = []

    def harness(hybrid: bool, offloading: dict | None = None, **cfg) -> OffloadingHarness:
        geometry = dict(block_size=64, hash_block_size=16) if hybrid else dict(block_size=16, hash_block_size=None)
        made.append(OffloadingHarness(OffloadingHarnessConfig(
            hybrid=hybrid, offloading={"cpu_bytes_to_use": 8 << 20, **(offloading or {})},
            max_num_batched_tokens=128, **geometry, **cfg)))
        return made[-1]
    yield harness
    for h in made:
        h.close()


def validate(h: OffloadingHarness) -> int:
    v = Validator()
    for b in h.batches:
        v.apply(b)
    return v.errors


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@pytest.mark.parametrize("policy", ["LineageCachePolicy", "MultiLRUCachePolicy"])
def test_repeated_and_shared_prefix_prompts_hit_the_cpu_tier(make, hybrid, policy):
    h = make(hybrid, {"eviction_policy": policy, "cache_policy_module_path": MODULE})
    assert type(h.manager.primary_tier._policy).__name__ == policy
    assert h.serve(P) == 0
    h.reset_prefix_cache()
    # the prompt computed again from its last hash unit (hybrid: a partial tail, the state
    # stored at 288 inside the block of 256..320) or block (dense)
    assert h.serve(P) == 288
    loaded = list(h.workers[0].loaded)
    assert all(n > 0 for n in loaded)  # every group loaded: attention blocks and state pages
    h.reset_prefix_cache()
    # a branch after 256: prefill ran in chunks of 128, so a state was stored at 256
    assert h.serve(P[:256] + Q) == 256
    assert sum(h.workers[0].loaded) > sum(loaded)
    assert validate(h) == 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_cpu_tier_then_disk_tier_and_a_restart(make, hybrid, tmp_path):
    """Hits promoted from KVBMDiskTier after the CPU tier is dropped, then in a new harness (a
    restarted engine) on the same directory. A hybrid prompt's partial tail (its state at 288)
    stays in the CPU tier: vLLM's own file-system tier serves 256 there too."""
    h = make(hybrid, {"disk_path": str(tmp_path)})
    assert h.serve(P) == 0
    h.settle()
    assert list(tmp_path.rglob("*.kvb"))
    h.reset_tiers()
    h.reset_prefix_cache()
    want = 256 if hybrid else 288
    assert h.serve(P) == want
    assert sum(h.workers[0].loaded) > 0
    restarted = make(hybrid, {"disk_path": str(tmp_path)})
    assert restarted.serve(P) == want
    assert all(n > 0 for n in restarted.workers[0].loaded)
    assert validate(restarted) == 0


@pytest.mark.parametrize("hybrid, num_blocks", [(False, 36), (True, 16)], ids=["dense", "hybrid"])
def test_hits_after_preemption(make, hybrid, num_blocks):
    """Three requests that do not fit the KV cache together: vLLM preempts, evicts the preempted
    request's blocks, and the request resumes with loads from the CPU tier."""
    h = make(hybrid, num_blocks=num_blocks, max_model_len=352, max_num_seqs=3)
    for p in ([rng.randrange(10, 2000) for _ in range(250)] for _ in range(3)):
        h.add(p, max_tokens=100)
    h.run(timeout=60)
    assert h.preempted > 0 and sum(h.workers[0].loaded) > 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_vllms_cpu_spec_runs_in_the_same_harness(make, hybrid):
    """vLLM's default CPUOffloadingSpec (its manager; our worker does its copies on this
    platform): the same hits as ours, so the harness compares the two stacks like for like."""
    h = make(hybrid, kvbm_spec=False)
    assert type(h.manager).__name__ == "CPUOffloadingManager"
    h.serve(P)
    h.reset_prefix_cache()
    assert h.serve(P) == 288


def test_kv_oracle_catches_a_wrong_load_and_a_wrong_state(make):
    h = make(True)
    h.serve(P)
    h.reset_prefix_cache()
    rows = primary_rows(h.manager)
    rows[:] = 0  # every chunk of the CPU tier zeroed
    del rows
    with pytest.raises(AssertionError, match="KV of token 0"):
        h.serve(P)

    h = make(True)
    h.serve(P)  # cached in vLLM's prefix cache: the next serve hits there, no tier load
    worker = h.workers[0]
    _, t = worker.state[0]  # the first state layer (its pages share bytes with other groups' blocks)
    t[(t[:, 0] == 288) & (t[:, 2] == 1), 1] += 1  # its state at 288: a wrong token sum
    with pytest.raises(AssertionError, match="state layer 0 at 288"):
        h.serve(P)
