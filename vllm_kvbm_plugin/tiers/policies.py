"""Eviction policies for tier indexes: which unpinned entry leaves first.

- `lru`: least recently used.
- `lineage`: least recently used among leaves only: an entry whose child (the next block of some
  prefix) is still held is never evicted, so a tier never keeps a suffix without its prefix.
- `multi_lru`: frequency levels driven by a TinyLFU count-min sketch with decay; evicts from the
  lowest level first, and refuses to admit a newcomer colder than the entry it would displace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable

POLICIES = ("lru", "lineage", "multi_lru")


class EvictionPolicy:
    """Tracks the held keys of one tier. `parent` is the previous block's key of the same prefix."""

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        raise NotImplementedError

    def touch(self, key: Hashable) -> None:
        raise NotImplementedError

    def add_chain(self, keys: Iterable[Hashable], parent: Hashable | None = None) -> None:
        """add() of each of `keys` in order, each the child of the one before it (the first of
        `parent`): a request's run of new blocks in one call."""
        for key in keys:
            self.add(key, parent)
            parent = key

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        """touch() of each of `keys` in order."""
        for key in keys:
            self.touch(key)

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def victim(self, pinned: Container[Hashable]) -> Hashable | None:
        """The key to evict next (not removed), skipping pinned keys; None if all are pinned."""
        raise NotImplementedError

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        """Whether `key` may displace `victim` (only TinyLFU says no)."""
        return True

    def victims(self, n: int, pinned: Container[Hashable]) -> list[Hashable] | None:
        """The next `n` keys to evict, in order, as `n` calls of victim()+remove() would pick them,
        without removing any; None when fewer than `n` can go (for all-or-nothing evictions)."""
        chosen: list = []
        taken: set = set()
        skip = InEither(pinned, taken)
        while len(chosen) < n:
            key = self.victim(skip)
            if key is None:
                return None
            chosen.append(key)
            taken.add(key)
        return chosen


class LRU(EvictionPolicy):
    """Least recently stored or touched goes first (the default `eviction_policy`)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def add_chain(self, keys: Iterable[Hashable], parent: Hashable | None = None) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            order[key] = None
            move(key)

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Container[Hashable]) -> Hashable | None:
        for key in self._order:
            if key not in pinned:
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class Lineage(EvictionPolicy):
    """LRU over leaves; a parent becomes a leaf (and the coldest one) when its last child goes."""

    def __init__(self) -> None:
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}  # how many children each parent has
        self._leaves: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        if key in self._parent:
            self.touch(key)
            return
        parent = parent if parent in self._parent else None
        self._parent[key] = parent
        self._children[key] = 0
        self._leaves[key] = None
        if parent is not None:
            if self._children[parent] == 0:
                self._leaves.pop(parent, None)
            self._children[parent] += 1

    def touch(self, key: Hashable) -> None:
        if key in self._leaves:
            self._leaves.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        self._children.pop(key)
        self._leaves.pop(key, None)
        if parent is not None and parent in self._children:
            self._children[parent] -= 1
            if self._children[parent] == 0:
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)

    def victim(self, pinned: Container[Hashable]) -> Hashable | None:
        for key in self._leaves:
            if key not in pinned:
                return key
        return None

    def victims(self, n: int, pinned: Container[Hashable]) -> list[Hashable] | None:
        # As remove() would: a parent whose last child goes becomes the coldest leaf, next in line.
        chosen: list[Hashable] = []
        gone: dict[Hashable, int] = {}
        freed: list[Hashable] = []
        leaves = iter(self._leaves)
        while len(chosen) < n:
            key = freed.pop() if freed else next(leaves, None)
            if key is None:
                return None
            if key in pinned:
                continue
            chosen.append(key)
            parent = self._parent[key]
            if parent is not None and parent in self._children:
                gone[parent] = gone.get(parent, 0) + 1
                if gone[parent] == self._children[parent]:
                    freed.append(parent)
        return chosen

    def __len__(self) -> int:
        return len(self._parent)


class CountMinSketch:
    """4-row count-min sketch with periodic halving (TinyLFU's reset), so old popularity fades."""

    _SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)

    def __init__(self, width: int = 4096, sample_size: int | None = None) -> None:
        self.width = 1 << max(4, (width - 1).bit_length())
        self.rows = [[0] * self.width for _ in self._SEEDS]
        self.sample_size = sample_size or 10 * self.width
        self.additions = 0

    def _slots(self, key: Hashable) -> list[int]:
        h = hash(key) & 0xFFFFFFFFFFFFFFFF
        mask = self.width - 1
        return [((h ^ (h >> 29)) * s >> 40) & mask for s in self._SEEDS]

    def increment(self, key: Hashable) -> int:
        slots = self._slots(key)
        est = min(row[i] for row, i in zip(self.rows, slots))
        for row, i in zip(self.rows, slots):
            if row[i] == est and row[i] < 255:  # conservative update, 8-bit counters
                row[i] += 1
        self.additions += 1
        if self.additions >= self.sample_size:
            self.rows = [[c >> 1 for c in row] for row in self.rows]
            self.additions //= 2
        return est + 1

    def estimate(self, key: Hashable) -> int:
        return min(row[i] for row, i in zip(self.rows, self._slots(key)))


class MultiLRU(EvictionPolicy):
    """LRU queues per frequency level (level = log2 of the TinyLFU estimate)."""

    def __init__(self, levels: int = 4, sketch_width: int = 4096) -> None:
        self.sketch = CountMinSketch(sketch_width)
        self._levels: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(levels)]
        self._level_of: dict[Hashable, int] = {}

    def _place(self, key: Hashable, freq: int) -> None:
        level = min(len(self._levels) - 1, freq.bit_length() - 1)
        old = self._level_of.get(key)
        if old is not None:
            del self._levels[old][key]
        self._levels[level][key] = None
        self._level_of[key] = level

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        self._place(key, self.sketch.increment(key))

    def add_counted(self, key: Hashable) -> None:
        """add() for a key whose access record_miss() already counted (not counted twice)."""
        self._place(key, max(1, self.sketch.estimate(key)))

    def touch(self, key: Hashable) -> None:
        freq = self.sketch.increment(key)
        if key in self._level_of:
            self._place(key, freq)

    def remove(self, key: Hashable) -> None:
        level = self._level_of.pop(key, None)
        if level is not None:
            del self._levels[level][key]

    def victim(self, pinned: Container[Hashable]) -> Hashable | None:
        for level in self._levels:
            for key in level:
                if key not in pinned:
                    return key
        return None

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        return self.sketch.estimate(key) >= self.sketch.estimate(victim)

    def record_miss(self, key: Hashable) -> None:
        """Count an access to a key the tier does not hold (TinyLFU learns from misses too)."""
        self.sketch.increment(key)

    def __len__(self) -> int:
        return len(self._level_of)


class InEither:
    """`in` either of two containers, without building their union."""

    def __init__(self, a: Container[Hashable], b: Container[Hashable]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: Hashable) -> bool:
        return key in self.a or key in self.b


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "lineage":
        return Lineage()
    if name == "multi_lru":
        return MultiLRU()
    raise ValueError(f"unknown eviction_policy {name!r}; valid: {', '.join(POLICIES)}")
