"""The shared remote tier (Redis / Valkey) with a real redis-server: two scheduler sides ("instances",
each inside vLLM's real Scheduler with real WorkerSides and a KV-checking stand-in forward) share
one server. Whatever B loads is checked against what a recompute writes (SimulatedWorker.check);
a failing server (killed, restarted, paused) or a bad value is a miss, never an error."""

import random
import threading
import time

import pytest

from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, MEDIUM_STORAGE, BlockStored
from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.redis_server import server_binary
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = pytest.mark.skipif(server_binary() is None,
                                reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")

rng = random.Random(1)


def prompt(n: int = 200) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def instance(url: str, hybrid: bool = False, **connector) -> SchedulerHarness:
    geometry = dict(block_size=160, hash_block_size=32) if hybrid else dict(block_size=32, hash_block_size=None)
    return SchedulerHarness(HarnessConfig(hybrid=hybrid, num_blocks=64, connector={
        "cpu_bytes_to_use": 1 << 24, "remote_url": url, **connector}, **geometry))


def idle(h: SchedulerHarness) -> bool:
    acc = h.connector.accounting()
    return (acc["remote"] == {"fetching": 0, "writing": 0} and acc["reports_pending"] == 0
            and acc["cpu"]["busy"] == 0)


@pytest.mark.parametrize("hybrid, n, hit", [(False, 200, 192), (True, 200, 192), (False, 192, 191)])
def test_instance_b_hits_what_instance_a_stored(server, hybrid, n, hit):
    """n=192 ends on a block boundary: its last block is fetched too, vLLM computes one token."""
    # remote_events "instance": each instance announces its own writes (no announcer here)
    a, b = instance(server.url, hybrid, remote_events="instance"), instance(server.url, hybrid, remote_events="instance")
    p = prompt(n)
    assert a.serve(p) == 0
    assert server.client().dbsize() > 0
    assert b.serve(p) == hit  # B never computed it: loaded from the server, KV checked
    assert b.connector.tier("remote").counters["fetched"] > 0
    assert idle(a) and idle(b)
    remote = [ev for batch in a.batches for ev in batch.events
              if isinstance(ev, BlockStored) and ev.medium == MEDIUM_STORAGE]
    assert remote and all(ev.locality == LOCALITY_REMOTE and ev.ownership == a.connector.tier("remote").name.ownership
                          for ev in remote)
    for h in (a, b):  # each instance's stream (vLLM's, CPU, remote tier) is consistent
        v = Validator()
        for batch in h.batches:
            v.apply(batch)
        assert v.errors == 0, v.report()


@pytest.fixture
def thread_errors():
    """Exceptions raised in any thread (the remote I/O threads must never raise)."""
    errors, hook = [], threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    yield errors
    threading.excepthook = hook


def wait_backoff(h: SchedulerHarness) -> None:
    """Let the breakers' backoff end, the scheduler side's and every worker's (a worker's grows
    with each failed batch while the server is down), so the next call probes the server."""
    breakers = [h.connector.tier("remote").breaker]
    breakers += [w.side.tier("remote").breaker for w in h.workers if w.side.tier("remote") is not None]
    time.sleep(breakers[0].MIN_BACKOFF + 0.1)
    deadline = time.monotonic() + 30
    while not all(b.allow_soon() for b in breakers):
        assert time.monotonic() < deadline, "a breaker stays open"
        time.sleep(0.05)


def test_server_killed_between_requests_is_a_miss_and_hits_resume_after_restart(server, thread_errors):
    a, b = instance(server.url), instance(server.url)
    p, q = prompt(), prompt()
    assert a.serve(p) == 0
    server.kill()
    assert b.serve(p) == 0  # a miss, computed; every step checked the KV
    assert b.connector.tier("remote").breaker.opened == 1
    assert a.serve(prompt()) == 0  # A's writes fail too: never an error
    server.start()  # empty, same port
    wait_backoff(a)
    assert a.serve(q) == 0
    assert server.client().dbsize() > 0  # A stores again without a restart
    wait_backoff(b)
    assert b.serve(q) == 192  # and B hits again
    assert not b.connector.tier("remote").breaker.is_open()
    assert idle(a) and idle(b)
    assert not thread_errors


def test_server_killed_during_a_write_burst(server, thread_errors):
    a = instance(server.url)
    prompts = [prompt() for _ in range(6)]  # 6 x 8 blocks: no preemption
    ids = [a.add(t, max_tokens=40) for t in prompts]  # decoding completes another block each
    a.step()  # the prompts' blocks: written behind
    server.kill()
    deadline = time.monotonic() + 30
    while a.scheduler.has_unfinished_requests():
        a.step()
        assert time.monotonic() < deadline
    a.settle()
    assert set(ids) <= set(a.cached_tokens)
    seen = a.connector.tier("remote").counters  # writes that failed, or lookups (then no more writes were tried)
    assert seen["write_failures"] + seen["lookup_failures"] > 0, seen
    assert idle(a)
    assert not thread_errors
    server.start()
    wait_backoff(a)
    b = instance(server.url)
    assert a.serve(prompts[0]) == 192  # A's own CPU tier
    a.reset_prefix_cache()
    r = prompt()
    assert a.serve(r) == 0
    assert b.serve(r) == 192


def test_client_pause_never_stalls_a_step(server, thread_errors):
    budget_ms = 5.0
    a, b = instance(server.url), instance(server.url, remote_lookup_budget_ms=budget_ms)
    p = prompt()
    assert a.serve(p) == 0
    server.client().execute_command("CLIENT", "PAUSE", 3000)
    t_pause = time.monotonic()
    longest = _time_scheduler(b)
    for t in [p] + [prompt() for _ in range(5)]:
        b.add(t, max_tokens=4)
    while b.scheduler.has_unfinished_requests():
        b.step()
    longest = max(longest)
    assert time.monotonic() - t_pause < 3.0, "the test must run while the server is paused"
    assert longest < (budget_ms + 50) / 1000, f"a step took {longest * 1000:.0f} ms"
    b.settle()
    assert b.connector.tier("remote").counters["fetched"] == 0  # every remote lookup was a miss
    assert not thread_errors


def _time_scheduler(h: SchedulerHarness) -> list:
    """Durations of the scheduler's own work per step (schedule, update_from_output: where the
    connector's scheduler side runs), without the harness's stand-in forward."""
    times = [0.0]
    for name in ("schedule", "update_from_output"):
        f = getattr(h.scheduler, name)

        def timed(*args, _f=f, **kwargs):
            t0 = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t0)
        setattr(h.scheduler, name, timed)
    return times


@pytest.mark.parametrize("damage", ["setrange", "truncate", "other_layout"])
def test_bad_values_are_misses_and_deleted(server, damage):
    a, b = instance(server.url), instance(server.url)
    p = prompt()
    assert a.serve(p) == 0
    # the value of block 2 (keys are per block; find it by B's own key naming)
    name = b.connector.tier("remote").names(_block_key(b, p, 2))[0].encode()
    c = server.client()
    value = c.get(name)
    assert value is not None
    if damage == "setrange":
        c.setrange(name, 64 + 100, b"\xff\xfe")
    elif damage == "truncate":
        c.set(name, value[:-10])
    else:  # the same key written by another model or layout: its header names another fingerprint
        c.set(name, value[:24] + bytes(16) + value[40:])
    assert b.serve(p) == 2 * 32  # the leading run before the bad value
    assert b.connector.tier("remote").counters["fetch_misses"] == 1
    assert c.get(name) == value  # deleted, then B wrote the block it computed: the good bytes again


def _block_key(h: SchedulerHarness, tokens: list[int], i: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from vllm_kvbm_plugin.connector.scheduler import RequestKeys

    st = RequestKeys(Request("probe", list(tokens), SamplingParams(max_tokens=1), None), [])
    return h.connector._block_key(st, i)


def test_remote_config_is_validated():
    from vllm_kvbm_plugin.config import KVBMConfig

    assert KVBMConfig.from_extra({"remote_url": "unix:///run/redis.sock"}).remote_url == "unix:///run/redis.sock"
    for bad in ({"remote_url": "http://x"}, {"remote_url": 5}, {"remote_lookup_budget_ms": -1},
                {"remote_lookup_budget_ms": True}):
        with pytest.raises(ValueError, match="remote_"):
            KVBMConfig.from_extra(bad)


def test_an_evicted_block_key_secret_is_written_back(server):
    """The server may evict the store's block-key secret like any key (allkeys-lru): an instance
    starting then would write a new one and share nothing with the fleet. Lookups write it back."""
    from vllm_kvbm_plugin.tiers.secret import REMOTE_NAME

    a = instance(server.url)
    c = server.client()
    secret = c.get(REMOTE_NAME)
    assert secret is not None and a.connector.tier("remote").secret_hex == secret.decode()
    c.delete(REMOTE_NAME)  # as an eviction would
    assert a.serve(prompt()) == 0  # its lookup
    assert c.get(REMOTE_NAME) == secret


def _value_sets(client) -> int:
    """SET commands the server ran (values; the block-key secret's SET NX is kept out by the test)."""
    return client.info("commandstats").get("cmdstat_set", {}).get("calls", 0)


def test_a_block_is_written_once_while_present_and_again_once_the_server_lost_it(server, thread_errors):
    """Issue 31: every pass over a CPU-tier block (a hit re-walks it) used to write it to the
    server again once PRESENT_TTL had passed. Now a stale key is confirmed with EXISTS, and
    written again only when the server lost it (restarted empty, as the soak does)."""
    a = instance(server.url)
    remote = a.connector.tier("remote")
    remote.PRESENT_TTL = 0.05  # every later pass finds the keys stale
    remote.SECRET_KEEP = 1e9  # no SET NX of the block-key secret during the count
    c = server.client()
    p = prompt()
    assert a.serve(p) == 0
    first = _value_sets(c)
    assert first >= 6  # 6 full blocks
    for _ in range(3):
        time.sleep(0.1)
        assert a.reset_prefix_cache()
        assert a.serve(p) == 192  # from A's CPU tier; the store pass re-walks the blocks
    assert _value_sets(c) == first  # none written again
    assert remote.counters["confirm_keys"] >= 6 and remote.counters["confirm_missing"] == 0
    server.kill()
    server.start()  # empty, same port
    c = server.client()
    for _ in range(3):  # a pass finds them stale and asks; a later one writes what is missing
        time.sleep(0.1)
        assert a.reset_prefix_cache()
        assert a.serve(p) == 192
        wait_backoff(a)
    assert _value_sets(c) >= 6 and c.dbsize() >= 6
    assert instance(server.url).serve(p) == 192  # another instance hits them again
    assert idle(a)
    assert not thread_errors
