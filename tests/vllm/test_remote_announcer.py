"""The remote tier's events once per tier: `vllm-kvbm announce` (events/announcer.py) beside two
scheduler sides ("instances", vLLM's real Scheduler with real WorkerSides) sharing one real
redis-server, published through vLLM's ZmqEventPublisher on real ZMQ sockets and received by our
Subscriber. The merged streams (both instances and the announcer) validate with 0 errors, each
remote entry's BlockStored comes once, and what the server drops (DEL, eviction, FLUSHALL, a
restart) is announced as removed."""

import collections
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from vllm_kvbm_plugin.events.subscriber import Subscriber
from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, AllBlocksCleared, BlockRemoved, BlockStored
from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness
from vllm_kvbm_plugin.tiers.block_file import VERSION

from .test_remote_tier import idle, instance, prompt

VALUES = f"kvbm:{VERSION}:*"  # the names of our values in this format
pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = pytest.mark.skipif(server_binary() is None,
                                reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Announcer:
    """The announcer on a thread, publishing on real ZMQ sockets, and a subscriber recording it."""

    def __init__(self, url: str, **kwargs):
        from vllm_kvbm_plugin.events.announcer import RemoteAnnouncer, publish_to, zmq_publisher

        port, replay = free_port(), free_port()
        self.publisher = zmq_publisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
        self.sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
        self.announcer = RemoteAnnouncer(url, publish_to(self.publisher), **kwargs)
        self.stop = threading.Event()
        self.errors: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.announcer.connected.wait(10), "announcer did not connect"
        self.records: list = []

    def _run(self):
        try:
            self.announcer.run(self.stop)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)

    def events(self) -> list:
        return [ev for _, b in self.records for ev in b.events]

    def wait(self, done, timeout: float = 30.0) -> None:
        """Record batches until done(events) holds."""
        deadline = time.monotonic() + timeout
        while not done(self.events()):
            assert time.monotonic() < deadline, f"announcer stream: {collections.Counter(type(e).__name__ for e in self.events())}"
            self.records += self.sub.poll(100)

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.sub.close()
        self.publisher.shutdown()
        assert not self.errors


def stored(events) -> collections.Counter:
    """How often each (group, hash) was announced stored."""
    return collections.Counter((ev.group_idx, ev.block_hashes[0]) for ev in events if isinstance(ev, BlockStored))


def entries_on(server) -> int:
    return sum(1 for k in server.client().scan_iter(match="kvbm:*") if b":announcer:" not in k)


def validate(*streams) -> Validator:
    """Validate several publishers' recorded batches, merged by batch time."""
    v = Validator()
    merged = sorted(((b.ts, i, b) for i, batches in enumerate(streams) for b in batches), key=lambda r: r[:2])
    for _, i, b in merged:
        v.apply(b, stream=i)
    assert v.errors == 0, (v.report()["by_rule"], v.report()["first_problems"])
    return v


def remote_events(h) -> list:
    return [ev for b in h.batches for ev in b.events
            if isinstance(ev, (BlockStored, BlockRemoved)) and ev.locality == LOCALITY_REMOTE]


def test_two_instances_and_the_announcer_each_entry_once_and_server_removals(server):
    ann = Announcer(server.url)
    a, b = instance(server.url), instance(server.url)
    p, q = prompt(), prompt()
    assert a.serve(p) == 0
    b.serve(p)  # a hit on what A stored, or (a lookup late on a busy machine) the same values again
    assert b.serve(q) == 0
    a.serve(q)
    assert idle(a) and idle(b)
    n = entries_on(server)
    assert n == 12  # 6 full blocks of each prompt
    ann.wait(lambda evs: len(stored(evs)) >= n)
    quiet(ann, 0.5)
    assert all(c == 1 for c in stored(ann.events()).values()) and len(stored(ann.events())) == n
    assert not remote_events(a) and not remote_events(b)  # remote_events "announcer": instances are silent
    # the announced entries are the ones the instances would have announced: same hashes as vLLM's
    assert {h for _, h in stored(ann.events())} == set(a.unit_hashes(p)[:6] + a.unit_hashes(q)[:6])
    v = validate(a.batches, b.batches, [bt for _, bt in ann.records])
    assert len(v.held("STORAGE", locality=LOCALITY_REMOTE)) == n

    # server-side deletions: DEL of one key, then FLUSHALL
    client = server.client()
    leaf = sorted(k for k in client.scan_iter(match=VALUES))[0]
    client.delete(leaf)
    ann.wait(lambda evs: any(isinstance(e, BlockRemoved) for e in evs))
    client.flushall()
    ann.wait(lambda evs: any(isinstance(e, AllBlocksCleared) for e in evs))
    v = validate(a.batches, b.batches, [bt for _, bt in ann.records])
    assert v.held("STORAGE", locality=LOCALITY_REMOTE) == set()
    assert v.removed_hashes == 1

    # a restart: the announcer reconnects, rescans and announces what was written since
    server.kill()
    time.sleep(0.3)
    server.start()
    time.sleep(a.connector.tier("remote").breaker.MIN_BACKOFF + 0.1)
    r = prompt()
    assert a.serve(r) == 0
    assert idle(a)
    assert entries_on(server) == 6
    ann.wait(lambda evs: len(set(stored(evs)) & {(0, h) for h in a.unit_hashes(r)[:6]}) == 6)
    assert ann.announcer.counters["connects"] >= 2
    v = validate(a.batches, b.batches, [bt for _, bt in ann.records])
    assert len(v.held("STORAGE", locality=LOCALITY_REMOTE)) == entries_on(server)
    ann.close()


def quiet(ann: Announcer, seconds: float = 1.0) -> None:
    """Record until the announcer's stream has been silent for `seconds`."""
    while True:
        got = ann.sub.poll(int(seconds * 1000))
        if not got:
            return
        ann.records += got


def held_in(events) -> int:
    """Hashes the events leave held (one stream, one tier)."""
    held = set()
    for e in events:
        if isinstance(e, BlockStored):
            held.add((e.group_idx, e.block_hashes[0]))
        elif isinstance(e, BlockRemoved):
            held.discard((e.group_idx, e.block_hashes[0]))
        else:
            held.clear()
    return len(held)


def test_server_evictions_are_announced_and_the_stream_validates(server):
    server.stop()
    small = RedisServer(maxmemory="3mb", binary=server.binary).start()  # allkeys-lru: ~2 MiB for 16 KiB values
    try:
        ann = Announcer(small.url)
        a, b = instance(small.url), instance(small.url)
        for i in range(16):
            (a if i % 2 else b).serve(prompt(400))
        assert idle(a) and idle(b)
        assert int(small.client().info("stats")["evicted_keys"]) > 0
        # the stream settles on the server's state: what it says the tier holds is all on the
        # server (nothing stale), and it is what the announcer announced
        on_server = {k.split(b":")[-1] for k in small.client().scan_iter(match=VALUES)}
        ann.wait(lambda evs: any(isinstance(e, BlockRemoved) for e in evs)
                 and {eid[1] for eid, e in list(ann.announcer.entries.items()) if e.announced} <= on_server
                 and held_in(evs) == len(ann.announcer.held))
        v = validate(a.batches, b.batches, [bt for _, bt in ann.records])
        assert len(v.held("STORAGE", locality=LOCALITY_REMOTE)) == len(ann.announcer.held) > 0
        assert v.removed_hashes > 0
        ann.close()
    finally:
        small.stop()


def test_tensor_parallel_entry_is_announced_with_every_rank_and_removed_with_any(server):
    ann = Announcer(server.url)
    h = SchedulerHarness(HarnessConfig(hybrid=False, num_blocks=64, workers=2, block_size=32, hash_block_size=None,
                                       connector={"cpu_bytes_to_use": 1 << 24, "remote_url": server.url}))
    p = prompt()
    assert h.serve(p) == 0
    assert idle(h)
    names = sorted(server.client().scan_iter(match=VALUES))
    r1 = [k for k in names if b":r1:" in k]
    assert len(r1) * 2 == len(names) >= 12  # every entry has a value per rank
    blocks = {(0, x) for x in h.unit_hashes(p)[:6]}
    ann.wait(lambda evs: blocks <= set(stored(evs)))  # once per block, whatever the ranks
    server.client().delete(*r1)  # one rank's values: no entry is a hit any more
    ann.wait(lambda evs: held_in(evs) == 0)
    quiet(ann, 0.5)
    assert {(e.group_idx, e.block_hashes[0]) for e in ann.events() if isinstance(e, BlockRemoved)} >= blocks
    assert all(c == 1 for c in stored(ann.events()).values())
    validate(h.batches, [bt for _, bt in ann.records])
    ann.close()


def cli_announce(url: str, port: int, replay: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vllm_kvbm_plugin.cli", "announce", "--remote-url", url,
                             "--endpoint", f"tcp://127.0.0.1:{port}", "--replay-endpoint",
                             f"tcp://127.0.0.1:{replay}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ))


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 300) -> None:
    """Read the process's stderr until a line holds `text` (the announcer imports vLLM: slow)."""
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        if text in line:
            return
        assert time.monotonic() < deadline, f"no {text!r} from the announcer"
    raise AssertionError(f"announcer exited ({proc.wait()}) before saying {text!r}")


def test_cli_announce_publishes_with_replay_and_stops_on_sigterm(server):
    port, replay = free_port(), free_port()
    proc = cli_announce(server.url, port, replay)
    try:
        wait_for_line(proc, "announcer: subscribed to")
        a = instance(server.url)
        assert a.serve(prompt()) == 0
        assert idle(a)
        time.sleep(1)  # published before anyone subscribed
        # subscribed late: the batches published before come from the replay socket
        with Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}") as sub:
            assert a.serve(prompt()) == 0  # a new publication: the subscriber sees the gap before it
            records, deadline = [], time.monotonic() + 120
            while len(stored(ev for _, b in records for ev in b.events)) < 12:
                assert time.monotonic() < deadline and proc.poll() is None, (records, vars(sub.stats))
                records += sub.poll(200)
        assert records[0][0] == 0 and sub.stats.recovered > 0  # from seq 0, through the replay socket
        validate(a.batches, [b for _, b in records])
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


def test_announcer_says_what_the_server_needs_when_config_is_refused(server):
    from vllm_kvbm_plugin.events.announcer import RemoteAnnouncer, ServerRefused

    c = server.client()
    c.config_set("notify-keyspace-events", "")
    c.execute_command("ACL", "SETUSER", "fleet", "on", ">pw", "~*", "&*", "+@all", "-config")
    url = f"redis://fleet:pw@127.0.0.1:{server.port}/0"
    with pytest.raises(ServerRefused) as refused:
        RemoteAnnouncer(url, lambda events: None).run(threading.Event())
    msg = str(refused.value)
    assert "sends no keyspace notifications" in msg and "notify-keyspace-events Kg$xe" in msg
    assert "CONFIG GET refused" in msg
    c.config_set("notify-keyspace-events", "Kg$xe")  # what the message asks for: then it runs
    ann = Announcer(url)
    assert len(list(c.scan_iter(match="kvbm:announcer:*"))) == 1  # its marker (a flush removes it)
    ann.close()
    assert not list(c.scan_iter(match="kvbm:announcer:*"))  # removed when it stops


def described(server) -> set:
    """(group, hash) of every event in the metadata of the values on the server."""
    import msgspec

    from vllm_kvbm_plugin.tiers import block_file

    out, c = set(), server.client()
    for name in c.scan_iter(match=VALUES + ":r0:*"):
        value = c.get(name)
        plen = block_file._HEADER.unpack_from(value, 0)[5]
        for ev in (block_file.decode_meta(value[block_file.HEADER_SIZE + plen:]) or (0, []))[1]:
            ev = msgspec.msgpack.decode(ev)
            out.add((ev["group_idx"], ev["block_hashes"][0]))
    return out


def test_hybrid_kv_and_state_entries_are_announced_once_each(server):
    ann = Announcer(server.url)
    a, b = instance(server.url, hybrid=True), instance(server.url, hybrid=True)
    p = prompt()
    assert a.serve(p) == 0
    b.serve(p)
    assert idle(a) and idle(b)
    want = described(server)  # internal entries (no events in their metadata) are never announced
    ann.wait(lambda evs: set(stored(evs)) == want)
    quiet(ann, 0.5)
    kinds = collections.Counter(ev.kv_cache_spec_kind for ev in ann.events() if isinstance(ev, BlockStored))
    assert kinds["mamba"] > 0 and kinds["full_attention"] > 0  # the recurrent state's entries too
    assert set(stored(ann.events()).values()) == {1}
    validate(a.batches, b.batches, [bt for _, bt in ann.records])
    ann.close()


def test_cluster_every_master_is_subscribed_and_a_reshard_is_followed():
    """Keyspace notifications are per node: entries on every master are announced once, a flush
    of one master removes its entries only, and after a slot moves the announcer subscribes
    again and goes on (nothing announced twice)."""
    from vllm_kvbm_plugin.testing.redis_server import RedisClusterServers

    cluster = RedisClusterServers().start()
    try:
        ann = Announcer(cluster.url)
        a, b = instance(cluster.url), instance(cluster.url)
        p, q = prompt(), prompt()
        assert a.serve(p) == 0
        assert b.serve(q) == 0
        assert idle(a) and idle(b)
        per_node = [entries_on(s) for s in cluster.nodes]
        assert sum(n > 0 for n in per_node) >= 2 and sum(per_node) == 12, per_node
        ann.wait(lambda evs: len(stored(evs)) >= 12)
        quiet(ann, 0.5)
        assert all(c == 1 for c in stored(ann.events()).values())
        assert {h for _, h in stored(ann.events())} == set(a.unit_hashes(p)[:6] + b.unit_hashes(q)[:6])
        validate(a.batches, b.batches, [bt for _, bt in ann.records])

        # a flush of one master (no notification says so): its entries, and only they, are removed
        flushed = max(range(len(cluster.nodes)), key=lambda i: per_node[i])
        cluster.nodes[flushed].client().flushall()
        ann.wait(lambda evs: held_in(evs) == 12 - per_node[flushed])
        v = validate(a.batches, b.batches, [bt for _, bt in ann.records])
        assert len(v.held("STORAGE", locality=LOCALITY_REMOTE)) == sum(entries_on(s) for s in cluster.nodes)

        # a slot moves to another master: subscribe again, rescan, go on
        connects = ann.announcer.counters["connects"]
        ids = [s.client().cluster("myid") for s in cluster.nodes[:2]]
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        subprocess.run([cluster.cli, "--cluster", "reshard", f"127.0.0.1:{cluster.nodes[0].port}",
                        "--cluster-from", ids[0], "--cluster-to", ids[1], "--cluster-slots", "1",
                        "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=60)
        cluster.wait_ok()
        deadline = time.monotonic() + 20
        while ann.announcer.counters["connects"] == connects and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ann.announcer.counters["connects"] > connects
        r = prompt()
        a.serve(r)
        assert idle(a)
        ann.wait(lambda evs: {(0, h) for h in a.unit_hashes(r)[:6]} <= set(stored(evs)))
        quiet(ann, 0.5)
        assert all(c == 1 for c in stored(ann.events()).values())
        v = validate(a.batches, b.batches, [bt for _, bt in ann.records])
        assert len(v.held("STORAGE", locality=LOCALITY_REMOTE)) == sum(entries_on(s) for s in cluster.nodes)
        ann.close()
    finally:
        cluster.stop()
