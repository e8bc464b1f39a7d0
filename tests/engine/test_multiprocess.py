"""Multi-process engine (EngineCore and worker in their own processes)."""

import os
import random

import pytest

from .test_hybrid_engine import P100, fine, flat

pytestmark = pytest.mark.slow


def test_hybrid_hash_granularity_across_processes(run_engine):
    r = run_engine({"model": "qwen3next", "steps": [{"prompts": [P100]}]},
                   env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # test-only: RPC a probe function
    assert r["worker_hash_block_size"] == [32]  # the worker process
    assert [g["hash_block_size"] for g in r["group_metadata"]] == [32, 32]  # EngineCore, by RPC
    units = fine(flat(r))
    assert len(units) == 1 and units[0].token_ids == P100[:96] and units[0].parent_block_hash is None


def test_tiers_across_processes(run_engine, tmp_path):
    """KVBMConnector with EngineCore and the worker in their own processes: the scheduler side
    plans, the worker copies, a second engine process hits on disk; outputs identical.

    The last request's blocks are written to disk behind it (fsynced: slower than the one step
    vLLM's engine core takes after a request ends) and no request follows: the engine core keeps
    stepping while KVBMConnector.has_pending_push_work, so their STORAGE events still go out."""
    from vllm_kvbm_plugin.events.types import MEDIUM_STORAGE, BlockStored

    from .helpers import batches, outputs, validate
    from .test_tiers_engine import HIT, PROMPT, REPEAT, spec

    last = [random.Random(5).randrange(10, 2000) for _ in range(1000)]  # 31 blocks, in one step
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    r = run_engine(spec(REPEAT + [{"prompts": [last], "max_tokens": 1}], events=True, cpu_bytes_to_use=4 << 20,
                        disk_path=str(tmp_path), disk_fsync=True), env=env)
    first, again, _ = outputs(r)
    assert again["num_cached_tokens"] == HIT and again["tokens"] == first["tokens"]
    stored = [ev for _, b in batches(r) for ev in b.events
              if isinstance(ev, BlockStored) and ev.medium == MEDIUM_STORAGE]
    written = {tuple(ev.token_ids[i:i + 32]) for ev in stored for i in range(0, len(ev.token_ids), 32)}
    missing = [i for i in range(len(last) // 32) if tuple(last[i * 32:(i + 1) * 32]) not in written]
    assert not missing, f"STORAGE BlockStored never published for blocks {missing} of the last request"
    v = validate(r)
    assert v.errors == 0, v.report()["first_problems"]
    r2 = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)), env=env)
    (o,) = outputs(r2)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == first["tokens"]


def test_tiers_with_tensor_parallel_workers(run_engine, tmp_path):
    """Two tensor-parallel workers: each keeps its own KV shard in its pool and its own rank
    directory; the scheduler side counts a block done once both reported it; a CPU hit, a disk hit
    in a new engine process with a CPU tier smaller than the hit (direct disk loads on both ranks)
    and a remote hit in a third (no disk tier) give the tokens of the run that computed them.

    One decision per engine: Redis refusing the first connection of an engine's start (under the
    old design a worker's own secret read, so that rank alone ran without the remote tier and
    crashed at the first remote write planned for it) turns the remote tier off everywhere; the
    workers follow the scheduler side and never connect themselves; one secret, one tier directory.

    The Redis needs a user and a password (ACL), given as docs/remote.md says: the user in
    remote_url, the password in KVBM_REMOTE_PASSWORD. It appears in no engine's log (ours, and
    vLLM's, which prints the whole kv_transfer_config)."""
    import redis

    from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary
    from vllm_kvbm_plugin.testing.tcp_proxy import RefusingProxy

    from .helpers import outputs
    from .test_tiers_engine import HIT, PROMPT, REPEAT, spec

    if server_binary() is None:
        pytest.skip("no redis-server on PATH: scripts/setup.sh installs Debian's as root")
    password = "pw-" + os.urandom(12).hex()
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind",  # one NUMA node here: vLLM cannot bind 2 workers
           "KVBM_REMOTE_PASSWORD": password}
    logs = []

    def tp(steps, cpu=4 << 20, **tiers):
        s = spec(steps, cpu_bytes_to_use=cpu, **tiers)
        s["llm"]["tensor_parallel_size"] = 2
        r = run_engine(s, env=env)
        logs.append(r["log"])
        return r

    server = RedisServer(extra_args=("--user", "kvbm", "on", f">{password}", "~*", "&*", "+@all",
                                     "--user", "default", "on", "nopass", "-@all", "+ping")).start()
    url = f"redis://kvbm@127.0.0.1:{server.port}/0"
    try:
        r = tp(REPEAT, disk_path=str(tmp_path), remote_url=url)
        assert "redis://***@127.0.0.1" in r["log"]  # our startup line names the server, redacted
        first, again = outputs(r)
        assert again["num_cached_tokens"] == HIT and again["tokens"] == first["tokens"]
        ranks = {p.parent.parent.name: {f.name for f in p.parent.parent.rglob("*.kvb")}
                 for p in tmp_path.rglob("*.kvb")}
        assert sorted(ranks) == ["r0", "r1"] and ranks["r0"] == ranks["r1"] and len(ranks["r0"]) == HIT // 32
        # the two shards differ: each rank wrote its own half of the heads
        f0 = sorted(tmp_path.rglob("r0/*/*.kvb"))[0]
        assert f0.read_bytes() != (f0.parents[2] / "r1" / f0.parent.name / f0.name).read_bytes()
        client = redis.Redis(port=server.port, username="kvbm", password=password)
        assert len(client.keys("kvbm:*")) == 2 * HIT // 32  # a value per block and rank
        r = tp([{"prompts": [PROMPT]}], cpu=2 * 8192, disk_path=str(tmp_path))  # two slots of a rank's half block
        (o,) = outputs(r)
        assert o["num_cached_tokens"] == HIT and o["tokens"] == first["tokens"]
        r = tp([{"prompts": [PROMPT]}], remote_url=url)  # the remote tier alone
        (o,) = outputs(r)
        assert o["num_cached_tokens"] == HIT and o["tokens"] == first["tokens"]

        proxy = RefusingProxy(("127.0.0.1", server.port), refuse={0})
        try:  # 40 tokens complete block 7: a store, written through to every tier that is on
            r = tp([{"prompts": [PROMPT], "max_tokens": 40}], disk_path=str(tmp_path),
                   remote_url=f"redis://kvbm@127.0.0.1:{proxy.port}/0")
        finally:
            proxy.close()
        (o,) = outputs(r)
        assert o["num_cached_tokens"] == HIT and o["tokens"][:8] == first["tokens"]
        assert proxy.accepted == 1, "a worker connected to the remote tier the scheduler side turned off"
        assert "the remote tier is off for this process" in r["log"]
        assert r["log"].count("follows the scheduler side") == 2 and "remote=False" in r["log"]
        tier_dirs = {p.parents[2] for p in tmp_path.rglob("*.kvb")}
        assert len(tier_dirs) == 1, f"two secrets: {sorted(tier_dirs)}"
        assert not any(password in log for log in logs)
    finally:
        server.stop()
