"""The tier events of a request's tokens, built like vLLM builds its own (same hashes, parents,
token ids, extra keys, LoRA fields), so a router can join them with the GPU events; and the
`Announce` a tier entry keeps them in until its bytes are in place."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import ExternalBlockHash, to_event_extra_keys

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.connector.layout import KV, EntryKind, Layout
from vllm_kvbm_plugin.events.types import Tier

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request


class Announce(msgspec.Struct, gc=False):
    """The BlockStored events of one tier entry (one per group), published once its bytes are in
    place; no events: an internal entry, never announced. Kept as long as the entry, so like the
    entry untracked by the garbage collector, with events whose fields are tuples (`compact`)."""
    events: tuple
    vhash: ExternalBlockHash | None = None  # vLLM's event hash of the entry, for BlockRemoved
    announced: bool = False


def compact(event: BlockStored) -> BlockStored:
    """An event to keep with a tier entry: its lists as tuples, which (holding only atoms) the
    garbage collector stops tracking, where a list stays tracked, and walked, for good."""
    extra = event.extra_keys
    return msgspec.structs.replace(event, block_hashes=tuple(event.block_hashes), token_ids=tuple(event.token_ids),
                                   extra_keys=None if extra is None else tuple(extra))


Announcer = Callable[[Tier], Announce]  # the events of an entry, named for a tier


def renamed(events: Iterable[BlockStored], name: Tier) -> tuple[BlockStored, ...]:
    """`events` named for another tier (the copy of their entry there)."""
    return tuple(msgspec.structs.replace(ev, medium=name.medium, locality=name.locality, ownership=name.ownership)
                 for ev in events)


NOTHING: Announcer = lambda name: Announce(())  # noqa: E731 - an internal entry, never announced


class EventBuilder:
    """Builds the events of a request's tokens for the tiers that store them. Owned by
    SchedulerSide (EngineCore process), which hands its `announcer`s to the tiers' stores."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.to_event_hashes = compat.event_hash_converter()
        self.pool: BlockPool | None = None  # vLLM's BlockPool, bound with the KV cache manager (extra keys, medium)

    def step_events(self, request: Request, first: int) -> "StepEvents":
        """The events of the request's whole KV blocks from block `first` on that one step stores
        (`StepEvents.announcer(i)` per block), built together once the first of them is needed."""
        return StepEvents(self, request, first)

    def announcer(self, request: Request, start: int, end: int, kind: EntryKind) -> Announcer:
        """The BlockStored events (one per group of `kind`) of the tokens [start, end), named for
        the tier that stores them."""
        return lambda name: self._announce(request, start, end, kind, name)

    def _announce(self, request: Request, start: int, end: int, kind: EntryKind, name: Tier) -> Announce:
        hashes, unit = request.block_hashes, self.layout.hash_unit
        if len(hashes) < end // unit:
            return Announce(())
        if start:  # one conversion for both
            parent, vhash = self.to_event_hashes([hashes[start // unit - 1], hashes[end // unit - 1]])
        else:
            parent, vhash = None, self.to_event_hashes([hashes[end // unit - 1]])[0]
        keys = None
        if compat.has_extra_keys(request):
            keys = to_event_extra_keys([compat.block_extra_keys(self.pool, request, start, end, 0)[0]])
        # tuples, not lists: the events are kept with the tier entry (see compact)
        extra = tuple(keys) if keys else (None,)
        token_ids = tuple(request.all_token_ids[start:end])
        events = []
        for g in self.layout.groups[kind]:
            event = compat.block_stored_event(
                self.pool, request, block_hashes=(vhash,), parent_block_hash=parent, token_ids=token_ids,
                block_size=end - start, group_idx=g, extra_keys=extra, medium=name.medium)
            event.locality, event.ownership = name.locality, name.ownership
            event.kv_cache_spec_kind = self.layout.spec_kinds[g]
            events.append(event)
        return Announce(tuple(events), vhash)


class StepEvents:
    """The KV events of consecutive whole blocks of one request stored in one step (owned by the
    tiers' pending stores via `announcer`). Built for all the blocks asked for so far at once, when
    the first is needed (its store landed): one hash conversion for the run, not two per block, and
    one slice of the token ids; each block's events equal EventBuilder._announce's."""

    __slots__ = ("builder", "request", "first", "upto", "built")

    def __init__(self, builder: EventBuilder, request: Request, first: int) -> None:
        self.builder, self.request, self.first = builder, request, first
        self.upto = first  # blocks [first, upto) were handed out
        self.built: dict[Tier, list[Announce]] = {}  # tier name -> [Announce of block first, first + 1, ...]

    def announcer(self, block: int) -> Announcer:
        if block >= self.upto:
            self.upto = block + 1
        return BlockAnnouncer(self, block)

    def announcers(self, block: int, n: int) -> list[Announcer]:
        """announcer() of blocks block, ..., block + n - 1."""
        if block + n > self.upto:
            self.upto = block + n
        return [BlockAnnouncer(self, b) for b in range(block, block + n)]

    def announce(self, block: int, name: Tier) -> Announce:
        built = self.built.get(name)
        if built is None:
            built = self.built[name] = []
        if block - self.first >= len(built):  # blocks handed out since the last build (a write-through)
            built += self._build(name, self.first + len(built))
        return built[block - self.first]

    def _build(self, name: Tier, first: int) -> list[Announce]:
        """The Announces of blocks [first, upto) for tier `name`."""
        b, request, upto = self.builder, self.request, self.upto
        layout = b.layout
        B, r = layout.block_size, layout.units_per_block
        hashes = request.block_hashes
        have = min(upto, len(hashes) // r)  # blocks with every hash (the rest: no events, as _announce)
        if have <= first:
            return [Announce(())] * (upto - first)
        picked = [hashes[(i + 1) * r - 1] for i in range(first - 1 if first else 0, have)]
        converted: list[ExternalBlockHash | None] = [] if first else [None]  # the first block's parent
        converted += b.to_event_hashes(picked)
        extras = compat.has_extra_keys(request)
        tokens = tuple(request.all_token_ids[first * B : have * B])
        pool = b.pool
        # one event per group built in full; each block's a copy with its own hashes, tokens, keys
        templates = []
        for g in layout.groups[KV]:
            event = compat.block_stored_event(pool, request, block_hashes=(), parent_block_hash=None, token_ids=(),
                                              block_size=B, group_idx=g, extra_keys=(None,), medium=name.medium)
            event.locality, event.ownership = name.locality, name.ownership
            event.kv_cache_spec_kind = layout.spec_kinds[g]
            templates.append(event)
        replace = msgspec.structs.replace
        out = []
        if len(templates) == 1 and not extras:  # the usual case, without a generator per block
            t = templates[0]
            for j in range(have - first):
                vhash = converted[j + 1]
                out.append(Announce((replace(t, block_hashes=(vhash,), parent_block_hash=converted[j],
                                             token_ids=tokens[j * B : (j + 1) * B]),), vhash))
            return out + [Announce(())] * (upto - have)
        for j in range(have - first):
            parent, vhash = converted[j], converted[j + 1]
            extra: tuple[Any, ...] = (None,)
            if extras:
                start = (first + j) * B
                extra = tuple(to_event_extra_keys([compat.block_extra_keys(pool, request, start, start + B, 0)[0]])
                              or (None,))
            token_ids = tokens[j * B : (j + 1) * B]
            out.append(Announce(tuple(replace(t, block_hashes=(vhash,), parent_block_hash=parent, token_ids=token_ids,
                                              extra_keys=extra) for t in templates), vhash))
        return out + [Announce(())] * (upto - have)


class BlockAnnouncer:
    """The announcer of one block of a StepEvents (cheaper to make than a closure)."""

    __slots__ = ("events", "block")

    def __init__(self, events: StepEvents, block: int) -> None:
        self.events, self.block = events, block

    def __call__(self, name: Tier) -> Announce:
        return self.events.announce(self.block, name)
