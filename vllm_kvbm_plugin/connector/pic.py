"""Position-independent loads (issue 12, layer 2): KV the CPU tier holds for tokens that a request
has at another position, loaded token by token with K re-rotated to the new positions.

Opt-in per request: only a request whose `cache_salt` starts with `kvbm-pic:` is served. vLLM
folds the salt into the first block's hash and our keys fold it in the same way, so everything
such a request leaves behind (vLLM's prefix cache, our tier entries) lies under keys that no
request without that salt computes: approximate KV never reaches anybody who did not ask for it.

- Scheduler side (`PicPlanner`): a sub-sequence index per namespace (requests without extra keys:
  the public one; each `kvbm-pic:` salt: its own) fed with every KV block the CPU tier stores
  (its tokens, tier key, parent and position) and told when the tier drops it (`PicCpuTier`).
  After the exact prefix hit, the runs the index finds that continue it without a gap (a run
  holding the next token) are claimed as token ranges of tier entries, pinned like any load.
- Worker side (`load`): per attention layer, K of those tokens re-rotated from the old to the new
  positions in float32 (`reuse.rope`, with the model's own RoPE parameters), V copied.

Selective recompute (layer 3, `pic_recompute_ratio` > 0; off by default): the claimed tokens are
not reported to vLLM as computed, so vLLM computes them; the claim may then skip gaps (every run
anywhere past the exact hit is loaded, not only those continuing it). Each step, the claimed tokens
vLLM computes in it (a chunked prefill computes a long prompt over several steps) are loaded into
their blocks before the forward, and the worker hands a `BlendPlan` to the attention patch
(patches/pic_blend.py), which keeps the loaded KV of all but the most deviating tokens. No
compute is saved: the gain is fidelity (README, "Non-prefix reuse").

Only models whose K we can re-rotate exactly take part (`model_support`): dense Llama / Mistral /
Qwen2 / Qwen3 with `default`, `linear` or `llama3` RoPE, on vLLM's CPU attention with its "vec"
kernels (the one KV layout checked against a real forward, `kv_views`), no hybrid or MLA caches.
For every other model the planner is off: a plain miss.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.connector.layout import KV
from vllm_kvbm_plugin.connector.metadata import PicLoad
from vllm_kvbm_plugin.connector.cpu_tier import TierManager
from vllm_kvbm_plugin.events.types import TIER_CPU
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.reuse.rope import RopeSpec, UnsupportedRope, rerotate
from vllm_kvbm_plugin.reuse.subseq import SubseqIndex

logger = get_logger("connector.pic")

SALT_PREFIX = "kvbm-pic:"
# dense decoders whose attention applies get_rope(head_dim, rope_parameters, neox) to K as is
ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


@dataclasses.dataclass(frozen=True)
class PicModel:
    """What the workers need to re-rotate the model's K: its RoPE and the largest position."""
    rope: RopeSpec
    max_positions: int


def model_support(vllm_config) -> PicModel | str:
    """The model's RoPE if its stored K can be re-rotated exactly, else the reason it cannot."""
    from vllm.platforms import current_platform

    mc = getattr(vllm_config, "model_config", None)
    if getattr(mc, "hf_config", None) is None:
        return "no model config"
    if not current_platform.is_cpu():
        return "KV layouts other than vLLM's CPU layout are not supported yet"
    isa = _cpu_attention_isa(vllm_config)
    if isa != "vec":
        return f"CPU attention kernels {isa!r}: only the 'vec' KV layout is supported"
    archs = set(getattr(mc.hf_config, "architectures", None) or ())
    if not archs & ARCHITECTURES:
        return f"architecture {sorted(archs)} is not one of {sorted(ARCHITECTURES)}"
    if mc.use_mla:
        return "MLA caches a latent, not K"
    hf = mc.hf_text_config
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_theta" not in params and getattr(hf, "rope_theta", None) is not None:
        params["rope_theta"] = hf.rope_theta
    try:
        return PicModel(RopeSpec.from_parameters(mc.get_head_size(), params, is_neox_style=True),
                        int(mc.max_model_len))
    except (UnsupportedRope, ValueError, KeyError) as e:
        return f"RoPE cannot be re-rotated exactly: {e}"


def _cpu_attention_isa(vllm_config) -> str | None:
    """Which kernels vLLM's CPU attention picks for this model (they lay K out differently)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        mc, cc = vllm_config.model_config, vllm_config.cache_config
        return _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)
    except Exception as e:  # noqa: BLE001 - another vLLM: unknown kernels
        return f"unknown ({e})"


def kv_views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of vLLM's CPU attention ("vec" kernels) in a layer's KV tensor [blocks, heads,
    block, 2 * head] (the shape hides the layout): per block and head, K as [head, block] (token b
    is column b), then V as [block, head]. Returns views k [blocks, heads, head, block] and
    v [blocks, heads, block, head]. Checked against a real engine's layer-0 KV (test_pic_engine)."""
    n, heads, block, two_d = t.shape
    flat = t.view(n, heads, 2, block * two_d // 2)
    return flat[:, :, 0].view(n, heads, two_d // 2, block), flat[:, :, 1].view(n, heads, block, two_d // 2)


def wants(request) -> bool:
    """Opted in: a `kvbm-pic:` salt and nothing else that changes KV (LoRA, images, embeddings)."""
    salt = request.cache_salt
    return bool(salt) and salt.startswith(SALT_PREFIX) and _namespace(request) == salt


def _namespace(request):
    """Which index a request's blocks go to: None (public: no extra keys), its `kvbm-pic:` salt,
    or False (never indexed: LoRA, images, prompt embeddings, another salt)."""
    if not compat.has_extra_keys(request):
        return None
    salt = request.cache_salt
    if (salt and salt.startswith(SALT_PREFIX) and request.lora_request is None and not request.mm_features
            and getattr(request, "prompt_embeds", None) is None):
        return salt
    return False


def _recompute(cfg, kv_groups) -> bool:
    """Whether reused tokens are blended with a recompute; says why not when it was asked for."""
    from vllm_kvbm_plugin.patches import pic_blend

    ratio = getattr(cfg, "pic_recompute_ratio", 0)
    if not ratio:
        why = None
    elif not pic_blend.applied():
        why = "the attention patch is not applied (plugin disabled, or not vLLM's CPU attention)"
    elif len(kv_groups) != 1:
        why = f"{len(kv_groups)} KV cache groups (one is supported)"
    else:
        logger.info("KVBMConnector: position-independent loads recompute %.0f%% of the reused tokens "
                    "(pic_recompute_ratio %s)", 100 * ratio, ratio)
        return True
    if why:
        logger.warning("KVBMConnector: pic_recompute_ratio %s ignored (%s): loaded KV is used as is", ratio, why)
    return False


class PicCpuTier(TierManager):
    """The CPU tier, telling the planner about every entry that leaves it."""

    def __init__(self, capacity: int, policy: str, on_removed):
        super().__init__(TIER_CPU, capacity, policy)
        self.on_removed = on_removed

    def _evicted(self, evicted: list) -> None:
        for key, _ in evicted:
            self.on_removed(key)
        super()._evicted(evicted)

    def complete_store(self, key, ok: bool) -> None:
        super().complete_store(key, ok)
        if not ok:
            self.on_removed(key)


@dataclasses.dataclass
class _Segment:
    """Tokens [new_position, new_position + count) of a request from a tier entry's tokens
    [src_offset, src_offset + count), computed at old_position onwards."""
    key: tuple
    src_offset: int
    count: int
    old_position: int
    new_position: int

    def after(self, n: int) -> "_Segment":
        """The segment without its first n tokens."""
        return _Segment(self.key, self.src_offset + n, self.count - n, self.old_position + n, self.new_position + n)


@dataclasses.dataclass
class _PicClaim:
    computed: int  # the request's tokens before any hit (vLLM's num_computed_tokens)
    segments: list


class PicPlanner:
    """Scheduler side: the sub-sequence indexes of the CPU tier and the claims of opted-in requests."""

    def __init__(self, layout, cfg):
        self.block_size = layout.block_size
        self.kv_groups = layout.groups[KV]
        self.cpu = PicCpuTier(layout.cpu_slots, cfg.eviction_policy, self.removed)
        self.indexes: dict = {}  # namespace -> SubseqIndex over whole blocks
        self.namespace_of: dict = {}  # tier key -> namespace
        self.queued: dict = {}  # tier key -> (namespace, tokens, parent, position): stored, to index
        self.claims: dict[str, _PicClaim] = {}
        self.blending: dict[str, list] = {}  # recompute: req id -> segments vLLM has yet to compute (pinned)
        self.recompute = _recompute(cfg, self.kv_groups)  # selective recompute (layer 3) or loads only
        # lookups: salted requests' searches (one per scheduling attempt); served: requests that
        # got tokens; tokens: loaded position-independently; segments: their (block, run) pieces
        # blended: of those tokens, loaded to be blended with a recompute (not reported as computed)
        self.stats = {"lookups": 0, "served": 0, "tokens": 0, "segments": 0, "blended": 0}

    @classmethod
    def create(cls, layout, cfg) -> "PicPlanner | None":
        """A planner when the model's KV can be loaded position-independently, else None."""
        model = cfg.pic_model
        if not isinstance(model, PicModel):
            why = model or "no model information"
        elif layout.hybrid or any(k != "full_attention" for k in layout.spec_kinds):
            why = "hybrid, MLA or windowed KV cache groups"
        else:
            logger.info("KVBMConnector: position-independent loads for requests salted %r (RoPE %s)",
                        SALT_PREFIX, model.rope.rope_type)
            return cls(layout, cfg)
        logger.info("KVBMConnector: no position-independent loads (%s)", why)
        return None

    def ensure_loads_before_forward(self, scheduler_output, meta) -> None:
        """vLLM runs a step's loads after its forward unless some request reported external
        tokens; blended loads must be in the cache before the forward reads them."""
        if self.recompute and meta.pic_loads and hasattr(scheduler_output, "has_sync_kv_loads"):
            scheduler_output.has_sync_kv_loads = True

    # ---- the index, fed from the CPU tier ----
    MAX_QUEUED = 1 << 14  # blocks stored but not yet indexed (see `stored`)

    def stored(self, request, block: int, key, parent) -> None:
        """The CPU tier took block `block` of `request` under `key`. Indexed later (`flush`):
        the scheduler stores while it plans a step, which a request's loads and fetches wait for."""
        ns = _namespace(request)
        if ns is False or key in self.namespace_of or key in self.queued:
            return
        B = self.block_size
        self.queued[key] = (ns, request.all_token_ids[block * B:(block + 1) * B], parent, block * B)
        if len(self.queued) > self.MAX_QUEUED:
            self.flush()

    def flush(self) -> None:
        """Index the blocks stored since the last flush (before the indexes are read, and after
        each step's model run)."""
        for key, (ns, tokens, parent, position) in self.queued.items():
            index = self.indexes.get(ns)
            if index is None:
                index = self.indexes[ns] = SubseqIndex(self.block_size)
            index.add(key, tokens, parent, position=position)
            self.namespace_of[key] = ns
        self.queued.clear()

    def removed(self, key) -> None:
        if self.queued.pop(key, None) is not None:
            return  # never indexed
        ns = self.namespace_of.pop(key, False)
        if ns is False:
            return
        index = self.indexes[ns]
        index.remove(key)
        if ns is not None and not len(index) and not index.pending:
            del self.indexes[ns]  # a salt's index lives while the tier holds its blocks

    # ---- claims ----
    def extend(self, request, computed: int, hit: int, limit: int) -> int:
        """Tokens past the exact hit [computed, computed + hit) that runs of stored blocks hold
        without a gap (never token `limit`), claimed and pinned for this request. Recompute: runs
        after gaps too, and 0 (vLLM computes the claimed tokens; the worker blends them)."""
        self.release(request.request_id)
        if not wants(request):
            return 0
        self.flush()
        self.stats["lookups"] += 1
        end = start = computed + hit
        if end >= limit:
            return 0
        tokens = request.all_token_ids[:limit]
        runs = [r for ns in (None, request.cache_salt) if (ix := self.indexes.get(ns)) is not None
                for r in ix.find(tokens).runs if r.old_start >= 0]
        B = self.block_size
        segments = []
        while end < limit:
            best = max((r for r in runs if r.new_start <= end < r.new_start + r.length),
                       key=lambda r: r.new_start + r.length, default=None)
            if best is None:  # a gap: recompute goes on at the next run
                if not self.recompute:
                    break
                end = min((r.new_start for r in runs if r.new_start > end), default=limit)
                continue
            before = end
            for j in range((end - best.new_start) // B, len(best.keys)):
                key = best.keys[j]
                if not self.cpu.lookup(key):
                    break
                first = best.new_start + j * B  # the request's token that the entry's token 0 is
                stop = min(first + B, limit)
                while end < stop:  # one segment per destination block
                    n = min(stop, (end // B + 1) * B) - end
                    segments.append(_Segment(key, end - first, n, best.old_start + j * B + end - first, end))
                    self.cpu.prepare_load(key)
                    end += n
            if end == before:
                if not self.recompute:
                    break
                end = min((r.new_start for r in runs if r.new_start > end), default=limit)
        if segments:
            self.claims[request.request_id] = _PicClaim(computed, segments)
        return 0 if self.recompute else end - start

    def after_alloc(self, request, blocks, num_external_tokens: int, meta, loads_pinned: list) -> None:
        """Turn the claimed segments vLLM took into loads (the rest is unpinned). Recompute: they
        are kept (pinned) and loaded step by step as vLLM computes them (`step_loads`)."""
        claim = self.claims.pop(request.request_id, None)
        if claim is None:
            return
        end = claim.computed + max(num_external_tokens, 0)
        if self.recompute:  # vLLM computes every token past the exact hit
            taken = []
            for s in claim.segments:
                if s.new_position >= end:
                    taken.append(s)
                else:
                    self.cpu.complete_load(s.key)
            if taken:
                self.blending[request.request_id] = taken
                self.stats["served"] += 1
            return
        block_ids = blocks.get_block_ids()
        served = 0
        for s in claim.segments:
            n = min(s.count, end - s.new_position)
            if n <= 0:
                self.cpu.complete_load(s.key)
                continue
            self.cpu.touch(s.key)
            loads_pinned.append(s.key)  # unpinned once the metadata is built
            self._load(meta, block_ids, s, n)
            served += n
        if served:
            self.stats["served"] += 1
            self.stats["tokens"] += served

    def step_loads(self, req_id: str, start: int, count: int, block_ids, meta, loads_pinned: list) -> None:
        """Recompute: load the claimed tokens of [start, start + count), the ones vLLM computes this
        step, before its forward; a segment cut by the step's end keeps its pin for the next step."""
        segments = self.blending.pop(req_id, None)
        if not segments:
            return
        end, rest, served = start + count, [], 0
        for s in segments:
            if s.new_position >= end:
                rest.append(s)
                continue
            if s.new_position < start:  # computed already without its load (never planned)
                s = s.after(start - s.new_position)
            n = min(s.count, end - s.new_position)
            if n > 0:
                self.cpu.touch(s.key)
                self._load(meta, block_ids, s, n)
                served += n
                if n < s.count:  # the rest is computed next step
                    rest.append(s.after(n))
                    continue
            loads_pinned.append(s.key)  # unpinned once the metadata is built
        if rest:
            self.blending[req_id] = rest
        self.stats["tokens"] += served
        self.stats["blended"] += served

    def _load(self, meta, block_ids, s: _Segment, n: int) -> None:
        ids = tuple(block_ids[g][s.new_position // self.block_size] for g in self.kv_groups)
        meta.pic_loads.append(PicLoad(ids, s.new_position % self.block_size, self.cpu.slot(s.key),
                                      s.src_offset, n, s.old_position, s.new_position))
        self.stats["segments"] += 1

    def release(self, req_id: str) -> None:
        claim = self.claims.pop(req_id, None)
        for s in (claim.segments if claim else []) + self.blending.pop(req_id, []):
            self.cpu.complete_load(s.key)

    def release_all(self) -> None:
        for req_id in list(self.claims):
            self.release(req_id)


# ---- worker side -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _cos_sin(rope: RopeSpec, max_positions: int) -> torch.Tensor:
    return rope.cos_sin_cache(max_positions)


def load(side, ops: list[PicLoad]) -> None:
    """Run position-independent loads on a WorkerSide: per attention layer, K of the slot tokens
    re-rotated from their old to their new positions in float32, V copied (`kv_views`); a layer
    of another shape fails the loads (reported as load errors, so vLLM recomputes those blocks)."""
    t0 = time.perf_counter()
    model: PicModel = side.cfg.pic_model
    rope = model.rope
    D, B = rope.head_size, side.layout.block_size
    cache = _cos_sin(rope, model.max_positions)
    # one row per token: which op (slot), where in the slot's block, where it goes, its positions
    counts = torch.tensor([o.count for o in ops])
    op = torch.repeat_interleave(torch.arange(len(ops)), counts)
    within = torch.arange(len(op)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    src_at = torch.tensor([o.src_offset for o in ops])[op] + within
    dst_at = torch.tensor([o.dst_offset for o in ops])[op] + within
    old = torch.tensor([o.old_position for o in ops])[op] + within
    new = torch.tensor([o.new_position for o in ops])[op] + within
    slots = torch.tensor([o.slot for o in ops])
    for gi, layers in enumerate(side.layers[KV]):
        # the destination blocks are copied out, written and copied back: indexed writes into a
        # view of the whole KV cache would copy all of it
        blocks, dst_block = torch.unique(torch.tensor([o.block_ids[gi] for o in ops])[op], return_inverse=True)
        for layer in layers:
            t = layer.tensor
            if t.dim() != 4 or layer.dim != 0 or t.shape[2] != B or t.shape[3] != 2 * D:
                logger.error("KVBMConnector: position-independent loads need vLLM's CPU KV layout "
                             "[blocks, heads, %d, %d]; got %s: those blocks are recomputed", B, 2 * D, tuple(t.shape))
                side.load_errors.update(o.block_ids[gi] for o in ops)
                return
            # a few whole-tensor ops per layer, not a few per token range
            nbytes = t[0].numel() * t.element_size()
            src = side.pool[slots, layer.offset:layer.offset + nbytes].view(t.dtype).view(len(ops), *t.shape[1:])
            src_k, src_v = kv_views(src)
            dst = t.index_select(0, blocks)
            dst_k, dst_v = kv_views(dst)
            k = rerotate(src_k[op, :, :, src_at], old, new, cache, rope.rotary_dim, rope.is_neox_style)
            dst_k[dst_block, :, :, dst_at] = k  # [tokens, heads, head] into [block, heads, head, offset]
            dst_v[dst_block, :, dst_at] = src_v[op, :, src_at]
            t.index_copy_(0, blocks, dst)
    ratio = getattr(side.cfg, "pic_recompute_ratio", 0)
    if ratio and len(side.layers[KV]) == 1:
        from vllm_kvbm_plugin.patches import pic_blend

        B = side.layout.block_size
        block_ids = torch.tensor([o.block_ids[0] for o in ops])[op]

        def report(blended: int, recomputed: int) -> None:
            with side._stats_lock:
                data = side.stats.data
                data["pic_blended_tokens"] = data.get("pic_blended_tokens", 0) + blended
                data["pic_recomputed_tokens"] = data.get("pic_recomputed_tokens", 0) + recomputed

        pic_blend.set_plan(pic_blend.BlendPlan(block_ids * B + dst_at, _run_heads(ops, within), ratio, B, report))
    with side._stats_lock:
        data = side.stats.data
        for name, v in (("pic_loads", len(ops)), ("pic_tokens", len(new)), ("pic_seconds", time.perf_counter() - t0)):
            data[name] = data.get(name, 0) + v


def _run_heads(ops: list[PicLoad], within: torch.Tensor) -> torch.Tensor:
    """Per loaded token: among the first RUN_HEAD tokens of its run (ops that continue each other
    at the same position shift form one run)."""
    from vllm_kvbm_plugin.patches.pic_blend import RUN_HEAD

    run_start, at = [], 0  # per op: how many tokens of its run precede it
    for i, o in enumerate(ops):
        p = ops[i - 1] if i else None
        continues = (p is not None and o.new_position == p.new_position + p.count
                     and o.old_position - o.new_position == p.old_position - p.new_position)
        at = at + p.count if continues else 0
        run_start.append(at)
    counts = torch.tensor([o.count for o in ops])
    return torch.repeat_interleave(torch.tensor(run_start), counts) + within < RUN_HEAD
