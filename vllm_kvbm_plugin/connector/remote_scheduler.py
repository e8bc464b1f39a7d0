"""The shared remote tier (Redis / Valkey), scheduler side (EngineCore process): lookups on a
thread of its own, fetches into CPU slots and writes behind from them, planned for the workers'
remote threads (remote_worker.py). Values in the format of tiers/remote.py.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from vllm_kvbm_plugin.connector.block_events import Announce, Announcer
from vllm_kvbm_plugin.connector.base import Key, Series, SlotJobs, TierJobs, TierOp, Verb
from vllm_kvbm_plugin.connector.layout import Layout
from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, storage_tier
from vllm_kvbm_plugin.log import redact_url
from vllm_kvbm_plugin.tiers.secret import REMOTE_NAME as SECRET_NAME
from vllm_kvbm_plugin.tiers.secret import tier_secret
from vllm_kvbm_plugin.tiers import block_dir, block_file, remote_value, resp
from vllm_kvbm_plugin.tiers.breaker import Breaker

if TYPE_CHECKING:
    from vllm_kvbm_plugin.config import KVBMConfig

_ENCODE = msgspec.msgpack.Encoder().encode


# stats key -> its running total in the scheduler half's counters
TOTALS = {"remote_hits": lambda c: c["fetched"],
          "remote_misses": lambda c: c["lookup_keys"] - c["lookup_keys_found"],
          "remote_lookup_errors": lambda c: c["lookup_failures"],
          "remote_lookup_timeout_errors": lambda c: c["lookup_timeouts"],
          "remote_fetch_errors": lambda c: c["fetch_misses"],
          "remote_write_errors": lambda c: c["write_failures"]}
ERRORS = ("lookup", "lookup_timeout", "fetch", "write")
SERIES = (
    Series("vllm:kvbm_remote_hits_total", "Blocks read from the remote tier's server and verified",
           {"remote_hits": ()}),
    Series("vllm:kvbm_remote_misses_total", "Blocks a remote-tier lookup did not find on the server",
           {"remote_misses": ()}),
    Series("vllm:kvbm_remote_errors_total", "Remote-tier lookups that failed or were late, fetches of missing or "
           "corrupt values, failed writes (each a miss)", {f"remote_{e}_errors": (e,) for e in ERRORS}, ("operation",)),
    Series("vllm:kvbm_remote_breaker_changes_total", "Remote-tier circuit breaker state changes (open: the server "
           "is not used for a backoff)", {f"remote_{side}_breaker_{state}": (side, state)
                                          for side in ("scheduler", "worker") for state in ("open", "closed")},
           ("side", "state")),
)


class RemoteCounters:
    """The remote tier's running totals (RemoteTier.counters, Breaker.opened / closed) as the
    change since the last call: what one stats interval adds."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def take(self, remote: RemoteTier | None = None, breaker: Breaker | None = None,
             side: str = "scheduler") -> dict[str, int]:
        totals: dict[str, int] = {}
        if remote is not None:
            totals = {name: total(remote.counters) for name, total in TOTALS.items()}
        if breaker is not None:
            totals[f"remote_{side}_breaker_open"] = breaker.opened
            totals[f"remote_{side}_breaker_closed"] = breaker.closed
        out = {k: v - self.last.get(k, 0) for k, v in totals.items() if v != self.last.get(k, 0)}
        self.last = totals
        return out


@dataclasses.dataclass
class _Lookup:
    asked: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    found: list[Key] = dataclasses.field(default_factory=list)  # set by the lookup thread before `done`
    merged: bool = False
    answered: bool = False  # the server answered (a failure leaves `found` empty: not "missing")
    keys: list[Key] = dataclasses.field(default_factory=list)
    confirm: bool = False  # a write-through's confirmation, not a request's lookup (not in hit stats)


class RemoteTier(SlotJobs):
    """The shared remote tier (Redis / Valkey), scheduler side (a base.SecondaryTier, built and
    called by SchedulerSide in the EngineCore process; the workers' RemoteIO fetch and write the
    values it plans). The server holds the entries and
    evicts any of them whenever it likes, so this side keeps no index: it knows the keys a lookup
    or one of its own writes found (`present`), the fetches and writes in flight, and what it
    announced. A key is written once while it is known present: trusted for hits PRESENT_TTL
    after it was last seen, after that a write-through asks the server whether it still holds it
    (one pipelined EXISTS per step, `confirm`), and writes it again only once a lookup, a
    confirmation or a fetch found it missing. A failed write or lookup (the server may have
    restarted empty) makes every key unconfirmed. Lookups run on a thread; a scheduler step waits for answers at most
    `budget` seconds in all, a request at most LOOKUP_PATIENCE (it waits steps meanwhile), and
    a lookup that takes longer, or a server that failed (Breaker), is a miss.

    Events: every value's metadata carries the entry's events (STORAGE, REMOTE, ownership = the
    tier's id), which `vllm-kvbm announce` publishes once per tier (events/announcer.py). With
    `announce` (remote_events "instance") this instance also announces the entries it wrote, and
    the removal of those it later finds missing or corrupt; evictions by the server are not seen
    here then."""

    label = "remote"
    waits = True
    direct = False
    FETCH, WRITE = TierOp(label, Verb.FETCH), TierOp(label, Verb.WRITE)

    PRESENT_TTL = 10.0  # s: a key seen present is trusted that long without asking again
    LOOKUP_PATIENCE = 0.2  # s: a request waits (steps) that long for its lookup, then it is a miss
    MAX_ANNOUNCED = 1 << 20  # announced keys remembered (for removals)
    FETCH_YIELD = 0.004  # s: a step's pause while a request waits for its fetches (see busy_loading)
    CONNECT_WAIT = 0.5  # s: startup waits that long at most for the connections (then they go on behind)
    SECRET_KEEP = 10.0  # s: a lookup writes the store's block-key secret back at most that often

    @classmethod
    def create(cls, layout: Layout, cfg: KVBMConfig) -> RemoteTier | None:
        if not cfg.remote_url or layout.remote_off:  # off: the secret could not be read from it
            return None
        return cls(layout, cfg.remote_url, cfg.remote_lookup_budget_ms, announce=cfg.remote_events == "instance")

    def __init__(self, layout: Layout, url: str, budget_ms: float, announce: bool = True) -> None:
        self.announce = announce
        root = layout.decided_root()
        self.name = storage_tier(f"kvbm-remote:{root[0]:016x}{root[1]:016x}", LOCALITY_REMOTE)
        self.url = url
        self.prefixes = [remote_value.key_prefix(root, r) for r in range(layout.world)]
        self.budget = budget_ms / 1000
        self.budget_left = self.budget
        self.breaker = Breaker("scheduler", url)
        secret = tier_secret(url, layout.disk_path)
        # A secret kept in the store is written back (SET NX) with lookups: the server may evict
        # it like any key, and an instance starting then would make a new one and share nothing.
        self.secret_hex = secret.key.hex() if secret.source == "remote" else None
        self.secret_kept = float("-inf")  # when it was last written back
        self.present: dict[Key, float] = {}  # key -> when it was last seen present (not known missing since)
        self.stale_before = float("-inf")  # keys seen before this are unconfirmed (a server failure)
        self.unconfirmed: set[Key] = set()  # keys a write-through found stale: asked with the next step's EXISTS
        self.confirming: _Lookup | None = None  # the confirmation in flight
        self.confirming_keys: set[Key] = set()
        self.fetching: set[Key] = set()
        self.landed_seen = 0  # resp.LANDINGS.count when last looked at
        self.writing: dict[Key, tuple[Announce, Key | None]] = {}
        self.announced: collections.OrderedDict[Key, Announce] = collections.OrderedDict()
        self.lookups: dict[str, _Lookup] = {}  # by request id
        self.events: list[BlockStored | BlockRemoved] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self.changes = RemoteCounters()  # the counters' and breaker's changes per stats interval
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._client: resp.Client | None = None
        self._connected = threading.Event()  # set when the first connection attempt ended
        self._start_thread()
        self._connected.wait(self.CONNECT_WAIT)

    def __len__(self) -> int:
        return len(self.present)

    def names(self, key: Key) -> list[str]:
        h = block_dir.key_hex(key)
        return [p + h for p in self.prefixes]

    def busy(self) -> int:
        return len(self.fetching) + len(self.writing)

    def has_pending_work(self) -> bool:
        """Fetches or writes behind the workers have yet to report."""
        return bool(self.fetching or self.writing)

    # ---- the contract (base.SecondaryTier) -----------------------------------------------------
    def announcement(self, key: Key) -> Announcer | None:
        return None  # values carry their events for the announcer; a fetch takes the request's

    def settle(self, op: TierOp, key: Key, ok: bool) -> None:
        if op.verb is Verb.FETCH:
            self.prefetched(key, ok)
        else:  # Verb.WRITE
            self.complete_store(key, ok)

    def hold(self, key: Key, req_id: str) -> bool:
        return False  # no direct loads: every load goes through a CPU slot

    def ready_direct(self, key: Key) -> bool:
        return False

    def release(self, req_id: str) -> None:
        return  # a request's lookup answer is kept until it finishes (on_request_finished)

    def on_request_finished(self, req_id: str) -> None:
        self.forget(req_id)

    def on_schedule_end(self, meta: TierJobs) -> None:
        self.new_step()

    def worker_failed(self) -> None:
        return  # each failure is a miss, reported as such (the workers' Breaker spares the server)

    def accounting(self) -> dict[str, object]:
        return {self.label: {"fetching": len(self.fetching), "writing": len(self.writing)}}

    def describe(self) -> str:
        return f"remote tier {redact_url(self.url)}"

    def take_stats(self) -> dict[str, int]:
        """Hits, misses, errors and the scheduler's breaker changes since the last call."""
        return self.changes.take(self, self.breaker, "scheduler")

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, key: Key) -> bool:
        """Seen present (every rank's value) within PRESENT_TTL."""
        t = self.present.get(key)
        return t is not None and time.monotonic() - t < self.PRESENT_TTL and t >= self.stale_before

    def prepare_lookup(self, req_id: str, keys: list[Key]) -> bool:
        """Look `keys` up for `req_id` (once per request); True once answered (`lookup` then
        knows), False while the request should wait a step. A failed server answers at once."""
        lk = self.lookups.get(req_id)
        if lk is None:
            lk = self.lookups[req_id] = _Lookup(time.monotonic())
            keys = [k for k in keys if not self.lookup(k)]
            if not keys or not self.breaker.allow_soon():
                lk.done.set()
            else:
                self._submit(lk, keys)
        if not lk.done.is_set() and self.budget_left > 0:
            t0 = time.perf_counter()
            lk.done.wait(self.budget_left)
            self.budget_left -= time.perf_counter() - t0
        if lk.done.is_set():
            if not lk.merged:
                lk.merged = True
                self._merge(lk)
            return True
        if time.monotonic() - lk.asked < self.LOOKUP_PATIENCE:
            return False
        self.counters["lookup_timeouts"] += 1
        lk.merged = True  # a miss: the request goes on without the remote tier
        lk.done.set()
        return True

    def _merge(self, lk: _Lookup) -> None:
        """A lookup's or confirmation's answer: found keys are present now, the others missing
        (forgotten, so the next write-through writes them; their removal announced if ours)."""
        if not lk.answered:
            return
        now = time.monotonic()
        found = set(lk.found)
        for k in lk.keys:
            if k in found:
                self.present[k] = now
            elif self.present.get(k, lk.asked) <= lk.asked:  # not written since it was asked about
                self.lost(k)

    def new_step(self) -> None:
        self.budget_left = self.budget
        lk = self.confirming
        if lk is not None and lk.done.is_set():
            self._merge(lk)
            self.counters["confirm_missing"] += len(lk.keys) - len(lk.found) if lk.answered else 0
            self.confirming, self.confirming_keys, lk = None, set(), None
        if lk is None and self.unconfirmed and self.breaker.allow_soon():
            self.confirming, self.confirming_keys = _Lookup(time.monotonic(), confirm=True), self.unconfirmed
            self.counters["confirm_keys"] += len(self.unconfirmed)
            self._submit(self.confirming, list(self.unconfirmed))
            self.unconfirmed = set()
        if len(self.present) > 4 * self.MAX_ANNOUNCED:  # the newest half stays known
            keep = sorted(self.present.items(), key=lambda kt: kt[1])[-2 * self.MAX_ANNOUNCED:]
            self.present = dict(keep)

    def forget(self, req_id: str) -> None:
        self.lookups.pop(req_id, None)

    def _submit(self, lk: _Lookup, keys: list[Key]) -> None:
        lk.keys = keys
        self._start_thread()
        self._jobs.put((lk, keys))

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._lookup_loop, name="kvbm-remote-lookups", daemon=True)
            self._thread.start()

    def _connect(self) -> None:
        """Open the connection before the first lookup needs it; a server down is a miss. Lookups
        go over a DirectClient where one can (`call`: a few times faster than redis-py)."""
        try:
            if self._client is None and self.breaker.allow():
                self._client = resp.connect_direct(self.url)
                self.breaker.success()
        except Exception as e:  # the breaker logs it; lookups are misses until it is back
            self.breaker.failure(e)
        finally:
            self._connected.set()

    def _lookup_loop(self) -> None:
        self._connect()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            lk, keys = job
            try:
                if self.breaker.allow():
                    lk.found = self._exists(keys)
                    lk.answered = True
                    self.breaker.success()
                    if lk.confirm:
                        self.counters["confirms"] += 1
                    else:
                        self.counters["lookups"] += 1
                        self.counters["lookup_keys"] += len(keys)
                        self.counters["lookup_keys_found"] += len(lk.found)
            except Exception as e:  # anything the client raises is a miss
                self.breaker.failure(e)
                self.counters["lookup_failures"] += 1
                self.stale_before = time.monotonic()  # the server may come back empty
            lk.done.set()

    def _exists(self, keys: list[Key]) -> list[Key]:
        """The keys whose value every rank holds, in one pipelined round trip."""
        # one key per command: a cluster routes each to its node
        commands: list[tuple[str, ...]] = [("EXISTS", name) for k in keys for name in self.names(k)]
        keep = self.secret_hex is not None and time.monotonic() - self.secret_kept > self.SECRET_KEEP
        if keep and self.secret_hex is not None:
            commands.append(("SET", SECRET_NAME, self.secret_hex, "NX"))
        if self._client is None:
            self._client = resp.connect_direct(self.url)
        found = resp.run(self._client, commands)
        n = len(self.prefixes)
        for r in found[: len(keys) * n]:
            if isinstance(r, Exception):
                raise r
        if keep and not isinstance(found[-1], Exception):  # refused (a full server): again next time
            self.secret_kept = time.monotonic()
        return [k for i, k in enumerate(keys) if all(found[i * n : (i + 1) * n])]

    # ---- fetches into CPU slots ------------------------------------------------------------
    def prefetch(self, key: Key) -> None:
        if not self.fetching:
            self.landed_seen = resp.LANDINGS.count  # what landed before this fetch was asked
        self.fetching.add(key)

    def busy_loading(self, key: Key) -> bool:
        """Being fetched. Then the request waits a step, and this step waits for up to
        FETCH_YIELD of its budget for a fetch to land (resp.Landings: the request then goes
        on at once where the workers share this process). The pause also yields the CPU: an idle
        engine polls waiting requests in a tight loop that would keep the GIL and a core from the
        threads doing the fetch (a GIL convoy)."""
        if key not in self.fetching:
            return False
        if self.budget_left > 0:
            t0 = time.perf_counter()
            seen = resp.LANDINGS.wait(self.landed_seen, min(self.budget_left, self.FETCH_YIELD))
            self.budget_left -= time.perf_counter() - t0
            if seen != self.landed_seen:
                self.landed_seen = seen
                self.budget_left = 0  # its report comes with this step's worker output: no more waiting
        return True

    def prefetched(self, key: Key, ok: bool) -> None:
        self.fetching.discard(key)
        self.counters["fetched" if ok else "fetch_misses"] += 1
        if not ok:
            self.lost(key)

    def lost(self, key: Key) -> None:
        """`key` is missing or did not verify (the worker deleted it): forget it, announce its removal."""
        self.present.pop(key, None)
        a = self.announced.pop(key, None)
        if a is not None and a.vhash is not None:  # announced: it has events, so a hash
            for ev in a.events:
                self.events.append(BlockRemoved(block_hashes=[a.vhash], medium=self.name.medium,
                                                group_idx=ev.group_idx, locality=self.name.locality,
                                                ownership=self.name.ownership))

    # ---- writes behind -----------------------------------------------------------------------
    def prepare_write(self, key: Key, parent: Key | None, end: int, announce: Announcer) -> bytes | None:
        """The value's metadata blob when `key` should be written now, else None (being written,
        the server failed lately, or known present: confirmed with the next step's EXISTS when
        last seen longer ago than PRESENT_TTL)."""
        if key in self.writing or not self.breaker.allow_soon():
            return None
        if key in self.present:
            if not self.lookup(key) and key not in self.confirming_keys:
                self.unconfirmed.add(key)
            return None
        a = announce(self.name)
        self.writing[key] = (a, parent)
        return block_file.encode_meta(end, [_ENCODE(e) for e in a.events])

    def complete_store(self, key: Key, ok: bool) -> None:
        a, parent = self.writing.pop(key, (None, None))
        self.counters["written" if ok else "write_failures"] += 1
        if not ok:
            self.stale_before = time.monotonic()  # the server may come back empty
            return
        self.present[key] = time.monotonic()
        # announced only with its parent, as the other tiers are (a router needs the chain)
        if (self.announce and a is not None and a.events and key not in self.announced
                and (parent is None or parent in self.announced)):
            self.events += a.events
            a.announced = True
            self.announced[key] = a
            if len(self.announced) > self.MAX_ANNOUNCED:
                self.announced.popitem(last=False)  # its removal will never be announced by us

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(2 * resp.SOCKET_TIMEOUT + 1)
            self._thread = None
