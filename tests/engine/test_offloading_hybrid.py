"""Hybrid models through vLLM's own OffloadingConnector with KVBMOffloadingSpec (our CPU worker, our
policy, KVBMDiskTier and KVBMRemoteTier): attention blocks and the recurrent state (GDN, Mamba2)
offloaded and loaded back. Every hit must give the tokens, and the first-token logprobs, of an
engine that caches nothing (the oracle of test_hybrid_prefix_oracle.py); the router index predicts
the hits from the recorded events; damaged disk files and Redis values are misses."""

import random

import pytest

from vllm_kvbm_plugin.events.index import KVIndex, WorkerConfig
from vllm_kvbm_plugin.tiers import block_file

from .helpers import index_predictions, outputs, validate
from .test_hybrid_prefix_oracle import TOL, logprob_gap
from .test_offloading_engine import flip_high_bytes

pytestmark = pytest.mark.engine
rng = random.Random(30)
P = [rng.randrange(10, 2000) for _ in range(700)]
Q = P[:500] + [rng.randrange(10, 2000) for _ in range(150)]
MODELS = {"qwen3next": {"mamba_ssm_cache_dtype": "float32"}, "granite-hybrid": {"max_num_batched_tokens": 96}}


WARM_UP = {"prompts": [[5]], "max_tokens": 1}


def router_config(result, **kw) -> WorkerConfig:
    """What a router knows of these engines: their sizes and the offloading connector."""
    return WorkerConfig(hash_block_size=result["hash_block_size"], block_size=result["block_size"],
                        connector="OffloadingConnector", **kw)


def offloading(**extra):
    cfg = {"spec_name": "KVBMOffloadingSpec", "spec_module_path": "vllm_kvbm_plugin.offloading",
           "cpu_bytes_to_use": 64 << 20, **extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": cfg}


def step(*prompts):
    return {"prompts": list(prompts), "logprobs": 5, "max_tokens": 6}


def spec(model, steps, events=True, **extra):
    llm = {**MODELS[model], "max_model_len": 2048, "kv_transfer_config": offloading(**extra)}
    return {"model": model, "events": events, "steps": steps, "llm": llm}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return request.param


@pytest.fixture(scope="module")
def reference(run_engine, model):
    llm = {**MODELS[model], "max_model_len": 2048, "enable_prefix_caching": False}
    r = run_engine({"model": model, "events": False, "llm": llm, "steps": [step(P), step(Q)]},
                   env={"KVBM_DISABLE": "1"})
    return dict(zip(("P", "Q"), outputs(r)))


def same(got, ref):
    assert got["tokens"] == ref["tokens"], (got["num_cached_tokens"], got["tokens"], ref["tokens"])
    assert logprob_gap(got, ref) <= TOL


def test_cpu_then_disk_in_a_new_process(run_engine, model, reference, tmp_path):
    r = run_engine(spec(model, [step(P), {"reset": True}, step(P), step(Q)], disk_path=str(tmp_path)))
    cold, again, branch = outputs(r)
    print(f"\n{model}: block {r['block_size']}, hits {again['num_cached_tokens']} {branch['num_cached_tokens']}")
    assert cold["num_cached_tokens"] == 0 and again["num_cached_tokens"] > 0
    for got, ref in ((cold, "P"), (again, "P"), (branch, "Q")):
        same(got, reference[ref])
    rep = validate(r).report()
    assert rep["errors"] == 0, rep["first_problems"]
    assert _tiers_announced(rep) >= {"CPU", "STORAGE:LOCAL"}
    # the router index, fed the stream (GPU units, CPU and disk tier events), predicts every hit
    predicted = index_predictions(r, [P, P, Q], router_config(r))
    assert all(p == served for p, served in predicted), predicted
    # a new process on the same disk: the restart index, promoted through the CPU tier (a first
    # one-token step announces the restart index, as any first step of a server would)
    r2 = run_engine(spec(model, [WARM_UP, step(P)], disk_path=str(tmp_path)))
    _, o = outputs(r2)
    print(f"  disk hit in a new process: {o['num_cached_tokens']}")
    assert 0 < o["num_cached_tokens"] <= again["num_cached_tokens"]
    same(o, reference["P"])
    assert validate(r2).errors == 0
    # the disk tier's restart index is announced: the index predicts the hit from that stream alone
    assert index_predictions(r2, WARM_UP["prompts"] + [P], router_config(r2)) == [(0, 0), (o["num_cached_tokens"],) * 2]
    # every file damaged (bytes flipped, truncated, or another file's entry): all misses, whether
    # the restart scan or the load finds the damage
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    for i, f in enumerate(files):
        if i % 3 == 0:
            flip_high_bytes(str(f), block_file.HEADER_SIZE)
        elif i % 3 == 1:
            f.write_bytes(f.read_bytes()[:-7])
        else:
            f.write_bytes(files[(i + 1) % len(files)].read_bytes() if len(files) > 1 else b"")
    r3 = run_engine(spec(model, [step(P)], disk_path=str(tmp_path)))
    (o,) = outputs(r3)
    assert o["num_cached_tokens"] == 0
    same(o, reference["P"])
    assert validate(r3).errors == 0


def _tiers_announced(report) -> set:
    """"CPU", "STORAGE:LOCAL", "STORAGE:REMOTE": the offload tiers a validator report saw stores in."""
    return {":".join(t.split(":")[:2]) for t, c in report["tiers"].items() if t != "GPU" and c["stored"]}


def test_remote_tier_hits_in_a_second_process(run_engine, model, reference, redis_server):
    remote = [{"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading", "url": redis_server.url}]
    r = run_engine(spec(model, [step(P)], secondary_tiers=remote))
    same(outputs(r)[0], reference["P"])
    r2 = run_engine(spec(model, [step(P)], secondary_tiers=remote))
    (o,) = outputs(r2)
    print(f"\n{model}: remote hit in a second process: {o['num_cached_tokens']}")
    assert o["num_cached_tokens"] > 0
    same(o, reference["P"])
    # the router index, fed the first process's stream, predicts the second's hit: the remote
    # tier is one index for both instances (the second one has announced nothing when it is asked)
    cfg = router_config(r, remote="all")
    index = KVIndex(cfg)
    assert index_predictions(r, [P], cfg, "A", index) == [(0, 0)]
    assert index_predictions(r2, [P], cfg, "B", index) == [(o["num_cached_tokens"],) * 2]
    # the second process chains its stores to entries the first one announced: one merged stream
    rep = validate(r, r2).report()
    assert rep["errors"] == 0, rep["first_problems"]
    assert "STORAGE:REMOTE" in _tiers_announced(validate(r).report())
    # every value of the store damaged (bytes flipped, truncated, or another entry's value): all
    # misses found at the load, counted by the tier, never a wrong state
    client = redis_server.client()
    names = sorted(client.scan_iter("*"))
    assert names
    values = [client.get(n) for n in names]
    for i, (n, v) in enumerate(zip(names, values)):
        if i % 3 == 0:
            v = bytearray(v)
            for off in range(len(v) // 2 + 1, len(v) - 64, 257 * 2):
                v[off] ^= 0xC0
        elif i % 3 == 1:
            v = v[:-7]
        else:
            v = values[(i + 1) % len(values)] if len(values) > 1 else b""
        client.set(n, bytes(v))
    r3 = run_engine(spec(model, [step(P)], secondary_tiers=remote))
    (o,) = outputs(r3)
    assert o["num_cached_tokens"] == 0
    same(o, reference["P"])
    (tier,) = r3["offload_tiers"]
    assert tier["type"] == "KVBMRemoteTier" and tier["failed_loads"] > 0, tier
    rep = validate(r, r2, r3).report()
    assert rep["errors"] == 0, rep["first_problems"]
