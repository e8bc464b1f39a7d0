"""`vllm-kvbm announce`: the remote tier's KV events, published once per tier instead of once per
instance, from the server's own view of its keys.

Every instance of a fleet writes entries into one Redis / Valkey server, and the server evicts
any of them when it likes; no instance sees all writes or any eviction. This process does: it
subscribes to the server's keyspace notifications for our keys (`kvbm:<format>:<layout root>:
r<rank>:<key>`, see tiers/remote_value.py) and publishes, in vLLM's wire format (its own
ZmqEventPublisher: PUB socket, sequence numbers, ROUTER replay socket), BlockStored when an
entry's values are in place and BlockRemoved when one is deleted, expired or evicted. The events
are the ones the writing instance would have announced: each value's metadata carries them
(tiers/block_file.py encode_meta), read with two small GETRANGEs (header, then metadata), never the
payload. An entry is announced after its parent, as the instances announce their tiers.

Notifications are fire-and-forget (nothing is replayed to a subscriber that was away, and a
flush sends none), so after every (re)connect, whenever our marker key vanished (FLUSHALL,
FLUSHDB, a restart) and every `rescan_interval`, a SCAN of our prefix is diffed with what was
announced: entries gone are removed (AllBlocksCleared when none of them is left), new ones
announced.

A Redis Cluster (`redis+cluster://seed,...`) sends each node's notifications on that node only,
so the announcer holds a connection and a subscription per master, a marker key on each, scans
each, and reads a value's metadata from the master owning its slot. When the masters or their
slots change (a node added or removed, a failover, a reshard), it reconnects and rescans.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, MEDIUM_STORAGE, SPARSE_KINDS, storage_tier
from vllm_kvbm_plugin.events.server_nodes import ServerNodes, TopologyChanged
from vllm_kvbm_plugin.log import get_logger, redact_url
from vllm_kvbm_plugin.tiers import block_file, remote_value

logger = get_logger("announcer")

NOTIFY_FLAGS = "Kg$xe"  # keyspace channel; generic (del, rename), string (set), expired, evicted
_WRITTEN = frozenset({b"set", b"setrange", b"append", b"restore", b"rename_to", b"copy_to", b"move_to"})
_GONE = frozenset({b"del", b"expired", b"evicted", b"rename_from", b"move_from", b"unlink"})
_SCAN_COUNT = 1000
_READ_BATCH = 256  # metadata reads per pipelined round trip


EventId = tuple[bytes, bytes]  # an entry's (root hex, key hex)
Slot = tuple[Any, int, Any]  # (ownership, group, vLLM hash) an announced event holds
Publish = Callable[[list[Any]], None]  # takes vLLM BlockStored/BlockRemoved/AllBlocksCleared events


class EventPublisher(Protocol):
    """What we use of vLLM's EventPublisher (this module imports vLLM only inside functions)."""

    def publish(self, events: Any) -> None: ...

    def shutdown(self) -> None: ...


class ServerRefused(RuntimeError):
    """The server cannot send what the announcer needs (keyspace notifications off and CONFIG SET
    not allowed): retrying will not help."""


@dataclasses.dataclass
class _Entry:
    """One entry of the tier: its values (one per tensor-parallel rank) and its events."""
    ranks: set[int]
    events: list[Any] | None = None  # BlockStored per group, read from rank 0's metadata (until announced)
    end: int = 0
    slots: list[Slot] | None = None  # once announced: (ownership, group, vLLM hash) per group, for removals

    @property
    def announced(self) -> bool:
        return self.slots is not None


def entry_of(name: bytes) -> tuple[tuple[bytes, bytes], int] | None:
    """((layout root hex, key hex), rank) of one of our value names in the current format."""
    parsed = remote_value.parse_value_name(name)
    return None if parsed is None else ((parsed[0], parsed[2]), parsed[1])


def value_name(eid: tuple[bytes, bytes], rank: int) -> bytes:
    return remote_value.value_name(eid[0], rank, eid[1])


class RemoteAnnouncer:
    """The remote tier's event source. `publish(events)` gets each batch of vLLM events (vLLM's
    BlockStored / BlockRemoved / AllBlocksCleared); `run(stop)` serves until `stop` is set,
    reconnecting (and rescanning) whenever the server fails.

    Runs in its own process (`vllm-kvbm announce`, one per remote tier, cli.py), never inside an
    engine (tests run it in theirs): owns the server connections and subscriptions (`ServerNodes`) and
    what it has announced (`entries`, the hashes held, entries waiting for their parent), which
    each rescan is diffed with."""

    PROBE_TIMEOUT = 5.0  # s: our marker's notification must arrive within this
    MARKER_TTL = 3600  # s: refreshed every check_interval

    def __init__(self, url: str, publish: Publish, rescan_interval: float = 60.0,
                 check_interval: float = 1.0) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        self.url, self.publish = url, publish
        self.where = redact_url(url)  # what log lines and errors show
        self.rescan_interval, self.check_interval = rescan_interval, check_interval
        self._stored, self._removed, self._cleared = BlockStored, BlockRemoved, AllBlocksCleared
        self._decode = msgspec.msgpack.Decoder(BlockStored).decode
        self.entries: dict[EventId, _Entry] = {}
        self.world: dict[bytes, int] = {}  # root hex -> ranks seen (max rank + 1)
        self.held: dict[Slot, EventId] = {}  # the entry announced with each slot
        self.waiting: dict[Slot, set[EventId]] = {}  # parent's slot -> entries announced after it
        self.marker = f"kvbm:announcer:{uuid.uuid4().hex}"
        self.counters = {"stored": 0, "removed": 0, "cleared": 0, "rescans": 0, "connects": 0}
        self.connected = threading.Event()  # set while subscribed and rescanned
        self._out: list[Any] = []

    # ---- the loop ------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        backoff, failing = 0.5, False
        while not stop.is_set():
            connects = self.counters["connects"]
            try:
                self._serve(stop)
                return
            except ServerRefused:
                raise
            except TopologyChanged as e:  # at once: notifications of a new master are being missed
                logger.info("announcer: %s; subscribing again and rescanning", e)
                failing, backoff = False, 0.5
                continue
            except Exception as e:  # any client error: reconnect (then rescan), one log line per outage
                if self.counters["connects"] > connects:
                    failing, backoff = False, 0.5
                if not failing:
                    logger.warning("announcer: server %s failed (%s: %s); reconnecting", self.where,
                                   type(e).__name__, e)
                    failing = True
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _serve(self, stop: threading.Event) -> None:
        nodes = ServerNodes(self.url)
        pubsubs: list = []
        try:
            for client in nodes.clients:
                client.ping()
            config = "; ".join(self._enable_notifications(c) for c in nodes.clients)
            prefix = f"__keyspace@{nodes.db}__:".encode()
            for client in nodes.clients:  # before the scan: no change falls between them
                pubsubs.append(client.pubsub(ignore_subscribe_messages=True))
                pubsubs[-1].psubscribe(prefix + b"kvbm:*")
            markers = nodes.markers(self.marker)
            marked = self._mark(nodes, markers)
            try:
                early = self._probe(pubsubs, len(prefix), config, markers) if marked else {}
            except ServerRefused:
                nodes.run([("delete", m) for m in markers])
                raise
            self._rescan(nodes)
            if early:
                self._apply(nodes, early)
            self.counters["connects"] += 1
            self.connected.set()
            logger.info("announcer: subscribed to %s (%d node%s), %d entries announced", self.where,
                        len(nodes.clients), "s" if len(nodes.clients) > 1 else "", len(self.held))
            next_check = next_rescan = time.monotonic()
            next_check += self.check_interval
            next_rescan += self.rescan_interval
            while not stop.is_set():
                changes = self._drain(pubsubs, len(prefix))
                if changes:
                    self._apply(nodes, changes)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + self.check_interval
                    nodes.check()
                    # flushed or restarted (no notification says so)? GETEX also keeps it an hour
                    # longer: it outlives us by that much at most
                    if marked and None in nodes.run([("getex", m, self.MARKER_TTL) for m in markers]):
                        marked = self._mark(nodes, markers)
                        self._rescan(nodes)
                if now >= next_rescan:
                    next_rescan = now + self.rescan_interval
                    self._rescan(nodes)
            if marked:
                nodes.run([("delete", m) for m in markers])
        finally:
            self.connected.clear()
            for pubsub in pubsubs:
                pubsub.close()
            nodes.close()

    def _mark(self, nodes: ServerNodes, markers: list) -> bool:
        """Write our marker key on every node (a flush or restart removes it); False if the server
        refuses (out of memory with nothing to evict): then only the periodic rescans see a flush."""
        import redis

        try:
            nodes.run([("set", m, b"1", self.MARKER_TTL) for m in markers])
            return True
        except redis.ResponseError as e:
            logger.warning("announcer: cannot write the marker key %s (%s); a flush is seen at the next "
                           "rescan only", self.marker, e)
            return False

    def _enable_notifications(self, client: Any) -> str:
        """Add our flags to notify-keyspace-events if they are missing; what happened, for errors."""
        import redis

        try:
            have = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
        except redis.ResponseError as e:  # CONFIG not allowed: the probe tells whether they are on
            return f"CONFIG GET refused: {e}"
        have = have.decode() if isinstance(have, bytes) else have
        flags = set(have.replace("A", "g$lshzxetd"))
        if {"K", "g", "$", "x", "e"} <= flags:
            return f"notify-keyspace-events is {have!r}"
        want = "".join(sorted(flags | set(NOTIFY_FLAGS)))
        try:
            client.config_set("notify-keyspace-events", want)
        except redis.ResponseError as e:
            raise ServerRefused(
                f"{self.where} sends no keyspace notifications for our keys (notify-keyspace-events is "
                f"{have!r}) and refused CONFIG SET ({e}): set `notify-keyspace-events {NOTIFY_FLAGS}` "
                f"(or add those flags) in the server's configuration") from e
        logger.info("announcer: notify-keyspace-events %r -> %r", have, want)
        return f"notify-keyspace-events set to {want!r}"

    def _probe(self, pubsubs: list, skip: int, config: str, markers: list) -> dict:
        """Wait for the notifications of our markers' SETs: proof that every node's notifications
        reach us. The changes seen meanwhile are returned, to apply after the rescan."""
        seen: dict = {}
        deadline = time.monotonic() + self.PROBE_TIMEOUT
        while not all(m.encode() in seen for m in markers):
            if time.monotonic() > deadline:
                raise ServerRefused(
                    f"{self.where} sends no keyspace notifications for our keys ({config}): set "
                    f"`notify-keyspace-events {NOTIFY_FLAGS}` (or add those flags) in the server's "
                    f"configuration, or allow this client CONFIG GET and CONFIG SET")
            seen.update(self._drain(pubsubs, skip))
        return seen

    def _drain(self, pubsubs: list, skip: int) -> dict:
        """Notifications of the next moment (50 ms at most), from every node: value name ->
        written (True) or gone (False). A key lives on one node, so its order is kept."""
        changes: dict = {}
        for pubsub in pubsubs:
            msg = pubsub.get_message(timeout=0.05 / len(pubsubs))
            while msg is not None and len(changes) < 10000:
                if msg.get("type") == "pmessage":
                    event = msg["data"]
                    if event in _WRITTEN:
                        changes[msg["channel"][skip:]] = True
                    elif event in _GONE:
                        changes[msg["channel"][skip:]] = False
                msg = pubsub.get_message(timeout=0)
        return changes

    # ---- changes ---------------------------------------------------------------------------
    def _apply(self, nodes: ServerNodes, changes: dict) -> None:
        touched, to_read = set(), []
        for name, written in changes.items():
            parsed = entry_of(name)
            if parsed is None:
                continue
            eid, rank = parsed
            e = self.entries.get(eid)
            if written:
                if e is None:
                    e = self.entries[eid] = _Entry(set())
                e.ranks.add(rank)
                self.world[eid[0]] = max(self.world.get(eid[0], 1), rank + 1)
                if not e.announced and 0 in e.ranks and (rank == 0 or e.events is None):
                    to_read.append(eid)  # (re)written: its metadata may be new
            elif e is not None:
                e.ranks.discard(rank)
            touched.add(eid)
        self._read_meta(nodes, to_read)
        for eid in touched:
            e = self.entries.get(eid)
            if e is not None and e.announced and not self._complete(eid, e):
                self._unannounce(eid, e)
            if e is not None and not e.ranks:
                del self.entries[eid]
        self._announce_ready(touched)
        self._flush()

    def _rescan(self, nodes: ServerNodes) -> None:
        """Diff the server's keys with what we know: removals (AllBlocksCleared when every
        announced entry is gone), then new entries."""
        self.counters["rescans"] += 1
        found: dict = {}
        for client in nodes.clients:
            for name in client.scan_iter(match=b"kvbm:*", count=_SCAN_COUNT):
                parsed = entry_of(name)
                if parsed is not None:
                    found.setdefault(parsed[0], set()).add(parsed[1])
        announced = [eid for eid, e in self.entries.items() if e.announced]
        if announced and not any(eid in found for eid in announced):
            self._out.append(self._cleared())
            self.counters["cleared"] += 1
            self.entries, self.held = {}, {}
        self.waiting = {}  # rebuilt below (it may name entries gone since)
        for eid in [eid for eid in self.entries if eid not in found]:
            e = self.entries.pop(eid)
            if e.announced:
                self._unannounce(eid, e)
        to_read = []
        for eid, ranks in found.items():
            self.world[eid[0]] = max(self.world.get(eid[0], 1), max(ranks) + 1)
            known = self.entries.get(eid)
            if known is None:
                e = self.entries[eid] = _Entry(set(ranks))
            else:
                e = known
                e.ranks = set(ranks)
            if e.announced and not self._complete(eid, e):
                self._unannounce(eid, e)
            if not e.announced and e.events is None and 0 in ranks:
                to_read.append(eid)
        self._read_meta(nodes, to_read)
        self._announce_ready(list(self.entries))
        self._flush()

    def _read_meta(self, nodes: ServerNodes, eids: list) -> None:
        """Each entry's events from rank 0's metadata: the header (64 bytes) gives the lengths,
        a second GETRANGE reads the metadata only."""
        for i in range(0, len(eids), _READ_BATCH):
            batch = eids[i:i + _READ_BATCH]
            heads = nodes.run([("getrange", value_name(eid, 0), 0, block_file.HEADER_SIZE - 1) for eid in batch])
            ranges = []
            for eid, head in zip(batch, heads):
                r = self._meta_range(eid, head)
                if r is not None:
                    ranges.append((eid, r))
            blobs = nodes.run([("getrange", value_name(eid, 0), start, start + n - 1) for eid, (start, n) in ranges])
            for (eid, (_, n)), blob in zip(ranges, blobs):
                e = self.entries.get(eid)
                if e is not None and len(blob) == n:
                    self._describe(eid, e, blob)

    def _meta_range(self, eid: EventId, head: bytes) -> tuple[int, int] | None:
        if len(head) != block_file.HEADER_SIZE:
            return None
        h = block_file.parse_header(head)
        if h is None or h.key.hex().encode() != eid[1] or not 0 < h.meta_bytes <= block_file.MAX_META:
            return None
        return block_file.HEADER_SIZE + h.payload_bytes, h.meta_bytes

    def _describe(self, eid: EventId, e: _Entry, blob: bytes) -> None:
        info = block_file.decode_meta(blob)
        if info is None:
            return
        name = storage_tier(f"kvbm-remote:{eid[0].decode()}", LOCALITY_REMOTE)
        try:
            events = [msgspec.structs.replace(self._decode(ev), medium=name.medium, locality=name.locality,
                                              ownership=name.ownership) for ev in info[1]]
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if events and all(len(ev.block_hashes) == 1 for ev in events):
            e.events, e.end = events, info[0]

    # ---- announcing --------------------------------------------------------------------------
    def _complete(self, eid: EventId, e: _Entry) -> bool:
        return all(r in e.ranks for r in range(self.world.get(eid[0], 1)))

    def _missing_parent(self, e: _Entry) -> Slot | None:
        """The first parent (ownership, group, hash) of `e` not announced, or None."""
        assert e.events is not None  # described, not announced yet
        for ev in e.events:
            if ev.parent_block_hash is not None and ev.kv_cache_spec_kind not in SPARSE_KINDS:
                slot = (ev.ownership, ev.group_idx, ev.parent_block_hash)
                if slot not in self.held:
                    return slot
        return None

    def _announce_ready(self, candidates: Iterable[EventId]) -> None:
        """Announce the complete, described `candidates` whose parents are announced (parents
        first); the others wait under their missing parent, announced when it is."""
        todo = sorted((self.entries[eid].end, eid) for eid in candidates if eid in self.entries)
        todo.reverse()  # a stack: smallest end (parents) first
        while todo:
            _, eid = todo.pop()
            e = self.entries.get(eid)
            if e is None or e.announced or not e.events or not self._complete(eid, e):
                continue
            slots = [(ev.ownership, ev.group_idx, ev.block_hashes[0]) for ev in e.events]
            if any(s in self.held for s in slots):
                continue  # another key announced the same block (never expected): skip it
            parent = self._missing_parent(e)
            if parent is not None:
                self.waiting.setdefault(parent, set()).add(eid)
                continue
            for slot in slots:
                self.held[slot] = eid
                todo += [(0, child) for child in self.waiting.pop(slot, ())]
            self._out += e.events
            e.events, e.slots = None, slots  # kept small: a removal needs the slots only
            self.counters["stored"] += 1

    def _unannounce(self, eid: EventId, e: _Entry) -> None:
        assert e.slots is not None  # announced
        for ownership, group, h in e.slots:
            if self.held.get((ownership, group, h)) == eid:
                del self.held[(ownership, group, h)]
                self._out.append(self._removed(block_hashes=[h], medium=MEDIUM_STORAGE, group_idx=group,
                                               locality=LOCALITY_REMOTE, ownership=ownership))
        e.slots = None  # its events are read again if it comes back
        self.counters["removed"] += 1

    def _flush(self) -> None:
        if self._out:
            events, self._out = self._out, []
            self.publish(events)


def zmq_publisher(endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> EventPublisher:
    """vLLM's own ZmqEventPublisher (PUB + ROUTER replay, sequence numbers, replay buffer), always
    binding its endpoints: subscribers and routers connect to the announcer."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    class _Bound(ZmqEventPublisher):
        @staticmethod
        def _is_bind_endpoint(endpoint: str) -> bool:
            return True

    return _Bound(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay_endpoint, topic=topic)


def publish_to(publisher: EventPublisher) -> Publish:
    """`publish` for RemoteAnnouncer: one KVEventBatch per call, through `publisher`."""
    from vllm.distributed.kv_events import KVEventBatch

    return lambda events: publisher.publish(KVEventBatch(ts=time.time(), events=events))
