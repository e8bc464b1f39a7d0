"""A router-like index of a KV event stream that reports every inconsistency it sees.

The index holds, per (data-parallel rank, tier, group, block size), the block hashes currently
announced, where a tier is vLLM's (medium, locality, ownership): two STORAGE tiers with another
locality or ownership are separate indexes, and a BlockRemoved removes from the tier it names.
Old recordings whose disk tier says medium `DISK` (our name before vLLM's vocabulary) validate with
`DISK` as a medium of its own; it is never taken for STORAGE. Rules checked:
- unknown_parent: a BlockStored whose parent hash is not held at the same block size (in an
  offload tier, or a multiple of it: a block's hash is also its last unit's);
- duplicate_store: a hash stored again while still held at the same block size (with
  `reuse_reports`, a reuse report instead: see `Validator`);
- unknown_removal: a BlockRemoved hash that is not held at any block size of its group;
- token_count: len(token_ids) != len(block_hashes) * block_size (a bare hash, block_size 0 as
  vLLM's offloading connector announces a chunk it has no payload for, carries no tokens);
- extra_keys (only given the prompts, `Prompt`): a block whose token chain is a prefix of a prompt
  must carry exactly the images overlapping its tokens, as vLLM 0.32 puts them in events: one
  `(identifier, offset of the image start from the block start)` pair per image, in prompt order,
  none for blocks without an image. Identifiers are compared when the prompt gives them; otherwise
  the same image must keep one identifier along a chain. Prompts with the same tokens but other
  images are told apart by the extra_keys themselves. Other entries (bare LoRA names, cache salts,
  prompt-embed digests) are not described by prompts and are ignored, as are sparse groups and
  blocks that reach past the prompt into generated tokens.
Groups of sparse kinds (Mamba state, sliding windows) keep only some blocks, so vLLM announces
fewer hashes than token blocks and parents that were never stored: for them the first and last
rule are relaxed to "token count is a multiple of block_size and covers the hashes".

BlockRemoved carries no block size. A hash at an inflated-block boundary is also the hash of that
block's last unit, so with coarse and per-unit events both on the same hash is held at two sizes;
a removal takes the largest size first, the order in which the plugin emits them.
AllBlocksCleared clears the GPU medium (and events without a medium) only: vLLM emits it from the
GPU prefix cache reset. Problems name the tier key (`Tier.label`, e.g. "STORAGE:LOCAL:<ownership>").

Merged streams (several publishers: instances of a fleet and the remote tier's announcer, see
events/announcer.py): `apply(..., stream=...)` names the publisher. Local tiers (GPU, CPU,
STORAGE LOCAL) are indexed per stream; a REMOTE tier is one index shared by every stream and data
parallel rank (it is one store), so a remote entry announced by two publishers is a
duplicate_store. An AllBlocksCleared from a stream that announced remote tiers only (the
announcer's) clears those tiers: the whole store was flushed.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Hashable, Iterable
from typing import IO, Any

from vllm_kvbm_plugin.events.types import (
    LOCALITY_REMOTE,
    MEDIUM_GPU,
    SPARSE_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Tier,
)

# SPARSE_KINDS (imported above, used below) lives in types.py; importing it from here still works
RULES = ("unknown_parent", "duplicate_store", "unknown_removal", "token_count", "extra_keys")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One inconsistency a Validator found: the rule broken, the batch's sequence number and
    where (`tier`). Kept by the Validator (up to `max_problems_kept`), reported by its callers."""

    rule: str
    seq: int | None
    detail: str
    tier: str | None = None  # Tier.label of the index the event applies to


@dataclasses.dataclass(frozen=True)
class Image:
    """A multimodal placeholder range of a prompt (vLLM's PlaceholderRange) and, if known, the
    identifier vLLM hashes it under (the client's uuid, or vLLM's content hash)."""
    offset: int
    length: int
    identifier: str | None = None


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A request's prompt as the client sent it (tokens, images), handed to a Validator to check
    the extra_keys of the blocks it produced; read from JSON lines (`read_prompts`) by the CLI and
    the tests."""

    token_ids: tuple[int, ...]
    images: tuple[Image, ...] = ()
    name: str = ""

    @classmethod
    def from_json(cls, d: dict) -> "Prompt":
        """`{"token_ids": [...], "images": [{"offset", "length", "identifier"?}], "name"?}`"""
        images = sorted((Image(int(i["offset"]), int(i["length"]), i.get("identifier"))
                         for i in d.get("images") or ()), key=lambda i: i.offset)
        return cls(tuple(d["token_ids"]), tuple(images), str(d.get("name", "")))


class _Index:
    """The router index of one (dp, medium, locality, ownership, group): block size -> held
    hashes, and how many hashes it was told to store and remove."""

    __slots__ = ("sizes", "stored", "removed")

    def __init__(self):
        self.sizes: dict[int, set] = {}
        self.stored = 0
        self.removed = 0

    def held(self) -> int:
        return sum(len(s) for s in self.sizes.values())


def read_prompts(fp: IO[str]) -> list[Prompt]:
    """Prompts as JSON lines, one request per line (see `Prompt.from_json`)."""
    out = []
    for lineno, line in enumerate(fp, 1):
        if line.strip():
            try:
                out.append(Prompt.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"line {lineno}: not a prompt: {e}") from e
    return out


class Validator:
    """Checks one KV event stream, or a fleet's merged streams, as a router would index it (module
    docstring): owns the index of held hashes per tier and group and the problems found. Fed batch
    by batch (`apply`) by `vllm-kvbm subscribe --validate` / `validate`, benchmarks and tests, in
    their own process; never inside vLLM.

    reuse_reports: the stream comes from requests with vLLM's `kv_cache_report_mode` "full"
    (sampling `extra_args`), which announce their prefix-cache hits again, for gateways that learn
    from hits: a BlockStored of hashes already held is then counted as a reuse report
    (`reuse_reports`), not as duplicate_store. Off by default: the same shape is how a real double
    announcement looks (a block recomputed and announced twice)."""

    def __init__(self, max_problems_kept: int = 1000, prompts: Iterable[Prompt] | None = None,
                 reuse_reports: bool = False) -> None:
        # index key (dp, medium, locality, ownership, group, stream) -> its index; dp and stream are
        # None for REMOTE tiers (shared by every publisher)
        self._held: dict[tuple, _Index] = {}
        self.counts: Counter[str] = Counter()
        self.problems: list[Problem] = []
        self.max_problems_kept = max_problems_kept
        self.batches = 0
        self.stored_hashes = 0
        self.removed_hashes = 0
        self.stored_by: Counter[str] = Counter()  # "medium/g<group>/<kind>/<block size>" -> hashes
        self.prompts = list(prompts) if prompts is not None else None
        # (block size, hash) -> (start token, {prompt index: (identifier bound per image, ok)}) for
        # blocks placed on a prompt; kept after removal, since a hash names the same tokens forever
        self._placed: dict[tuple, tuple[int, dict[int, tuple]]] = {}
        self.prompt_blocks: Counter[str] = Counter()  # "checked", "with_images"
        # stream -> the tiers (medium, locality, ownership) it announced (for AllBlocksCleared)
        self._stream_tiers: dict[Hashable, set[tuple[str | None, str | None, str | None]]] = {}
        self.reuse_reports: int | None = 0 if reuse_reports else None  # hashes announced again

    @property
    def errors(self) -> int:
        return sum(self.counts[r] for r in RULES)

    def held(self, medium: str = MEDIUM_GPU, group: int | None = None, block_size: int | None = None,
             dp: int | None = None, locality: str | None = None, ownership: str | None = None) -> set:
        """Hashes currently held (for assertions and inspection); locality and ownership None
        match any."""
        out: set = set()
        for (d, m, loc, own, g, _), index in self._held.items():
            if (m == medium and (group is None or g == group) and (dp is None or d == dp)
                    and (locality is None or loc == locality) and (ownership is None or own == ownership)):
                for bs, hashes in index.sizes.items():
                    if block_size is None or bs == block_size:
                        out |= hashes
        return out

    def apply(self, batch: KVEventBatch, seq: int | None = None, stream: Hashable = None) -> None:
        """Apply one batch of the publisher `stream` (any hashable name; None for one stream)."""
        self.batches += 1
        dp = batch.data_parallel_rank
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(self._key(dp, ev, stream), ev, seq)
            elif isinstance(ev, BlockRemoved):
                self._removed(self._key(dp, ev, stream), ev, seq)
            elif isinstance(ev, AllBlocksCleared):
                tiers = self._stream_tiers.get(stream, ())
                if tiers and all(t[1] == LOCALITY_REMOTE for t in tiers):  # the announcer's: a flush
                    for key, index in self._held.items():
                        if key[1:4] in tiers:
                            index.sizes = {}
                    continue
                for key, index in self._held.items():
                    if key[0] == dp and key[5] == stream and key[1] in (MEDIUM_GPU, None):
                        index.sizes = {}

    def _key(self, dp: int | None, ev: BlockStored | BlockRemoved, stream: Hashable) -> tuple[Any, ...]:
        tier = (ev.medium, ev.locality, ev.ownership)
        self._stream_tiers.setdefault(stream, set()).add(tier)
        if ev.locality == LOCALITY_REMOTE:
            return (None, *tier, ev.group_idx, None)
        return (dp, *tier, ev.group_idx, stream)

    def _stored(self, gkey: tuple[Any, ...], ev: BlockStored, seq: int | None) -> None:
        sparse = ev.kv_cache_spec_kind in SPARSE_KINDS
        index = self._held.get(gkey) or self._new_index(gkey)
        held = index.sizes.setdefault(ev.block_size, set())
        hashes = ev.block_hashes
        n_tokens = len(ev.token_ids)
        if ev.block_size <= 0:  # a bare hash (vLLM's offloading placeholders): no tokens to count
            if n_tokens:
                self._problem("token_count", seq, f"{n_tokens} tokens with block size {ev.block_size} in {_where(gkey)}", gkey)
        elif sparse:
            if n_tokens % ev.block_size or n_tokens < len(hashes) * ev.block_size:
                self._problem("token_count", seq, f"{n_tokens} tokens for {len(hashes)} hashes of {ev.block_size} (sparse group) in {_where(gkey)}", gkey)
        elif n_tokens != len(hashes) * ev.block_size:
            self._problem("token_count", seq, f"{n_tokens} tokens for {len(hashes)} hashes of {ev.block_size} in {_where(gkey)}", gkey)
        if not sparse and ev.parent_block_hash is not None and not self._parent_held(index, ev):
            self._problem("unknown_parent", seq, f"parent {_short(ev.parent_block_hash)} of {_short(hashes[0]) if hashes else '-'} not held in {_where(gkey)} at block size {ev.block_size}", gkey)
        # set operations run in C, so the validator keeps up with large streams
        dup = held.intersection(hashes)
        before = len(held)
        held.update(hashes)
        if self.reuse_reports is not None:
            self.reuse_reports += len(dup)
        else:
            for h in dup:
                self._problem("duplicate_store", seq, f"{_short(h)} already held in {_where(gkey)} at block size {ev.block_size}", gkey)
        if len(held) - before != len(hashes) - len(dup):
            self._problem("duplicate_store", seq, f"a hash repeats within one event in {_where(gkey)}", gkey)
        if self.prompts is not None and not sparse:
            self._check_extra_keys(ev, seq)
        self.stored_hashes += len(hashes)
        index.stored += len(hashes)
        self.stored_by[f"{ev.medium}/g{ev.group_idx}/{ev.kv_cache_spec_kind}/{ev.block_size}"] += len(hashes)

    @staticmethod
    def _parent_held(index: "_Index", ev: BlockStored) -> bool:
        """The parent is held at the event's block size; in an offload tier also at a multiple of
        it: a block's hash is also its last unit's, and vLLM's offloading connector chains a
        partial tail of hash units to the whole chunk before it. (GPU events chain exactly.)"""
        h, bs = ev.parent_block_hash, ev.block_size
        if h in index.sizes.get(bs, ()):
            return True
        return ev.medium not in (None, MEDIUM_GPU) and bs > 0 and any(
            h in held for size, held in index.sizes.items() if size % bs == 0)

    def _check_extra_keys(self, ev: BlockStored, seq: int | None) -> None:
        """Place each block on the prompts its token chain is a prefix of and compare its extra_keys.
        A prompt stays "ok" along a chain while every block matched it, so a chain cannot borrow
        one block's images from a prompt and the next block's from another."""
        bs, prompts = ev.block_size, self.prompts
        assert prompts is not None  # checked by the caller
        keys = ev.extra_keys or []
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            if parent is None:
                start, cands = 0, {p: ((None,) * len(pr.images), True) for p, pr in enumerate(prompts)}
            elif (bs, parent) in self._placed:
                start, cands = self._placed[(bs, parent)]
                start += bs
            else:
                return  # not on a prompt (or after generated tokens): nothing to compare
            parent = h
            toks = tuple(ev.token_ids[i * bs:(i + 1) * bs])
            cands = {p: c for p, c in cands.items() if prompts[p].token_ids[start:start + bs] == toks}
            if len(toks) != bs or not cands:
                return
            got = _mm_keys(keys[i] if i < len(keys) else None)
            placed = {}
            for p, (bound, ok) in cands.items():
                b = _match(prompts[p], start, bs, got, bound)
                placed[p] = (bound, False) if b is None else (b, ok)
            self.prompt_blocks["checked"] += 1
            if got or any(_images_in(prompts[p], start, bs) for p in cands):
                self.prompt_blocks["with_images"] += 1
            if not any(ok for _, ok in placed.values()):
                p = min(cands)
                want = [(im.identifier or "?", off) for _, im, off in _images_in(prompts[p], start, bs)]
                self._problem("extra_keys", seq, f"{_short(h)} = tokens [{start}, {start + bs}) of prompt "
                              f"{prompts[p].name or p}: extra_keys {got or None}, expected {want or None}",
                              (None, ev.medium, ev.locality, ev.ownership, ev.group_idx, None))
                placed = {p: (b, True) for p, (b, _) in placed.items()}  # reported once, not per child
            self._placed[(bs, h)] = (start, placed)

    def _removed(self, gkey: tuple[Any, ...], ev: BlockRemoved, seq: int | None) -> None:
        index = self._held.get(gkey) or self._new_index(gkey)
        sizes = index.sizes
        rest = ev.block_hashes
        for bs in sorted(sizes, reverse=True):  # largest block size first
            hit = sizes[bs].intersection(rest)
            if hit:
                sizes[bs].difference_update(hit)
                rest = [h for h in rest if h not in hit] if len(hit) < len(rest) else []
            if not rest:
                break
        for h in rest:
            self._problem("unknown_removal", seq, f"{_short(h)} not held in {_where(gkey)}", gkey)
        self.removed_hashes += len(ev.block_hashes)
        index.removed += len(ev.block_hashes)

    def _new_index(self, gkey: tuple) -> "_Index":
        index = self._held[gkey] = _Index()
        return index

    def _problem(self, rule: str, seq: int | None, detail: str, gkey: tuple[Any, ...] | None = None) -> None:
        self.counts[rule] += 1
        if len(self.problems) < self.max_problems_kept:
            self.problems.append(Problem(rule, seq, detail, _tier(gkey).label if gkey else None))

    def report(self) -> dict:
        rep = {
            "batches": self.batches,
            "stored_hashes": self.stored_hashes,
            "removed_hashes": self.removed_hashes,
            "stored_by": dict(sorted(self.stored_by.items())),
            "tiers": self._tiers_report(),
            "held_hashes": sum(index.held() for index in self._held.values()),
            "errors": self.errors,
            "by_rule": {r: self.counts[r] for r in RULES},
            "first_problems": [dataclasses.asdict(p) for p in self.problems[:20]],
        }
        if self.prompts is not None:
            rep["prompt_blocks"] = {k: self.prompt_blocks[k] for k in ("checked", "with_images")}
        if self.reuse_reports is not None:
            rep["reuse_reports"] = self.reuse_reports
        return rep

    def _tiers_report(self) -> dict:
        """Per tier (label "medium[:locality[:ownership]]"): hashes stored, removed and held now."""
        out: dict[str, dict[str, int]] = {}
        for gkey, index in self._held.items():
            counts = out.setdefault(_tier(gkey).label, {"stored": 0, "removed": 0, "held": 0})
            counts["stored"] += index.stored
            counts["removed"] += index.removed
            counts["held"] += index.held()
        return dict(sorted(out.items()))


def _images_in(prompt: Prompt, start: int, bs: int) -> list[tuple[int, Image, int]]:
    """(index, image, offset from start) of the images overlapping tokens [start, start + bs),
    as vLLM's _gen_mm_extra_hash_keys finds them."""
    return [(k, im, im.offset - start) for k, im in enumerate(prompt.images)
            if im.offset < start + bs and start < im.offset + im.length]


def _mm_keys(entry: Iterable[Any] | None) -> list[tuple[Any, ...]]:
    """The image pairs of one block's event extra_keys entry (other entries are bare values)."""
    return [tuple(k) for k in entry or () if isinstance(k, (list, tuple)) and len(k) == 2]


def _match(prompt: Prompt, start: int, bs: int, got: list[tuple], bound: tuple) -> tuple | None:
    """The per-image identifiers bound after this block if `got` is what `prompt` expects, else None."""
    want = _images_in(prompt, start, bs)
    if len(want) != len(got):
        return None
    now = list(bound)
    for (k, im, off), (ident, got_off) in zip(want, got):
        expected = im.identifier or now[k]  # None: any identifier, bound from here on
        if got_off != off or (expected is not None and ident != expected):
            return None
        now[k] = ident
    return tuple(now)


def _tier(gkey: tuple) -> Tier:
    return Tier(*gkey[1:4])


def _where(gkey: tuple) -> str:
    """The index an event applies to, as problems name it (built only for problems: it is slow)."""
    dp, group, stream = gkey[0], gkey[4], gkey[5]
    return (f"tier {_tier(gkey).label} group {group}" + (f" dp {dp}" if dp is not None else "")
            + (f" stream {stream}" if stream is not None else ""))


def _short(h: object) -> str:
    return h.hex()[:16] if isinstance(h, bytes) else f"{h:#x}" if isinstance(h, int) else repr(h)
