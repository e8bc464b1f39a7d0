"""A tier announces an entry only after its parent: stores that complete out of order (a parent's
bytes arriving after its child's) announce in chain order, and a child whose parent never arrived
(its fetch failed: the server evicted it meanwhile) is stored but never announced, so a router
never sees a block whose parent the tier does not hold. Checked with the validator."""

from vllm.distributed.kv_events import BlockStored, KVEventBatch

from vllm_kvbm_plugin.connector.block_events import Announce
from vllm_kvbm_plugin.connector.tier_manager import TierManager
from vllm_kvbm_plugin.events.types import TIER_CPU
from vllm_kvbm_plugin.events.validator import Validator


def announcer(i: int):
    """Block i of one chain (hashes 1, 2, 3, ...), as the CPU tier would announce it."""
    def announce(name):
        ev = BlockStored(block_hashes=[i + 1], parent_block_hash=i or None, token_ids=[i] * 4, block_size=4,
                         lora_id=None, medium=name.medium, lora_name=None, group_idx=0)
        return Announce([ev], i + 1)
    return announce


def stored(tier: TierManager) -> list[int]:
    return [ev.block_hashes[0] for ev in tier.events if isinstance(ev, BlockStored)]


def valid(tier: TierManager) -> bool:
    v = Validator()
    v.apply(KVEventBatch(ts=0.0, events=tier.take_events()))
    return v.errors == 0


def chain(tier: TierManager, n: int) -> None:
    for i in range(n):
        assert tier.prepare_store(f"k{i}", f"k{i - 1}" if i else None, announcer(i)) is not None


def test_children_completed_before_their_parent_are_announced_after_it():
    tier = TierManager(TIER_CPU, 8, "lru")
    chain(tier, 3)
    tier.complete_store("k2", True)
    tier.complete_store("k1", True)
    assert stored(tier) == []  # nothing while block 0 is missing
    tier.complete_store("k0", True)
    assert stored(tier) == [1, 2, 3]
    assert valid(tier)


def test_a_child_whose_parent_never_arrived_is_kept_but_never_announced():
    tier = TierManager(TIER_CPU, 8, "lru")
    chain(tier, 3)
    tier.complete_store("k0", True)
    tier.complete_store("k1", False)  # its fetch failed
    tier.complete_store("k2", True)
    assert stored(tier) == [1]
    assert tier.lookup("k2")  # still a hit for loads
    assert valid(tier)
