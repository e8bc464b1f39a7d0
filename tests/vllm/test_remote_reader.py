"""The remote tier's direct reader (tiers/resp.py DirectClient) against a real redis-server:
pipelined GETs read straight into the caller's buffers, verified there. Values that are missing,
damaged, truncated or of another layout come back as such and never desynchronise the
connection; a paused server is an error (the Breaker's business), never a wait."""

import os

import numpy as np
import pytest

from vllm_kvbm_plugin.testing.redis_server import server_binary
from vllm_kvbm_plugin.tiers import block_dir, block_file, remote_value, resp
from vllm_kvbm_plugin.tiers.mac import mac_key

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = pytest.mark.skipif(server_binary() is None,
                                reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")

FP = bytes(range(16))
MK = mac_key(bytes(range(16, 32)))


def stored(server, n: int, plen: int) -> tuple[list, list, list]:
    """n values of random payloads (names, keys, payloads) on the server."""
    rng = np.random.default_rng(n)
    c = server.client()
    names, keys, payloads = [], [], []
    for i in range(n):
        key = (i + 1, (i * 7919) | 1)
        payload = rng.integers(0, 256, plen, dtype=np.uint8)
        name = f"kvbm:test:r0:{block_dir.key_hex(key)}"
        c.set(name, b"".join(bytes(p) for p in remote_value.value_parts(key, FP, MK, payload, os.urandom(i * 37))))
        names.append(name)
        keys.append(key)
        payloads.append(payload)
    return names, keys, payloads


@pytest.mark.parametrize("plen", [1000, 200_000, 1 << 20])  # one group of many, groups of two, one per group
def test_values_land_verified_in_their_buffers_and_damage_is_reported_per_value(server, plen):
    names, keys, payloads = stored(server, 12, plen)
    c = server.client()
    c.delete(names[3])  # missing
    c.setrange(names[5], block_file.HEADER_SIZE + plen // 2, b"\x00\xff\x00")  # payload damaged
    c.set(names[7], c.get(names[7])[:-1])  # truncated (its metadata)
    v = c.get(names[9])
    c.set(names[9], v[:24] + bytes(16) + v[40:])  # another layout's fingerprint
    c.set(names[10], b"not a value at all")
    c.delete(names[11])
    c.rpush(names[11], b"a list")  # GET answers -WRONGTYPE
    outs = [np.zeros(plen, dtype=np.uint8) for _ in names]
    reader = resp.DirectClient(server.url)
    got = reader.fetch(names, keys, FP, MK, outs)
    bad = {3: remote_value.MISSING, 5: remote_value.BAD, 7: remote_value.BAD, 9: remote_value.BAD, 10: remote_value.BAD,
           11: remote_value.BAD}
    assert got == [bad.get(i, remote_value.OK) for i in range(len(names))]
    for i, (out, payload) in enumerate(zip(outs, payloads)):
        if i not in bad:
            assert np.array_equal(out, payload), i
    # the connection is still in step: the same reader fetches again, in another order
    order = [8, 0, 5, 2]
    outs = [np.zeros(plen, dtype=np.uint8) for _ in order]
    assert reader.fetch([names[i] for i in order], [keys[i] for i in order], FP, MK, outs) == [
        remote_value.OK, remote_value.OK, remote_value.BAD, remote_value.OK]
    assert np.array_equal(outs[0], payloads[8]) and np.array_equal(outs[3], payloads[2])
    reader.close()


def test_a_value_under_another_key_does_not_verify(server):
    names, keys, _ = stored(server, 2, 4096)
    out = [np.zeros(4096, dtype=np.uint8)]
    reader = resp.DirectClient(server.url)
    assert reader.fetch([names[0]], [keys[1]], FP, MK, out) == [remote_value.BAD]
    assert reader.fetch([names[0]], [keys[0]], FP, MK, out) == [remote_value.OK]


def test_a_paused_server_is_an_error_within_the_socket_timeout_and_the_reader_recovers(server):
    import time

    names, keys, payloads = stored(server, 4, 65536)
    reader = resp.DirectClient(server.url)
    outs = [np.zeros(65536, dtype=np.uint8) for _ in names]
    assert reader.fetch(names, keys, FP, MK, outs) == [remote_value.OK] * 4
    server.client().execute_command("CLIENT", "PAUSE", 1500)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        reader.fetch(names, keys, FP, MK, outs)
    assert time.monotonic() - t0 < resp.SOCKET_TIMEOUT + 0.3
    assert reader.sock is None  # closed: what was in flight must not be read as the next replies
    time.sleep(1.6)
    assert reader.fetch(names, keys, FP, MK, outs) == [remote_value.OK] * 4
    assert np.array_equal(outs[2], payloads[2])


def test_password_and_database_from_the_url(server):
    c = server.client()
    c.config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
    import redis

    r = redis.Redis.from_url(url)
    key, payload = (5, 7), np.arange(4096, dtype=np.uint8) % 251
    r.set("kvbm:x", b"".join(bytes(p) for p in remote_value.value_parts(key, FP, MK, payload, b"m")))
    out = [np.zeros(4096, dtype=np.uint8)]
    reader = resp.DirectClient(url)
    assert reader.fetch(["kvbm:x"], [key], FP, MK, out) == [remote_value.OK]
    assert np.array_equal(out[0], payload)
    assert resp.CLIENT_NAME in {cl["name"] for cl in r.client_list()}  # named as our other connections
    with pytest.raises(ConnectionError):
        resp.DirectClient(f"redis://:wrong@127.0.0.1:{server.port}/3").fetch(["kvbm:x"], [key], FP, MK, out)
    r.config_set("requirepass", "")


def test_a_connection_the_server_closed_is_reopened_without_a_miss(server):
    """A restarted server (or one that drops idle clients) closed the reader's connection since
    its last fetch: the next fetch opens a new one instead of failing, as redis-py's pool does."""
    names, keys, payloads = stored(server, 3, 4096)
    reader = resp.DirectClient(server.url)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in names]
    assert reader.fetch(names, keys, FP, MK, outs) == [remote_value.OK] * 3
    c = server.client()
    c.client_kill_filter(_type="normal", skipme=True)  # every connection but this one
    assert reader.fetch(names, keys, FP, MK, outs) == [remote_value.OK] * 3
    assert np.array_equal(outs[1], payloads[1])


def test_redis_py_replies_are_classified_as_the_direct_reader_reads_them(server):
    """The read path of TLS and cluster URLs (redis-py): the same outcome per value."""
    names, keys, payloads = stored(server, 4, 4096)
    c = server.client()
    c.delete(names[1])
    c.delete(names[2])
    c.rpush(names[2], b"a list")  # -WRONGTYPE
    at = block_file.HEADER_SIZE + 10
    c.setrange(names[3], at, bytes([c.get(names[3])[at] ^ 0xFF]))  # one payload byte flipped
    pipe = c.pipeline(transaction=False)
    for n in names:
        pipe.get(n)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in names]
    got = [remote_value.classify(v, k, FP, MK, o) for v, k, o in zip(pipe.execute(raise_on_error=False), keys, outs)]
    assert got == [remote_value.OK, remote_value.MISSING, remote_value.BAD, remote_value.BAD]
    assert np.array_equal(outs[0], payloads[0])
    assert resp.DirectClient(server.url).fetch(names, keys, FP, MK, outs) == got


def test_small_commands_reply_as_a_redis_py_pipeline_does(server):
    """The scheduler's lookups (EXISTS, SET NX) over `call`: the same replies as redis-py's, errors
    returned in place, and the connection stays in step for the fetches after them."""
    names, keys, payloads = stored(server, 2, 4096)
    server.client().rpush("kvbm:test:list", b"x")
    commands = [[b"EXISTS", names[0].encode()], [b"EXISTS", b"kvbm:test:absent"], [b"SET", b"kvbm:test:s", b"v", b"NX"],
                [b"SET", b"kvbm:test:s", b"w", b"NX"], [b"GET", b"kvbm:test:s"], [b"GET", b"kvbm:test:absent"],
                [b"INCR", b"kvbm:test:list"]]
    reader = resp.DirectClient(server.url)
    got = reader.call(commands)
    server.client().delete("kvbm:test:s")
    pipe = server.client().pipeline(transaction=False)
    for c in commands:
        pipe.execute_command(*c)
    want = pipe.execute(raise_on_error=False)
    assert got[:6] == want[:6] == [1, 0, b"OK", None, b"v", None]
    assert type(got[6]) is type(want[6]) and str(got[6]).startswith("WRONGTYPE")
    outs = [np.zeros(4096, dtype=np.uint8)]
    assert reader.fetch(names[1:], keys[1:], FP, MK, outs) == [remote_value.OK]
    assert np.array_equal(outs[0], payloads[1])


def test_stores_go_from_their_parts_and_a_refused_set_raises(server):
    """DirectClient.store sends each value from its parts (header, payload, metadata; values
    larger than the socket buffers go in partial sends) and they read back verified; a SET the
    server refuses (out of memory) raises, and the connection stays usable."""
    rng = np.random.default_rng(5)
    keys = [(i + 1, 3 * i + 1) for i in range(6)]
    payloads = [rng.integers(0, 256, 3 << 20, dtype=np.uint8) for _ in keys]
    names = [f"kvbm:test:r0:{block_dir.key_hex(k)}" for k in keys]
    d = resp.connect_direct(server.url)
    try:
        resp.store_values(d, names, [remote_value.value_parts(k, FP, MK, p, b"meta%d" % i)
                                          for i, (k, p) in enumerate(zip(keys, payloads))])
        outs = [np.empty_like(p) for p in payloads]
        assert resp.fetch_values(d, names, keys, FP, MK, outs) == [remote_value.OK] * len(keys)
        assert all((o == p).all() for o, p in zip(outs, payloads))
        c = server.client()
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", "1mb")
        with pytest.raises(ConnectionError, match="refused"):
            resp.store_values(d, names[:2], [remote_value.value_parts(k, FP, MK, p, b"") for k, p in
                                                  zip(keys[:2], payloads[:2])])
        c.config_set("maxmemory", "0")
        assert d.call([[b"EXISTS", names[0]]]) == [1]  # the same connection, in step
    finally:
        d.close()


def test_write_access_to_the_server_without_the_secret_cannot_plant_a_value(server):
    """Values a writer without the tier secret can make: the payload replaced by one that keeps
    the old checksum (the header and its MAC kept), a complete value whose MAC is made under
    another secret, a valid value of format 2 (checksum, no MAC). Each is BAD on both read paths."""
    from tests.unit.test_block_mac import ATTACKER, KEY, forged, old_header

    payload = os.urandom(4096)
    genuine = b"".join(bytes(p) for p in remote_value.value_parts(KEY, FP, MK, np.frombuffer(payload, np.uint8), b"m"))
    fake = forged(payload)
    values = [genuine,
              genuine[:block_file.HEADER_SIZE] + fake + b"m",
              b"".join(bytes(p) for p in remote_value.value_parts(KEY, FP, ATTACKER, np.frombuffer(fake, np.uint8), b"m")),
              old_header(payload, b"m") + payload + b"m"]
    c = server.client()
    names = [f"kvbm:test:r0:forged{i}" for i in range(len(values))]
    for name, v in zip(names, values):
        c.set(name, v)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in names]
    want = [remote_value.OK] + [remote_value.BAD] * 3
    assert resp.DirectClient(server.url).fetch(names, [KEY] * 4, FP, MK, outs) == want
    assert outs[0].tobytes() == payload
    assert [remote_value.classify(c.get(n), KEY, FP, MK, o) for n, o in zip(names, outs)] == want
