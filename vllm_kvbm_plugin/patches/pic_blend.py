"""Selective recompute of position-independent loads (issue 12, layer 3), CacheBlend-style.

With `pic_recompute_ratio` > 0, a salted (`kvbm-pic:`) request's reused tokens are not reported to
vLLM as computed: vLLM schedules them as new tokens, and the worker first loads their re-rotated
KV into their blocks (connector/pic_load.py) and sets a `BlendPlan` on the step's forward context.
Per attention layer, right before vLLM writes the step's fresh K/V into the cache
(`CPUAttentionBackendImpl.do_kv_cache_update`; its attention then reads everything from the cache):
- below the selection layer (layer 1): nothing, the fresh KV stays (layer 0's KV does not depend
  on context: fresh and loaded are equal up to rounding);
- at the selection layer: per request, the `ratio` of its reused tokens whose fresh K deviates
  most from the loaded K, plus the first `RUN_HEAD` tokens of each reused run, are selected;
- from the selection layer on: every reused token not selected gets its loaded K/V in place of the
  fresh one, so attention and the cache use the loaded KV; selected tokens keep their fresh KV.
Ratio 1 keeps every fresh KV (a full prefill); ratio 0 is never planned (plain loads, layer 2).

Compute saved (issue 32, `apply_compute_saving`): from the selection layer's MLP on, the dense
decoder layers run only the kept rows (computed tokens, selected ones, each request's last), with
CPU attention metadata over those rows; the rest keep their loaded KV. A compiled model (vLLM's
default: one traced graph over one token count) cannot change its row count mid-forward, so a step
with a blended request runs the same modules eagerly (`attach` sets the forward context's
`skip_compiled`, which vLLM's `support_torch_compile` honours) and every other step keeps the graph.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from vllm_kvbm_plugin.patches.wrapping import is_wrapped, logger, wrap_method
from vllm_kvbm_plugin.reuse.cpu_layout import kv_views

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.forward_context import ForwardContext
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

NAME = "pic_blend"
ATTR = "kvbm_pic_blend"  # the plan's attribute on vLLM's ForwardContext (one per step)
SELECTION_LAYER = 1
RUN_HEAD = 2  # first tokens of every reused run, always recomputed
STATS = {"steps": 0, "tokens": 0, "recomputed": 0}  # this process's blended steps and tokens


@dataclasses.dataclass
class BlendPlan:
    """One step's reused tokens (loaded into their cache slots before the forward) and, once the
    selection layer has run, which of them keep their fresh KV. Worker process: built by
    connector/pic_load.py after the step's loads and attached to the step's vLLM forward context
    (`attach`); the patched CPU attention calls `blend` on it once per layer during that forward."""

    slots: torch.Tensor  # [n] long: block id * block size + offset of each loaded token
    head: torch.Tensor  # [n] bool: among the first RUN_HEAD tokens of its run
    ratio: float
    block_size: int
    report: Callable[[int, int], None] | None = None  # (reused tokens blended, recomputed) per step
    rows: torch.Tensor | None = None  # batch rows of the loaded tokens this step computes
    request: torch.Tensor | None = None  # per row: which request of the batch (selection is per request)
    keep: torch.Tensor | None = None  # per row: selected (keeps its fresh KV)
    # set by `gather` (the compute saving, after the selection layer's attention):
    kept: torch.Tensor | None = None  # the step's rows the later layers run
    num_rows: int = 0  # the step's rows before the gather
    last_layer: int = -1  # the layer after which the kept rows go back into the step's rows

    def gather(self, attn: Attention, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """Kept rows (every row but the unselected reused ones; each request's last row always) and the
        CPU attention metadata over them for the layers after the selection: each maximal run of kept
        rows a request of its own (causal over the tokens before it), the request's block table row."""
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.models.utils import extract_layer_index

        assert self.rows is not None and self.keep is not None  # gathered after the selection
        ctx = get_forward_context()
        assert isinstance(ctx.attn_metadata, dict) and isinstance(ctx.slot_mapping, dict)  # no micro-batches on CPU
        metas = cast("dict[str, CPUAttentionMetadata]", ctx.attn_metadata)  # the patched CPU attention's
        mappings = ctx.slot_mapping
        meta = metas[attn.layer_name]
        n = positions.shape[0]
        keep = torch.ones(n, dtype=torch.bool)
        keep[self.rows[~self.keep]] = False
        qsl = meta.query_start_loc.long().cpu()
        keep[qsl[1:] - 1] = True
        kept = keep.nonzero().squeeze(1)
        pos = positions[kept].long().cpu()
        req = torch.searchsorted(qsl, kept, right=True) - 1
        # a new segment where the request changes or rows / positions stop being consecutive
        brk = torch.ones(len(kept), dtype=torch.bool)
        brk[1:] = (req[1:] != req[:-1]) | (kept[1:] != kept[:-1] + 1) | (pos[1:] != pos[:-1] + 1)
        starts = brk.nonzero().squeeze(1)
        ends = torch.cat([starts[1:], torch.tensor([len(kept)])])
        seg_qsl = torch.cat([starts, torch.tensor([len(kept)])]).to(meta.query_start_loc.dtype)
        seg_lens = (pos[ends - 1] + 1).to(meta.seq_lens.dtype)
        seg_req = req[starts]
        impl = cast("CPUAttentionBackendImpl", attn.impl)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(starts), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size, seq_lens=seg_lens, dtype=dtype, query_start_loc=seg_qsl, causal=True,
            sliding_window_size=-1, isa=_isa(attn), enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=impl.kv_cache_dtype)
        after = dataclasses.replace(meta, num_actual_tokens=len(kept), max_query_len=int((ends - starts).max()),
                                    query_start_loc=seg_qsl, max_seq_len=int(seg_lens.max()), seq_lens=seg_lens,
                                    block_table=meta.block_table[seg_req], slot_mapping=meta.slot_mapping[kept],
                                    scheduler_metadata=sched)
        for k in list(metas):  # one KV cache group (the planner's condition): every layer's metadata
            if extract_layer_index(k) > SELECTION_LAYER:
                metas[k] = after
        # and the slots vLLM writes each later layer's K/V to (unified_kv_cache_update reads them from
        # the forward context, not from the metadata): the kept rows' own
        picked: dict[int, torch.Tensor] = {}
        for k in list(mappings):
            if extract_layer_index(k) > SELECTION_LAYER:
                m = mappings[k]
                if id(m) not in picked:
                    picked[id(m)] = m[kept.to(m.device)]
                mappings[k] = picked[id(m)]
        self.last_layer = max(extract_layer_index(k) for k in metas)
        self.num_rows, self.kept = n, kept
        STATS["gathered"] = STATS.get("gathered", 0) + len(kept)
        STATS["rows"] = STATS.get("rows", 0) + n

    def _find_rows(self, slot_mapping: torch.Tensor, layer_name: str) -> None:
        """The batch rows whose cache slot is a loaded one (the scheduler loads only the tokens a
        step computes, a chunked prefill's chunk by chunk; a loaded slot not in the batch is left
        alone)."""
        sm = slot_mapping.long().cpu()
        order = torch.argsort(sm)
        at = torch.searchsorted(sm[order], self.slots).clamp(max=max(len(sm) - 1, 0))
        found = sm[order][at] == self.slots if len(sm) else torch.zeros(len(self.slots), dtype=torch.bool)
        self.slots, self.head, self.rows = self.slots[found], self.head[found], order[at][found]
        self.request = _request_of(self.rows, layer_name)

    def blend(self, layer_name: str, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm.model_executor.models.utils import extract_layer_index

        layer = extract_layer_index(layer_name)
        if layer < SELECTION_LAYER:
            return key, value
        if self.kept is not None:  # layers after the selection run the kept rows only (fresh KV)
            return key, value
        if self.rows is None:
            self._find_rows(slot_mapping, layer_name)
        assert self.rows is not None  # set by _find_rows
        if not len(self.rows):
            return key, value
        heads = kv_cache.shape[1]
        k_cache, v_cache = kv_views(kv_cache)
        blocks, offsets = self.slots // self.block_size, self.slots % self.block_size
        loaded_k = k_cache[blocks, :, :, offsets]  # [n, heads, head]
        loaded_v = v_cache[blocks, :, offsets]
        k = key.view(key.shape[0], heads, -1)
        v = value.view(value.shape[0], heads, -1)
        if self.keep is None:  # the selection layer
            assert self.request is not None  # set with the rows
            deviation = _over_all_ranks(_deviation(k[self.rows], loaded_k, v[self.rows], loaded_v))
            self.keep = self.head.clone()
            for r in torch.unique(self.request):
                mine = (self.request == r).nonzero().squeeze(1)
                n = math.ceil(self.ratio * len(mine))
                self.keep[mine[torch.topk(deviation[mine], min(n, len(mine))).indices]] = True
            STATS["steps"] += 1
            STATS["tokens"] += len(self.rows)
            STATS["recomputed"] += int(self.keep.sum())
            if self.report is not None:
                self.report(len(self.rows), int(self.keep.sum()))
        reuse = ~self.keep
        if not reuse.any():
            return key, value
        rows = self.rows[reuse]
        k, v = k.clone(), v.clone()  # never write into the model's own tensors
        k[rows] = loaded_k[reuse].to(k.dtype)
        v[rows] = loaded_v[reuse].to(v.dtype)
        return k.view(key.shape), v.view(value.shape)


def _isa(attn: Attention) -> str:
    """The CPU kernels' ISA, which vLLM's CPU metadata builder sets on each attention layer (an
    attribute the layer's class does not declare)."""
    isa: str = getattr(attn, "isa")
    return isa


def _deviation(fresh_k: torch.Tensor, loaded_k: torch.Tensor, fresh_v: torch.Tensor,
               loaded_v: torch.Tensor) -> torch.Tensor:
    """Per reused token [n, heads, head], how far its loaded KV is from the fresh one. K only: V's
    deviation or both (each relative) selected no better on llama-big (a random choice: worse)."""
    return (fresh_k.float() - loaded_k.float()).square().sum(dim=(1, 2))


def _over_all_ranks(deviation: torch.Tensor) -> torch.Tensor:
    """The per-row deviation over every tensor-parallel rank's KV heads (each rank holds its own):
    all ranks then select the same rows, as one rank holding every head would. They must: the
    layers after the selection run only the kept rows, and an all-reduce over different row counts
    hangs or crashes. Gathered and summed here in rank order, so every rank gets the same bits
    (an all-reduce need not promise that)."""
    tp = tp_group()
    return deviation if tp is None else tp.all_gather(deviation.unsqueeze(0), dim=0).sum(0)


def tp_group() -> GroupCoordinator | None:
    """vLLM's tensor-parallel group of this worker, or None with one rank (or none set up)."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return None
    return get_tp_group()


def check_parallel(parallel_config: ParallelConfig) -> None:
    """Raise at startup for a parallel layout the selection cannot serve: tensor parallelism is
    handled (`_over_all_ranks`), but under pipeline parallelism the selection layer and the
    layers that run only the kept rows live in different processes, and under context
    parallelism a rank holds only some of a request's tokens."""
    pc = parallel_config
    sizes = {"pipeline_parallel_size": pc.pipeline_parallel_size,
             "decode_context_parallel_size": pc.decode_context_parallel_size,
             "prefill_context_parallel_size": pc.prefill_context_parallel_size}
    bad = {name: size for name, size in sizes.items() if size > 1}
    if bad:
        raise ValueError(f"KVBMConnector: pic_recompute_ratio > 0 (selective recompute) supports tensor "
                         f"parallelism only, not {', '.join(f'{k}={v}' for k, v in bad.items())}: set "
                         f"pic_recompute_ratio to 0 (position-independent loads alone) or those sizes to 1")


def _request_of(rows: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Which request of the batch each row belongs to (its query_start_loc range)."""
    from vllm.forward_context import get_forward_context

    metas = get_forward_context().attn_metadata
    group = metas[0] if isinstance(metas, list) else metas
    meta = group.get(layer_name) if isinstance(group, dict) else group
    starts = getattr(meta, "query_start_loc", None)
    if starts is None:
        return torch.zeros(len(rows), dtype=torch.long)
    return torch.searchsorted(starts.long().cpu(), rows, right=True) - 1


def attach(forward_context: ForwardContext, plan: BlendPlan) -> None:
    """Hand `plan` to the attention layers of the step `forward_context` (vLLM's ForwardContext,
    which vLLM gives the connector's `start_load_kv`) describes. Where the decoder layers drop rows
    (`compute_saving_applied`), the step also leaves the compiled graph: vLLM's
    `support_torch_compile` then calls the model's own forward, the same modules, eagerly."""
    setattr(forward_context, ATTR, plan)
    if compute_saving_applied():
        forward_context.skip_compiled = True


def plan_of(forward_context: ForwardContext) -> BlendPlan | None:
    """The plan `attach` gave this step's forward context, if any."""
    return getattr(forward_context, ATTR, None)


def _current_plan() -> BlendPlan | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return plan_of(get_forward_context()) if is_forward_context_available() else None


def applied() -> bool:
    """Whether this process's CPU attention blends (the scheduler side checks before planning)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except Exception:  # noqa: BLE001 - no usable CPU attention in this vLLM build
        return False
    return is_wrapped(CPUAttentionBackendImpl, "do_kv_cache_update")


def compute_saving_applied() -> bool:
    """Whether this process's dense decoder layers run only the kept rows after the selection."""
    import importlib

    module, name = DECODER_LAYERS[0]
    try:
        return is_wrapped(getattr(importlib.import_module(module), name), "forward")
    except ImportError:
        return False


def apply() -> bool:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except Exception as e:  # noqa: BLE001 - a vLLM build without usable CPU attention (0.33's CUDA
        # wheel fails importing it): plain position-independent loads
        logger.debug("pic_blend: no CPU attention (%s)", e)
        return False
    return wrap_method(CPUAttentionBackendImpl, "do_kv_cache_update", _wrap_update)


def _wrap_update(orig):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        plan = _current_plan()
        if plan is not None:
            key, value = plan.blend(layer.layer_name, key, value, kv_cache, slot_mapping)
        return orig(self, layer, key, value, kv_cache, slot_mapping)

    return do_kv_cache_update


# ---- compute saving (issue 32): from the selection layer's MLP on, only the kept rows run ----
# After the selection layer's attention, the rows of reused tokens that were not selected leave the
# batch: their KV there is the loaded one (already in the cache), their hidden states are never read
# (each request's last row is kept). Blended steps of a compiled model run eagerly (`attach`).
DECODER_LAYERS = (("vllm.model_executor.models.llama", "LlamaDecoderLayer"),
                  ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer"),
                  ("vllm.model_executor.models.qwen3", "Qwen3DecoderLayer"))


def apply_compute_saving(vllm_config: VllmConfig) -> bool:
    """Patch the dense decoder layers to run only the kept rows after the selection layer, if the
    attention patch is applied. A compiled model's graph is the plain layers' either way (vLLM traces
    it before the worker's connector exists; under dynamo `_wrap_layer` calls the plain layer)."""
    import importlib

    from vllm_kvbm_plugin import compat

    if not applied() or not compat.decoder_rows_supported():
        return False
    from vllm.config import CompilationMode

    if vllm_config.compilation_config.mode != CompilationMode.NONE:
        logger.info("pic_blend: the model is compiled: steps with a blended request run it eagerly "
                    "(the same modules, rows dropped after the selection layer), every other step the compiled graph")
    for module, name in DECODER_LAYERS:
        cls = getattr(importlib.import_module(module), name)
        wrap_method(cls, "forward", _wrap_layer)
    return True


def _wrap_layer(orig):
    def forward(self, positions, hidden_states, residual, *args, **kwargs):
        if torch.compiler.is_compiling():  # being traced: the graph is the plain layer's
            return orig(self, positions, hidden_states, residual, *args, **kwargs)
        plan = _current_plan()
        if plan is None:
            return orig(self, positions, hidden_states, residual, *args, **kwargs)
        from vllm.model_executor.models.utils import extract_layer_index

        layer = extract_layer_index(self.self_attn.attn.layer_name)
        if layer == 0:
            _rotary_kernel(getattr(self.self_attn, "rotary_emb", None))
        if layer < SELECTION_LAYER or (layer > SELECTION_LAYER and plan.kept is None):
            return orig(self, positions, hidden_states, residual, *args, **kwargs)
        if layer == SELECTION_LAYER:
            # the decoder layer's body (the same in every DECODER_LAYERS class), split after the
            # attention, which makes the selection: the MLP runs on the kept rows only
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
            if plan.keep is not None:  # selected among reused rows
                plan.gather(self.self_attn.attn, positions, hidden_states.dtype)
                hidden_states, residual = hidden_states[plan.kept], residual[plan.kept]
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            out, res = self.mlp(hidden_states), residual
            if plan.kept is None:
                return out, res
        else:
            out, res = orig(self, positions[plan.kept], hidden_states, residual, *args, **kwargs)
        if layer == plan.last_layer:  # back to the step's rows for the final norm and the logits
            full = out.new_zeros((plan.num_rows, out.shape[1]))
            full_res = res.new_zeros((plan.num_rows, res.shape[1]))
            full[plan.kept], full_res[plan.kept] = out, res
            return full, full_res
        return out, res

    return forward


def _rotary_kernel(rotary: CustomOp | None) -> None:
    """Blended steps of a compiled model run its modules eagerly, and there its custom ops were set
    up to run their PyTorch-native code (for inductor to fuse): the rotary embedding's is ~15 small
    ops per layer where vLLM's CPU kernel, what an eager model runs, is one. Set once on the module,
    after the graph was traced (the graph does not call it)."""
    fast = getattr(rotary, "forward_cpu", None)
    if rotary is not None and fast is not None and rotary._forward_method != fast:
        rotary._forward_method = fast
