"""The shared remote tier on real engines with a real redis-server: one engine process stores,
another (its own small CPU tier, no disk tier) hits what the first stored (tiny Llama, hybrid
Qwen3-Next, Qwen2-VL with images), and the tokens are those of a run without the connector. One
engine goes through the server's failures (SIGKILL between requests and during a write burst,
restarts, CLIENT PAUSE): every request is served with the same tokens, no step waits, hits resume,
and vLLM's Prometheus logger exports the tier's counters."""

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary

from .helpers import outputs
from .test_tiers_engine import HIT, PROMPT, spec

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    server_binary() is None, reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGET_MS = 5.0


@pytest.fixture(scope="module")
def module_server():
    s = RedisServer().start()
    yield s
    s.stop()


@pytest.fixture
def server(module_server):
    module_server.client().flushall()
    return module_server


def _prompts() -> dict:
    rng = random.Random(23)

    def some(n):
        return [[rng.randrange(10, 2000) for _ in range(200)] for _ in range(n)]

    after_restart = some(2)
    return {"first": PROMPT, "while_down": some(1)[0], "burst": some(8), "after_restart": after_restart,
            "fill": some(12), "hit": after_restart[0], "paused": [after_restart[1]] + some(5),
            "after_pause": some(1)[0]}


def faults_run(tmp_path_factory, connector: bool) -> dict:
    """remote_faults_run in a fresh process (its own session: nothing it starts outlives it)."""
    d = tmp_path_factory.mktemp("remote-faults")
    (d / "spec.json").write_text(json.dumps({"connector": connector, "budget_ms": BUDGET_MS, "prompts": _prompts()}))
    with open(d / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.engine.remote_faults_run", d / "spec.json",
                                 d / "out.json"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = (d / "log.txt").read_text()
    if rc != 0 or not (d / "out.json").exists():
        pytest.fail(f"engine run failed ({rc}); log tail:\n{text[-4000:]}")
    return {**json.loads((d / "out.json").read_text()), "log": text}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Every request of the fault run, in the same batches, without a connector."""
    return faults_run(tmp_path_factory, connector=False)["outputs"]


def test_second_engine_hits_what_the_first_stored(run_engine, baseline, server):
    a = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, remote_url=server.url))
    assert outputs(a)[0]["num_cached_tokens"] == 0
    assert server.client().dbsize() == HIT // 32 + 1  # one value per block (one rank), and the key secret
    b = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, remote_url=server.url))
    (o,) = outputs(b)
    assert o["num_cached_tokens"] == HIT  # B never computed it
    assert o["tokens"] == baseline["first"][0]["tokens"]
    assert b["connector"]["remote"] == {"fetching": 0, "writing": 0}
    assert "Traceback" not in a["log"] + b["log"]


def test_a_tier_from_a_module_after_remote_hits_once_the_others_are_gone(run_engine, baseline, server, tmp_path):
    """A fourth tier added through the contracts alone (testing/fake_tier.py, named in
    tier_module_paths) below the disk and remote tiers: A writes the prompt through to all three;
    with the disk tier's files and the server's values gone (the secret kept), B's hit comes from the
    fourth tier alone, with the cold run's tokens."""
    import shutil

    extra = dict(cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path), remote_url=server.url,
                 tier_module_paths=["vllm_kvbm_plugin.testing.fake_tier"])
    a = run_engine(spec([{"prompts": [PROMPT]}], **extra))
    assert outputs(a)[0]["num_cached_tokens"] == 0
    assert len(list((tmp_path / "fake-tier").iterdir())) == HIT // 32
    assert a["connector"]["fake"] == {"fetching": 0, "writing": 0}
    c = server.client()
    values = [n for n in c.scan_iter(match="kvbm:*") if b"key-secret" not in n]
    assert len(values) == HIT // 32 and list(tmp_path.rglob("*.kvb"))  # the tiers above stored it too
    c.delete(*values)
    for d in tmp_path.iterdir():  # the disk tier's directory; its secret and the fourth tier's files stay
        if d.is_dir() and d.name != "fake-tier":
            shutil.rmtree(d)
    b = run_engine(spec([{"prompts": [PROMPT]}], **extra))
    (o,) = outputs(b)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == baseline["first"][0]["tokens"]
    assert b["connector"]["fake"] == {"fetching": 0, "writing": 0} and "Traceback" not in a["log"] + b["log"]
    assert "fake tier under" in b["log"]


def test_damaged_and_foreign_values_are_misses_and_replaced(run_engine, baseline, server):
    """Every value A stored damaged one of three ways (a payload byte flipped with SETRANGE,
    truncated, another layout's fingerprint): B computes the whole prompt with the tokens of a
    run without the connector, deletes each bad value and writes a good one in its place."""
    from vllm_kvbm_plugin.tiers import block_file
    from vllm_kvbm_plugin.tiers import inspector

    run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, remote_url=server.url))
    c = server.client()
    names = sorted(n for n in c.scan_iter(match="kvbm:*") if b"key-secret" not in n)
    assert len(names) == HIT // 32
    # the operator's check (`tiers inspect --verify`) of what the engine wrote
    assert inspector.inspect(server.url, verify=True)["verify"] == {"checked": 6, "failed": 0, "other_fingerprint": 0}
    good, damaged = {}, {}
    for i, name in enumerate(names):
        v = good[name] = c.get(name)
        at = block_file.HEADER_SIZE + 100
        damaged[name] = [v[:at] + bytes([v[at] ^ 0xFF]) + v[at + 1:], v[:-1], v[:24] + bytes(16) + v[40:]][i % 3]
        c.set(name, damaged[name])
    # flipped, truncated and re-labelled values all fail: the MAC covers the header's fingerprint,
    # so none of them is an intact entry of another layout
    assert inspector.inspect(server.url, verify=True)["verify"] == {"checked": 6, "failed": 6, "other_fingerprint": 0}
    b = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, remote_url=server.url))
    (o,) = outputs(b)
    assert o["num_cached_tokens"] == 0 and o["tokens"] == baseline["first"][0]["tokens"]
    for name in names:  # B wrote it again: a complete value, none of the damaged bytes
        v = c.get(name)
        assert v is not None and len(v) == len(good[name]) and v != damaged[name], name
    assert b["connector"]["remote"] == {"fetching": 0, "writing": 0}
    assert "Traceback" not in b["log"]


def test_server_failures_are_misses_and_hits_resume(tmp_path_factory, baseline):
    r = faults_run(tmp_path_factory, connector=True)
    facts, out = r["facts"], r["outputs"]
    for name, runs in out.items():  # every request served, tokens as without the connector
        want = [o["tokens"] for o in baseline[name]]
        for i in range(0, len(runs), len(want)):
            assert [o["tokens"] for o in runs[i:i + len(want)]] == want, name
    assert "Traceback" not in r["log"]
    assert "every remote lookup, read and write is a miss" in r["log"]
    # SIGKILL between requests: stored before, a miss after
    assert facts["stored_before_kill"] and out["while_down"][0]["num_cached_tokens"] == 0
    # SIGKILL during the write burst: writes were in flight, and they failed as misses
    assert facts["writing_at_kill"] > 0
    assert facts["counters"]["write_failures"] > 0
    # restarted on the same port: stores resume and a stored prefix is a remote hit, same engine
    assert facts["breakers_ready"] and facts["stored_after_restart"]
    assert out["hit"][0]["num_cached_tokens"] == HIT and facts["fetched_for_hit"] == HIT // 32
    assert facts["breakers"]["worker"][1] >= 1 and facts["breakers"]["scheduler"][1] >= 1  # closed again
    # CLIENT PAUSE 3000: the requests ran while paused, and no step waited for the server
    assert facts["pause_run_s"] < 3.0 and facts["steps_timed"] > 0
    assert facts["pause_misses"] > 0  # the paused server was asked (late lookups or failed fetches)
    for call, seconds in facts["longest"].items():
        assert seconds < (BUDGET_MS + 50) / 1000, f"{call} took {seconds * 1000:.0f} ms"
    assert [o["num_cached_tokens"] for o in out["paused"]] == [0] * 6  # all misses, all served
    assert facts["accounting"]["remote"] == {"fetching": 0, "writing": 0}
    # vLLM's Prometheus stat logger has the tier's counters
    m = facts["metrics"]
    assert m["vllm:kvbm_remote_hits_total{}"] >= HIT // 32
    assert m["vllm:kvbm_remote_misses_total{}"] > 0
    assert m["vllm:kvbm_blocks_total{direction=read,tier=remote}"] == facts["counters"]["fetched"]
    assert m["vllm:kvbm_bytes_total{direction=write,tier=remote}"] >= facts["counters"]["written"] * 16384
    assert m["vllm:kvbm_remote_errors_total{operation=write}"] == facts["counters"]["write_failures"]
    for side in ("scheduler", "worker"):
        for state, n in zip(("open", "closed"), facts["breakers"][side]):
            assert m.get(f"vllm:kvbm_remote_breaker_changes_total{{side={side},state={state}}}", 0) == n > 0


def test_hybrid_second_engine_hits_attention_kv_and_state(run_engine, server):
    from .test_hybrid_tiers import LENGTHS, LLM, PROMPTS, expected_hit
    from .test_tiers_engine import connector

    def run(**extra):
        llm = dict(LLM, kv_transfer_config=connector(**extra)) if extra else LLM
        return outputs(run_engine({"model": "qwen3next", "llm": llm, "events": False,
                                   "steps": [{"prompts": PROMPTS}]}))

    baseline = [o["tokens"] for o in run()]
    a = run(cpu_bytes_to_use=64 << 20, remote_url=server.url)
    assert [o["num_cached_tokens"] for o in a] == [0] * len(PROMPTS)
    b = run(cpu_bytes_to_use=64 << 20, remote_url=server.url)
    assert [o["num_cached_tokens"] for o in b] == [expected_hit(n) for n in LENGTHS]
    assert [o["tokens"] for o in a] == [o["tokens"] for o in b] == baseline


def test_images_second_engine_hits_as_the_local_tiers(run_engine, server):
    """Tiny Qwen2-VL: B hits what A stored exactly where a CPU-tier hit would (the same images
    up to the last full unit, other images up to the unit holding the first image token)."""
    from .test_multimodal_engine import CASES, TEXT_ONLY, UNIT, image_prompt
    from .test_tiers_engine import connector

    model = "qwen2vl"

    def batch(rgb):
        return [image_prompt(model, c, rgb)[0] for c in CASES[model]] + [TEXT_ONLY]

    red, blue = batch([255, 0, 0]), batch([0, 0, 255])
    llm = {"max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}}
    remote = {**llm, "kv_transfer_config": connector(cpu_bytes_to_use=64 << 20, remote_url=server.url)}
    plain = outputs(run_engine({"model": model, "llm": llm, "events": False,
                                "steps": [{"prompts": red}, {"reset": True}, {"prompts": blue}]}))
    a = outputs(run_engine({"model": model, "llm": remote, "events": False, "steps": [{"prompts": red}]}))
    b = outputs(run_engine({"model": model, "llm": remote, "events": False,
                            "steps": [{"prompts": red}, {"reset": True}, {"prompts": blue}]}))
    assert [o["tokens"] for o in a + b[len(red):]] == [o["tokens"] for o in plain]
    assert [o["tokens"] for o in b[:len(red)]] == [o["tokens"] for o in plain[:len(red)]]
    for i, case in enumerate([*CASES[model], "text_only"]):
        if case == "text_only":
            image_at = length = len(TEXT_ONLY)
        else:
            _, image_at, length = image_prompt(model, case, [0, 0, 0])
        full = (length - 1) // UNIT * UNIT
        hits = (a[i]["num_cached_tokens"], b[i]["num_cached_tokens"], b[len(red) + i]["num_cached_tokens"])
        assert hits == (0, full, min(full, image_at // UNIT * UNIT)), case

