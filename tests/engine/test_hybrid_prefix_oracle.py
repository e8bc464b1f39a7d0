"""vLLM's own prefix cache on hybrid models, with the plugin's fine hash granularity: every hit,
including one that ends inside an inflated block, must give the tokens of a run that caches nothing.

The plugin keeps `hash_block_size` at the user's --block-size (32), so vLLM serves prefix-cache hits
at 32-token boundaries inside 96- or 160-token blocks: the attention KV is read up to the hit and
the recurrent state (GDN or Mamba2) resumes from the state vLLM kept at that boundary. A wrong state
(wrong page read, a copy-on-write not applied) shows as other logits. The oracle is an engine with
prefix caching off (nothing cached, nothing resumed): tokens must be equal and the first generated
token's top-5 logprobs equal within TOL. The tiny random models have flat logits (top-2 margins of
0.01-0.2), so the logprobs, not only the tokens, carry the check; `test_the_oracle_sees_a_wrong_state`
shows that a zeroed state moves them by far more than TOL.

Cases: tiny Qwen3-Next with its SSM state in float32 (--block-size 32 inflated to 160) and in bfloat16
(inflated to 96: vLLM's CPU default on machines without AVX-512 BF16), and tiny Granite (Mamba2,
inflated to 96; vLLM's CPU Mamba2 kernel needs a step budget of one block in align mode).
"""

import random

import pytest

pytestmark = pytest.mark.engine
UNIT = 32
TOL = 2e-3  # measured: 0.0 on every case here; a zeroed state moves the top logprob by ~0.03
CASES = {
    "qwen3next-f32": ("qwen3next", {"mamba_ssm_cache_dtype": "float32"}, 160),
    "qwen3next-bf16": ("qwen3next", {"mamba_ssm_cache_dtype": "bfloat16"}, 96),
    "granite": ("granite-hybrid", {}, 96),
}
rng = random.Random(35)
P = [rng.randrange(10, 2000) for _ in range(1100)]
Q = P[:740] + [rng.randrange(10, 2000) for _ in range(260)]  # shares 740 tokens with P, then differs
Q2 = P[:740] + [rng.randrange(10, 2000) for _ in range(200)]  # and another branch at the same point
R = [rng.randrange(10, 2000) for _ in range(430)]
PROMPTS = [P, P, Q, Q2, Q, R, R, P]


def scenario(model: str, llm: dict, caching: bool) -> dict:
    llm = {**llm, "max_num_batched_tokens": 96, "enable_prefix_caching": caching}
    return {"model": model, "llm": llm, "events": False,
            "steps": [{"prompts": [p], "logprobs": 5, "max_tokens": 6} for p in PROMPTS]}


def served(result) -> list[dict]:
    return [s["outputs"][0] for s in result["steps"] if "outputs" in s]


def logprob_gap(a: dict, b: dict) -> float:
    """Largest |difference| of the first token's logprobs over the top-5 tokens both runs list."""
    la, lb = dict(map(tuple, a["logprobs"])), dict(map(tuple, b["logprobs"]))
    common = la.keys() & lb.keys()
    assert common, (a["logprobs"], b["logprobs"])
    return max(abs(la[t] - lb[t]) for t in common)


def margin(out: dict) -> float:
    top = sorted((lp for _, lp in out["logprobs"]), reverse=True)
    return top[0] - top[1]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, run_engine):
    model, llm, block = CASES[request.param]
    reference = run_engine(scenario(model, llm, caching=False), env={"KVBM_DISABLE": "1"})
    cached = run_engine(scenario(model, llm, caching=True))
    return request.param, block, served(reference), cached


def test_hits_inside_inflated_blocks_give_the_uncached_tokens(case):
    name, block, reference, cached = case
    assert cached["block_size"] == block and cached["hash_block_size"] == UNIT
    got = served(cached)
    hits = [o["num_cached_tokens"] for o in got]
    rows = [f"{len(p)} tokens: hit {h} (block {h // block} + {h % block}), margin {margin(r):.3f}, "
            f"logprob gap {logprob_gap(r, o):.4f}" for p, h, r, o in zip(PROMPTS, hits, reference, got)]
    print(f"\n{name}:\n  " + "\n  ".join(rows))
    # Repeats hit their last hash boundary before the last prompt token: mid-block for P (1088) in
    # every geometry. A branch of P (Q) finds no state of P's to resume; vLLM then stops Q's prefill
    # at the junction floored to a block (736 -> 672 or 640) and keeps a state there, which Q2,
    # branching at the same point, hits.
    junction = (740 // UNIT * UNIT) // block * block
    assert hits == [0, 1088, 0, junction, 992, 0, 416, 1088], hits
    assert hits[1] % block  # inside an inflated block
    for p, r, o in zip(PROMPTS, reference, got):
        assert o["tokens"] == r["tokens"], (name, len(p), o["num_cached_tokens"])
        assert logprob_gap(r, o) <= TOL, (name, len(p), o["num_cached_tokens"])


def test_the_oracle_sees_a_wrong_state(run_engine):
    """The same repeat, with every cached Mamba state zeroed before it: the hit still lands at 1088
    and the logprobs move far beyond TOL, so the check above would catch a wrongly resumed state."""
    model, llm, _ = CASES["qwen3next-bf16"]
    spec = scenario(model, llm, caching=True)
    spec["steps"] = [spec["steps"][0], {"scale_mamba_state": 0.0}, spec["steps"][1]]
    result = run_engine(spec)
    cold, scaled, hit = result["steps"]
    assert scaled["scaled"] >= 2  # conv and SSM state of the one GDN layer
    assert hit["outputs"][0]["num_cached_tokens"] == 1088
    assert logprob_gap(cold["outputs"][0], hit["outputs"][0]) > 5 * TOL
