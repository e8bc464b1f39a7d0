"""EvictionPolicy.victims(n) picks what n rounds of victim()+remove() would, removing nothing."""

import copy
import random

import pytest

from vllm_kvbm_plugin.tiers.policies import make_policy


@pytest.mark.parametrize("name", ["lru", "lineage", "multi_lru"])
def test_victims_match_one_at_a_time_eviction(name):
    rng = random.Random(7)
    pol = make_policy(name)
    keys = []
    for i in range(60):  # a few chains, random touches
        parent = keys[-1] if keys and rng.random() < 0.7 else None
        pol.add(i, parent)
        keys.append(i)
        if rng.random() < 0.3:
            pol.touch(rng.choice(keys))
    pinned = set(rng.sample(keys, 10))
    for n in (1, 5, 20, 50):
        expected, sim = [], copy.deepcopy(pol)
        for _ in range(n):
            v = sim.victim(pinned)
            if v is None:
                expected = None
                break
            expected.append(v)
            sim.remove(v)
        assert pol.victims(n, pinned) == expected
    assert len(pol) == 60  # nothing was removed
    assert pol.victims(51, pinned) is None


def test_lineage_victims_free_a_parent_after_its_last_child():
    pol = make_policy("lineage")
    pol.add("a")
    pol.add("b", "a")
    pol.add("c", "a")
    pol.add("x")
    assert pol.victims(4, set()) == ["b", "c", "a", "x"]
    assert pol.victims(2, {"c"}) == ["b", "x"]  # a keeps its held child c
