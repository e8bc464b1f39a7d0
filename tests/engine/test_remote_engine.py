"""The shared remote tier on real engines (tiny Llama) with a real redis-server: one engine
process stores, another (its own small CPU tier, no disk tier) hits what the first stored, and the
tokens are those of a run without the connector. A dead server costs nothing but the hit."""

import random

import pytest

from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary

from .helpers import outputs
from .test_tiers_engine import HIT, PROMPT, spec

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    server_binary() is None, reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")]


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def baseline(run_engine):
    return run_engine({"model": "llama", "llm": {"max_model_len": 1024}, "events": False,
                       "steps": [{"prompts": [PROMPT]}]})


def test_second_engine_hits_what_the_first_stored(run_engine, baseline, server):
    a = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, remote_url=server.url))
    assert outputs(a)[0]["num_cached_tokens"] == 0
    assert server.client().dbsize() == HIT // 32  # one value per block (one rank)
    b = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, remote_url=server.url))
    (o,) = outputs(b)
    assert o["num_cached_tokens"] == HIT  # B never computed it
    assert o["tokens"] == outputs(baseline)[0]["tokens"]
    assert b["connector"]["remote"] == {"fetching": 0, "writing": 0}
    assert "Traceback" not in a["log"] + b["log"]


def test_dead_server_is_a_miss(run_engine, baseline, server):
    server.kill()
    r = run_engine(spec([{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}],
                        cpu_bytes_to_use=4 << 20, remote_url=server.url))
    first, again = outputs(r)
    assert first["tokens"] == again["tokens"] == outputs(baseline)[0]["tokens"]
    assert again["num_cached_tokens"] == HIT  # the CPU tier still serves
    assert "Traceback" not in r["log"]
    assert "every remote lookup, read and write is a miss" in r["log"]


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
