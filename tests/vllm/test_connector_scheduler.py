"""KVBMConnector's scheduler side inside vLLM's real Scheduler (no model): real WorkerSides run its
plans over CPU tensors, and a stand-in forward writes each token's id and position into its KV
slot, so every step checks that whatever a tier loaded is exactly what a recompute would have
written, in the right blocks (testing.scheduler.SimulatedWorker). Runs on vLLM 0.32 and 0.33."""

import dataclasses
import os
import random
import time

import pytest

from vllm_kvbm_plugin.connector.layout import KV
from vllm_kvbm_plugin.connector.base import Report
from vllm_kvbm_plugin.connector.disk_scheduler import DiskTier
from vllm_kvbm_plugin.connector.metadata import STORE, Copies, KVBMWorkerMetadata
from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.types import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness
from vllm_kvbm_plugin.tiers import block_dir, block_file

rng = random.Random(0)
PROMPT = [rng.randrange(10, 2000) for _ in range(200)]
IDLE = {"prefetching": 0, "direct": 0, "reports_pending": 0}


def harness(hybrid: bool, workers: int = 1, policy: str | None = None, **connector) -> SchedulerHarness:
    geometry = dict(block_size=160, hash_block_size=32) if hybrid else dict(block_size=32, hash_block_size=None)
    return SchedulerHarness(HarnessConfig(hybrid=hybrid, num_blocks=64, workers=workers, kv_load_failure_policy=policy,
                                          connector={"cpu_bytes_to_use": 1 << 24, **connector}, **geometry))


def idle(h: SchedulerHarness) -> bool:
    acc = h.connector.accounting()
    return all(acc[k] == v for k, v in IDLE.items()) and all(
        t["busy"] == 0 for name, t in acc.items() if name in ("cpu", "disk"))


def events(h: SchedulerHarness) -> list:
    return [ev for b in h.batches for ev in b.events if isinstance(ev, (BlockStored, BlockRemoved))]


def validate(*harnesses: SchedulerHarness) -> Validator:
    v = Validator()
    for h in harnesses:
        for b in h.batches:
            v.apply(b)
    return v


@pytest.mark.parametrize("hybrid, hit", [(False, 192), (True, 192)])
def test_cpu_tier_hit_loads_exactly_what_recompute_writes(hybrid, hit):
    h = harness(hybrid)
    assert h.serve(PROMPT) == 0
    h.reset_prefix_cache()
    assert h.serve(PROMPT) == hit  # a hybrid hit lands on the last unit boundary before the last token
    assert idle(h)
    cpu = [ev for ev in events(h) if ev.medium == MEDIUM_CPU]
    assert cpu and all(ev.locality is None and ev.ownership is None for ev in cpu)
    assert validate(h).errors == 0


@pytest.mark.parametrize("restart", [False, True])
def test_block_aligned_prompt_loads_its_last_block_whole(tmp_path, restart):
    """A prompt that ends on a block boundary: its last block comes from the tier too, and vLLM
    computes only the last token (not a whole block, as its own prefix cache would). The harness
    checks the loaded KV of every token, the recomputed one included."""
    prompt = PROMPT[:192]
    h = harness(False, disk_path=str(tmp_path))
    assert h.serve(prompt) == 0
    if restart:  # direct loads from the files, no CPU tier
        h = harness(False, disk_path=str(tmp_path), cpu_bytes_to_use=1)
    else:
        h.reset_prefix_cache()
    assert h.serve(prompt) == 191
    assert idle(h)
    assert validate(h).errors == 0


def test_kv_check_catches_a_wrong_load():
    """The harness's oracle: a CPU slot with other bytes than the block it came from fails the step."""
    h = harness(False)
    h.serve(PROMPT)
    h.reset_prefix_cache()
    h.workers[0].side.pool.zero_()
    with pytest.raises(AssertionError, match="KV of token 0"):
        h.serve(PROMPT)


@pytest.mark.parametrize("hybrid", [False, True])
def test_disk_tier_after_restart_uses_vllms_storage_vocabulary(tmp_path, hybrid):
    first = harness(hybrid, disk_path=str(tmp_path))
    first.serve(PROMPT)
    second = harness(hybrid, disk_path=str(tmp_path), cpu_bytes_to_use=1)  # a new engine, no CPU tier
    assert second.connector.tier("cpu").index.capacity == 0
    assert second.serve(PROMPT) == 192  # direct loads from the files of the first run
    assert idle(second)
    stored = [ev for h in (first, second) for ev in events(h) if ev.medium not in ("GPU", MEDIUM_CPU)]
    assert stored and all(ev.medium == MEDIUM_STORAGE and ev.locality == "LOCAL" for ev in stored)
    assert len({ev.ownership for ev in stored}) == 1 and stored[0].ownership.startswith("kvbm-disk:")
    assert not any(ev.medium == MEDIUM_DISK for h in (first, second) for ev in events(h))
    for h in (first, second):  # each engine's stream on its own, as a router sees them
        assert validate(h).errors == 0
    # the restarted engine announces the stored entries again, parents first
    restarted = [ev for ev in events(second) if isinstance(ev, BlockStored) and ev.medium == MEDIUM_STORAGE]
    assert restarted


def test_recording_of_hybrid_unit_events_and_tier_events_validates(tmp_path):
    """The stream a router would record: GPU per-unit and coarse events, CPU and STORAGE tier events
    (vLLM 0.32 and 0.33 both produce it in CI)."""
    h = harness(True, disk_path=str(tmp_path / "disk"), cpu_bytes_to_use=3 * 160 * 512 + 1)
    prompts = [PROMPT, PROMPT[:100] + [5] * 150, PROMPT + [9] * 300]
    for p in prompts:
        h.serve(p)
    h.reset_prefix_cache()
    for p in prompts:
        h.serve(p)
    path = tmp_path / "events.jsonl"
    with open(path, "w") as f:
        recording.write(f, enumerate(h.batches))
    v = Validator()
    for seq, b in recording.read(open(path)):
        v.apply(b, seq)
    media = {ev.medium for ev in events(h)}
    assert media == {"GPU", MEDIUM_CPU, MEDIUM_STORAGE}
    assert any(ev.block_size == 32 for ev in events(h) if ev.medium == "GPU" and isinstance(ev, BlockStored))
    assert v.errors == 0, v.report()
    assert idle(h)


def test_pending_push_work_keeps_an_idle_engine_stepping_only_while_work_is_in_flight(tmp_path):
    """vLLM's engine core steps while Scheduler.has_requests(), which past the last request asks
    the connector's has_pending_push_work. Disk writes that end after the last request keep it
    stepping until their STORAGE events are out; blocks the tiers merely hold, or hold open for
    a waiting request, must not (an idle engine would spin)."""
    def busy_loop(h: SchedulerHarness) -> None:  # EngineCoreProc.run_busy_loop, nothing to receive
        deadline = time.monotonic() + 30
        while h.scheduler.has_requests():
            assert time.monotonic() < deadline, "the engine never became idle"
            h.step()
            time.sleep(0.001)  # as vLLM's engine core yields after a step without a forward

    first = harness(False, disk_path=str(tmp_path))
    first.add(PROMPT, max_tokens=1)  # its six blocks are stored and written in its only step
    first.run(timeout=30)
    assert not first.scheduler.has_unfinished_requests()
    assert first.scheduler.connector.has_pending_push_work()  # the writes are not reported yet
    assert not any(ev.medium == MEDIUM_STORAGE for ev in events(first))
    busy_loop(first)
    stored = [ev for ev in events(first) if isinstance(ev, BlockStored) and ev.medium == MEDIUM_STORAGE]
    assert sum(len(ev.block_hashes) for ev in stored) == 6
    assert idle(first) and len(first.connector.tier("cpu")) == len(first.connector.tier("disk")) == 6  # cached, not work
    assert not first.scheduler.connector.has_pending_push_work()

    # a new engine without a CPU tier: the request waits a step while the workers verify its six
    # files, then they stay open for it (pinned) until its direct loads have run
    second = harness(False, disk_path=str(tmp_path), cpu_bytes_to_use=1)
    second.add(PROMPT, max_tokens=2)
    assert second.step() == 0 and second.connector.accounting()["direct"] == 6
    assert all(h.ready for h in second.connector.tier("disk").held.values())
    assert not second.scheduler.connector.has_pending_push_work()
    busy_loop(second)
    assert second.cached_tokens == {"r0": 192} and idle(second)
    assert not second.scheduler.connector.has_pending_push_work()


def test_tier_entries_are_left_out_of_garbage_collections(tmp_path):
    """A tier holds up to millions of entries, in the scheduler's process: every full garbage
    collection would walk whatever of them the collector tracks (a pause that grows with the
    tier). Entries, their events (tuples, not lists) and the non-prefix index's links are not
    tracked, for blocks stored now and for those found on disk after a restart."""
    import gc

    def tracked(side) -> list:
        found = []
        for tier in (side.tier("cpu"), side.tier("disk")):
            for e in tier.index.entries.values():
                a = e.meta
                parts = [e] if a is None else [e, a, a.events] + [f for ev in a.events for f in (
                    ev.block_hashes, ev.token_ids, ev.extra_keys)]
                found += [type(x).__name__ for x in parts if gc.is_tracked(x)]
        if side.pic is not None:
            found += [type(k).__name__ for i in side.pic.indexes.values() for k in i.children.values()
                      if gc.is_tracked(k)]
        return found

    h = harness(False, disk_path=str(tmp_path), pic_index_always=True)
    h.serve(PROMPT)
    h.serve(PROMPT[:100] + [7] * 100)  # a second child of a stored block
    gc.collect()  # tuples of atoms are untracked by the collection that first sees them
    assert len(h.connector.tier("cpu")) == 9 and len(h.connector.tier("disk")) == 9
    assert h.connector.pic is not None and h.connector.pic.indexes  # the index is on for this model
    assert tracked(h.connector) == []
    restarted = harness(False, disk_path=str(tmp_path))
    gc.collect()
    assert len(restarted.connector.tier("disk")) == 9 and tracked(restarted.connector) == []


def test_a_failing_worker_fails_the_operation_and_leaves_no_count_behind(tmp_path):
    """Two tensor-parallel workers; rank 1's block files are corrupt, rank 0's fine. A prefetch
    that one worker completes and the other fails is a miss, and no report of it is left pending
    to complete the next prefetch of the same key early."""
    first = harness(False, workers=2, disk_path=str(tmp_path))
    first.serve(PROMPT)
    layout = first.connector.layout
    files = sorted(p for p in _block_files(layout.rank_dir(1)))
    assert len(files) == 6 and len(_block_files(layout.rank_dir(0))) == 6
    for p in files:  # flip a payload byte of every rank-1 file
        data = bytearray(open(p, "rb").read())
        data[block_file.HEADER_SIZE + 3] ^= 0x40
        open(p, "wb").write(data)
    second = harness(False, workers=2, disk_path=str(tmp_path))
    assert second.serve(PROMPT) == 0  # rank 0 verified its block 0, rank 1 did not: a miss
    assert second.connector.accounting()["reports_pending"] == 0
    assert idle(second) and len(second.connector.tier("disk")) == 6  # the new run stored its blocks again
    second.reset_prefix_cache()
    second.connector.tier("cpu").index.capacity = 0  # make the next hit read the files again
    for key in list(second.connector.tier("cpu").index.entries):
        second.connector.tier("cpu").index.remove(key)
    assert second.serve(PROMPT) == 192  # rewritten on both ranks: a hit, every byte checked
    assert idle(second)


def test_a_steps_copies_cross_as_columns_and_its_stores_are_reported_once_per_worker():
    """What the engine core pickles for the connector every step does not grow by a named tuple or a
    report per block: a step's loads and stores are one `Copies` per entry kind (columns of ints),
    and each of two workers reports the step's stores once; the hit then loads exactly what was
    stored (every byte checked)."""
    h = harness(False, workers=2)
    sent, received = [], []
    side = h.scheduler.connector
    build, update = side.build_connector_meta, side.update_connector_output

    def keep_meta(out):
        sent.append(build(out))
        return sent[-1]

    def keep_output(output):
        received.append(output.kv_connector_worker_meta)
        update(output)

    side.build_connector_meta, side.update_connector_output = keep_meta, keep_output
    assert h.serve(PROMPT) == 0
    stored = [m for m in sent if m.stores]
    assert len(stored) == 1 and list(stored[0].stores) == [KV]
    copies = stored[0].stores[KV]
    assert isinstance(copies, Copies) and len(copies.slots) == len(copies.block_ids[0]) == len(PROMPT) // 32
    assert all(type(i) is int for i in copies.block_ids[0] + copies.slots)
    store_reports = [r for wm in received if wm for r in wm.reports if r.op == STORE]
    assert store_reports == [Report(STORE, stored[0].store_batch, True)] * 2
    h.reset_prefix_cache()
    assert h.serve(PROMPT) == 192
    loads = [m.loads[KV] for m in sent if m.loads]
    assert len(loads) == 1 and len(loads[0].slots) == 6 and sorted(loads[0].slots) == sorted(copies.slots)
    assert idle(h) and not h.connector.store_batches


def _block_files(base: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(base) for n in names if n.endswith(block_dir.SUFFIX)]


@pytest.mark.parametrize("cpu_tier", [True, False], ids=["prefetch", "direct"])
def test_a_corrupt_file_amid_a_batch_of_disk_loads_ends_the_hit_there(tmp_path, cpu_tier):
    """A restarted engine's first request reads its six block files in one batched call (prefetches
    into CPU slots, or opens for direct loads); the fourth file is corrupt. The three before it
    hit, exactly as recompute would have written them (the harness checks the KV every step),
    the rest is recomputed, and the corrupt file fails alone."""
    first = harness(False, disk_path=str(tmp_path))
    first.serve(PROMPT)
    files = {block_file.decode_meta(block_file.read_meta(p))[0]: p for p in _block_files(first.connector.layout.rank_dir(0))}
    assert sorted(files) == [32 * i for i in range(1, 7)]  # each file's token end
    data = bytearray(open(files[128], "rb").read())
    data[block_file.HEADER_SIZE + 3] ^= 0x40
    open(files[128], "wb").write(data)
    second = harness(False, disk_path=str(tmp_path), **({} if cpu_tier else {"cpu_bytes_to_use": 1}))
    assert second.serve(PROMPT) == 96
    stats = second.workers[0].side.get_stats().data
    assert stats["disk_read_blocks"] == 5 and stats["disk_read_failures"] == 1  # read in one batch
    assert idle(second)


def test_a_failed_direct_load_stores_nothing_of_its_step(tmp_path):
    """The soak's disk_flip on a block file held open for a direct load: the load fails (the bytes
    read are checked) and is reported to vLLM, which recomputes from that block. The step that
    loaded it would also store the request's blocks into the CPU tier, the failed one with the
    flipped bytes it holds (and on a real model every block computed after it): the whole step's
    stores and writes are dropped instead, so the next hit loads only what recompute writes (the
    harness checks every load)."""
    first = harness(False, disk_path=str(tmp_path))
    first.serve(PROMPT)
    files = {block_file.decode_meta(block_file.read_meta(p))[0]: p for p in _block_files(first.connector.layout.rank_dir(0))}
    slots = 6
    second = harness(False, disk_path=str(tmp_path), cpu_bytes_to_use=slots * first.connector.layout.slot_bytes)
    cpu = second.connector.tier("cpu")
    second.serve([t + 1 for t in PROMPT])  # another prompt fills the CPU tier...
    pinned = list(cpu.index.entries)
    assert len(pinned) == slots
    pinned = cpu.prepare_loads(pinned)  # ...and its writes are in flight: no room for prefetches
    second.add(PROMPT, max_tokens=2)
    assert second.step() == 0 and second.connector.accounting()["direct"] == 6  # six files held open
    with open(files[128], "r+b") as f:  # block 3's first value, flipped in place after verification
        f.seek(block_file.HEADER_SIZE + 3)
        b = f.read(1)
        f.seek(block_file.HEADER_SIZE + 3)
        f.write(bytes([b[0] ^ 0x40]))
    cpu.complete_loads(pinned)  # the writes end: the hit's step finds room for its stores
    sent = []
    build = second.scheduler.connector.build_connector_meta
    second.scheduler.connector.build_connector_meta = lambda out: sent.append(build(out)) or sent[-1]
    second.run(timeout=30)
    second.settle()
    assert len(sent[0].direct_loads) == 6 and sent[0].stores  # the failing step planned its stores
    assert second.workers[0].side.get_stats().data["disk_read_failures"] == 1
    assert second.cached_tokens["r1"] == 192 and idle(second)
    second.reset_prefix_cache()
    assert second.serve(PROMPT) == 96  # from the disk tier up to the flipped file: none of it was kept
    assert idle(second) and validate(second).errors == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hybrid_hits_failed_direct_load_recomputes_the_request(tmp_path, workers):
    """Hybrid models have several KV cache groups, where vLLM takes no block-level load errors: a
    hit with direct disk loads is loaded asynchronously (the request waits a step) and a failed
    direct load fails the request's load as a whole (failed_recving, on any rank). With
    kv_load_failure_policy recompute the request starts again from a fresh lookup, which no longer
    finds the changed files; every step's KV and state checks pass (the harness), so no token is
    computed from the bytes that failed."""
    first = harness(True, workers, disk_path=str(tmp_path))
    first.serve(PROMPT)
    files = _block_files(first.connector.layout.rank_dir(0))
    second = harness(True, workers, policy="recompute", disk_path=str(tmp_path), cpu_bytes_to_use=1)  # no CPU tier
    sent = []
    build = second.scheduler.connector.build_connector_meta
    second.scheduler.connector.build_connector_meta = lambda out: sent.append(build(out)) or sent[-1]
    rid = second.add(PROMPT, max_tokens=2)
    assert second.step() == 0 and second.connector.accounting()["direct"] > 0  # files verified and held open
    for path in files:  # rank 0's entries (KV, partial block, states), changed in place after verification
        with open(path, "r+b") as f:
            f.seek(block_file.HEADER_SIZE + 3)
            b = f.read(1)
            f.seek(block_file.HEADER_SIZE + 3)
            f.write(bytes([b[0] ^ 0x40]))
    second.run(timeout=30)
    second.settle()
    loading = [m for m in sent if m.recving]
    assert loading and loading[0].recving == [rid] and all(d.request == rid for d in loading[0].direct_loads)
    assert second.workers[0].side.get_stats().data["disk_read_failures"] >= 1
    assert second.cached_tokens[rid] == 0  # started again: nothing left verifies
    assert idle(second) and validate(second).errors == 0


def test_a_late_write_report_after_a_failed_store_batch_leaves_the_new_entries_alone(tmp_path):
    """Pins belong to entries, not keys. A step's CPU stores fail as a batch while the disk writes
    from their slots are still in flight; the next request stores the same keys anew. The old
    slots stay taken until those writes are reported (nothing reuses a slot a write still reads),
    and the late reports release the old entries only: the new entries keep their stores' pins."""
    h = harness(False, disk_path=str(tmp_path))
    side, cpu = h.connector, h.connector.tier("cpu")
    update = h.scheduler.connector.update_connector_output
    held, phase, seen = [], ["fail"], {}

    def tamper(output):
        wm = output.kv_connector_worker_meta
        if wm is None:
            return update(output)
        if phase[0] == "fail":
            reports = []
            for r in wm.reports:
                if r.op == STORE:  # the step's stores fail as one...
                    seen["old"] = {k: cpu.index.entries[k] for k in side.store_batches[r.key]}
                    r = Report(STORE, r.key, False)
                    phase[0] = "hold"
                reports.append(r)
            wm.reports = reports
        if phase[0] in ("fail", "hold"):  # ...and their disk writes are reported late
            held.extend(r for r in wm.reports if r.op == DiskTier.WRITE)
            wm.reports = [r for r in wm.reports if r.op != DiskTier.WRITE]
        elif phase[0] == "late" and any(r.op == STORE for r in wm.reports):
            new = {k: cpu.index.entries[k] for k in seen["old"]}
            seen["new"] = {k: e.pins for k, e in new.items()}
            update(dataclasses.replace(output, kv_connector_worker_meta=KVBMWorkerMetadata(held)))
            seen["after"] = {k: e.pins for k, e in new.items()}
            seen["slots"] = {e.slot for e in new.values()}
            phase[0] = "done"
        return update(output)

    h.scheduler.connector.update_connector_output = tamper
    assert h.serve(PROMPT) == 0
    old = seen["old"]
    assert len(old) == 6 and len(held) == 6 and not any(k in cpu for k in old)  # dropped, writes unreported
    assert cpu.busy() == 6  # their slots: still the writes' sources
    h.reset_prefix_cache()
    phase[0] = "late"
    assert h.serve(PROMPT) == 0  # stored anew (the disk entries are still being written: no hit)
    assert phase[0] == "done"
    assert seen["after"] == seen["new"] and all(p >= 1 for p in seen["new"].values()), seen
    assert not seen["slots"] & {e.slot for e in old.values()}  # no slot a write still read was reused
    assert idle(h) and len(side.tier("disk")) == 6
    h.reset_prefix_cache()
    assert h.serve(PROMPT) == 192  # every byte checked
    assert idle(h)
