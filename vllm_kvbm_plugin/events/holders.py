"""Announce-once bookkeeping: a key is announced when its first holder appears and removed when its
last holder goes, so a consumer never sees a duplicate store or a premature removal."""

from __future__ import annotations

from collections.abc import Hashable


class Holders:
    """Reference counts of announced keys."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}

    def hold(self, key: Hashable) -> bool:
        """Add a holder; True when this is the first one (announce the key)."""
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        return n == 0

    def release(self, key: Hashable) -> bool:
        """Drop a holder; True when it was the last one (announce the removal)."""
        n = self._count[key] - 1
        if n:
            self._count[key] = n
        else:
            del self._count[key]
        return n == 0

    def clear(self) -> None:
        self._count.clear()

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._count
