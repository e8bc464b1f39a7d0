"""One-command check of the transfer engine (vllm_kvbm_plugin/tiers/transfer.py) on a GPU: byte
checks in vLLM's KV layouts, GB/s against the pinned-copy roofline, and what stores cost the
default stream. Imports torch, numpy, numba and our pure modules only (no vLLM, no msgspec), so it
runs on a bare GPU machine from the repository root without an install:

    PYTHONPATH=. python3 benchmarks/gpu_check.py            # CUDA, about 1-2 minutes
    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cpu --quick   # the same logic on CPU

1. Layouts (packed [blocks, heads, block, 2*head], FlashAttention's K/V split on dim 1,
   FlashInfer's [blocks, 2, ...], blocks strided by every layer's page, a Mamba state padded in a
   raw byte page, a hybrid of both kinds in one job, and tiny pieces that take the torch path):
   random blocks are stored to random slots and loaded back to other blocks, in every engine mode;
   every byte of every layer is compared with what a plain copy gives. The loaded blocks are read
   on the default stream without a host sync (the load's event must order them).
2. Throughput: 8 layers of 16, 64 and 256 KiB per block, scattered blocks and slots, 256 MiB per
   job, against a pinned copy_ of one contiguous 256 MiB buffer (the roofline), D2H and H2D.
   Targets: >= 80 % of it at 64 and 256 KiB, >= 50 % at 16 KiB (the `auto` mode, the engine's).
3. Steps: the default stream's time per step with a store per step against the same steps
   without, where each step the host waits for the forward (as for sampled tokens) and then
   spends --gap-ms scheduling.
4. The store fence: blocks rewritten on the default stream right after a store's submit, with no
   host wait (as the next step's Mamba state copies or block zeroing would) must reach the pool
   as they were; and a long prefill's store (1 GiB) followed at once by the next forward: how
   long that forward waits with staging bounded at STAGE_LIMIT against one buffer (the engine
   before), next to the store's own PCIe time.
5. The pinned pool: bytes pinned for a pool of 1 GiB + 4 KiB by tiers/host_memory.py
   (cudaHostRegister, exact) and by torch's pinned allocator (a power of two), and whether
   registered memory is used at its host address (the kernels need it).
6. Direct disk loads: block files (tmpfs) read into pinned staging rows in batches and moved by
   load jobs (connector/worker.py WorkerSide.load_direct_staged) against the path before it (a pageable
   scratch slot, then a copy per layer per block); bytes checked, time ratio printed.

Exits 1 on any byte mismatch or a check that raised (the figures are printed, not enforced).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

from vllm_kvbm_plugin.tiers import host_memory, transfer
from vllm_kvbm_plugin.tiers.transfer import Layer, TransferEngine

KIB = 1024


def layouts(device, nb: int, block_bytes: int, layers: int) -> dict:
    """name -> a builder of {kind: [(tensor, block dim) per layer]}, random bytes (bfloat16 KV)."""
    bs, heads = 16, 8
    hd = block_bytes // (2 * bs * heads * 2)  # K and V of bs tokens, heads, hd dims, 2 bytes
    tiny = block_bytes // (bs * heads * 2)

    def rnd(*shape, dtype=torch.bfloat16):
        n = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device).view(dtype).view(*shape)

    def packed():
        return [(rnd(nb, heads, bs, 2 * hd), 0) for _ in range(layers)]

    def block_major():  # every layer's page of a block together: blocks strided by all of them
        raw = rnd(nb, layers, block_bytes, dtype=torch.uint8)
        return [(raw[:, i].view(torch.bfloat16).view(nb, heads, bs, 2 * hd), 0) for i in range(layers)]

    def states():  # the state's bytes at the start of a padded page
        page = block_bytes + 256
        return [(rnd(nb, page, dtype=torch.uint8)[:, :block_bytes].view(torch.float32).view(nb, 4, -1), 0)
                for _ in range(layers)]

    return {
        "packed [nb, heads, bs, 2*hd]": lambda: {"kv": packed()},
        "kv split [2, nb, bs, heads, hd]": lambda: {"kv": [(rnd(2, nb, bs, heads, hd), 1) for _ in range(layers)]},
        "flashinfer [nb, 2, bs, heads, hd]": lambda: {"kv": [(rnd(nb, 2, bs, heads, hd), 0) for _ in range(layers)]},
        "block-major pages": lambda: {"kv": block_major()},
        "mamba state in padded raw pages": lambda: {"state": states()},
        "hybrid: kv + state in one job": lambda: {"kv": packed(), "state": states()},
        "kernel blocks grouped [nb, 4, heads, bs/4, 2*hd]": lambda: {"kv": [
            (rnd(4 * nb, heads, bs // 4, 2 * hd).unflatten(0, (nb, 4)), 0) for _ in range(layers)]},
        "tiny pieces (torch path on CUDA)": lambda: {"kv": [(rnd(nb, bs, heads, tiny).permute(0, 2, 1, 3), 0)
                                                            for _ in range(layers)]},
    }


def engine(kinds: dict, mode: str, slots: int) -> TransferEngine:
    """One group per kind; a slot is as long as the larger entry (as the connector sizes them)."""
    built, width = {}, 0
    for kind, tensors in kinds.items():
        offset, group = 0, []
        for t, dim in tensors:
            layer = Layer(t, dim)
            layer.offset, offset = offset, offset + layer.nbytes
            group.append(layer)
        built[kind], width = [group], max(width, offset)
    pool = host_memory.allocate(slots, width, pin=torch.cuda.is_available())  # as the worker's
    pool.zero_()
    return TransferEngine(built, pool, mode)


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


def check_layouts(device, modes: list, nb: int, block_bytes: int, n: int, seed: int) -> int:
    """Store n random blocks of each kind to random slots, load them to n other blocks, then
    compare every byte of every layer with a plain copy; the mismatches (and wrong reports)."""
    rng = np.random.default_rng(seed)
    bad = 0
    for name, build in layouts(device, nb, block_bytes, layers=3).items():
        for mode in modes:
            try:
                errors, path = _check_one(build(), mode, nb, n, rng)
            except Exception:  # noqa: BLE001 - report it and go on with the other layouts
                traceback.print_exc()
                errors, path = 1, "raised"
            bad += errors
            print(f"  {'ok ' if not errors else 'BAD'} {name:36s} mode={mode:6s} ({path})", flush=True)
    return bad


def _check_one(kinds: dict, mode: str, nb: int, n: int, rng) -> tuple[int, str]:
    """One layout in one mode: (layers or reports wrong, which path copied)."""
    eng = engine(kinds, mode, slots=2 * n * len(kinds))
    before = {k: [t.cpu().clone() for t, _ in ts] for k, ts in kinds.items()}
    perm = rng.permutation(nb)
    src, dst = torch.as_tensor(perm[:n]), torch.as_tensor(perm[n:2 * n])
    slots = rng.permutation(eng.pool.shape[0])[:n * len(kinds)].reshape(len(kinds), n)
    stores = [(k, (int(b),), int(s)) for k, sl in zip(kinds, slots) for b, s in zip(src, sl)]
    loads = [(k, (int(b),), int(s)) for k, sl in zip(kinds, slots) for b, s in zip(dst, sl)]
    eng.submit(stores, to_pool=True)
    eng.submit(loads, to_pool=False)  # no host wait: the default stream waits for it
    errors = 0
    for k, ts in kinds.items():
        for (t, dim), old in zip(ts, before[k]):
            want = old.clone()
            want.index_copy_(dim, dst, old.index_select(dim, src))
            errors += not torch.equal(host_bytes(t), host_bytes(want))  # read on the default stream
    eng.wait()
    errors += [j for j, _ in eng.get_finished()] != [0, 1]
    pieced = any(ly.pieces is not None for g in eng.layers.values() for ly in g[0])
    if not eng.cuda:
        return errors, "CPU path" if device_type(kinds) == "cpu" else "torch path (no Triton or pinned pool)"
    return errors, "CUDA path" if pieced else "torch path"


def device_type(kinds: dict) -> str:
    return next(iter(kinds.values()))[0][0].device.type


def timed(device, fn, rounds: int) -> float:
    """Best wall time of fn() with the device idle before and after."""
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def throughput(device, modes: list, total: int, rounds: int, seed: int) -> bool:
    """GB/s of stores and loads per mode at 16, 64, 256 KiB per layer block; True if the auto
    mode met the targets."""
    rng = np.random.default_rng(seed)
    layers = 8
    pin = device.type == "cuda"
    dev_buf = torch.empty(total, dtype=torch.uint8, device=device)
    host_buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    d2h = total / timed(device, lambda: host_buf.copy_(dev_buf, non_blocking=True), rounds) / 1e9
    h2d = total / timed(device, lambda: dev_buf.copy_(host_buf, non_blocking=True), rounds) / 1e9
    del dev_buf, host_buf
    print(f"  roofline (pinned copy_ of one {total >> 20} MiB buffer): D2H {d2h:6.1f} GB/s, H2D {h2d:6.1f} GB/s")
    met = True
    for kib, target in ((16, 0.5), (64, 0.8), (256, 0.8)):
        bb = kib * KIB
        n = max(1, total // (layers * bb))
        kinds = layouts(device, 2 * n, bb, layers)["packed [nb, heads, bs, 2*hd]"]()
        ids = rng.permutation(2 * n)[:n]
        slots = rng.permutation(n)
        ops = [("kv", (int(b),), int(s)) for b, s in zip(ids, slots)]
        nbytes = n * layers * bb
        for mode in modes:
            try:
                st, ld = _rates(device, kinds, mode, ops, n, nbytes, rounds)
            except Exception:  # noqa: BLE001 - report it and go on
                traceback.print_exc()
                met = False
                continue
            ok = st >= target * d2h and ld >= target * h2d
            if mode == "auto":
                met &= ok
            print(f"  {kib:4d} KiB x {layers} layers x {n:5d} blocks  mode={mode:6s}  store {st:6.1f} GB/s "
                  f"({100 * st / d2h:5.1f} %)  load {ld:6.1f} GB/s ({100 * ld / h2d:5.1f} %)"
                  + (f"  target {int(100 * target)} %: {'met' if ok else 'MISSED'}" if mode == "auto" else ""))
        del kinds
    return met


def _rates(device, kinds: dict, mode: str, ops: list, n: int, nbytes: int, rounds: int) -> tuple[float, float]:
    """GB/s of a store and of a load of `ops`, each waited for."""
    eng = engine(kinds, mode, slots=n)
    run = lambda to_pool: (eng.submit(ops, to_pool), eng.wait())  # noqa: E731
    run(True), run(False)  # compile, allocate staging
    st = nbytes / timed(device, lambda: run(True), rounds) / 1e9
    ld = nbytes / timed(device, lambda: run(False), rounds) / 1e9
    eng.get_finished()
    return st, ld


def steps(device, block_bytes: int, n: int, gap_ms: float, count: int) -> None:
    """The default stream's time per step with a store each step, against the same steps without."""
    if device.type != "cuda":
        print("  (CUDA only)")
        return
    layers = 8
    kinds = layouts(device, 2 * n, block_bytes, layers)["packed [nb, heads, bs, 2*hd]"]()
    eng = engine(kinds, "auto", slots=n)
    ops = [("kv", (b,), b) for b in range(n)]
    store_s = timed(device, lambda: (eng.submit(ops, True), eng.wait()), 3)
    cycles = 1 << 20
    per_cycle = timed(device, lambda: torch.cuda._sleep(cycles), 3) / cycles
    forward = int(2 * store_s / per_cycle)  # a forward twice as long as the store

    def run(store: bool) -> tuple[float, float]:
        spans, issue = [], 0.0
        for _ in range(count):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(forward)
            b.record()
            if store:
                t0 = time.perf_counter()
                eng.submit(ops, to_pool=True)  # the default stream then waits for its gather
                issue += time.perf_counter() - t0
            b.synchronize()  # the host waits for the step's sampled tokens
            time.sleep(gap_ms / 1e3)  # then schedules the next step
            spans.append(a.elapsed_time(b))
        eng.wait()
        eng.get_finished()
        return float(np.median(spans)), issue / count * 1e3

    base, _ = run(False)
    alone, issue = run(True)
    print(f"  store of {n} blocks x {layers} x {block_bytes // KIB} KiB: {store_s * 1e3:.2f} ms; forward {base:.2f} ms, "
          f"host gap {gap_ms} ms; host issue {issue:.2f} ms per store")
    print(f"  default stream blocked per step by the store: {max(0.0, alone - base):.3f} ms")


def rewrite_after_store(device, block_bytes: int, n: int) -> int:
    """Blocks zeroed on the default stream right after a store's submit (no host wait) reach the
    pool as they were before: the mismatching layers (0 when the fence holds)."""
    layers = 8
    kinds = layouts(device, n, block_bytes, layers)["packed [nb, heads, bs, 2*hd]"]()
    eng = engine(kinds, "auto", slots=n)
    want = [t.clone() for t, _ in kinds["kv"]]
    torch.cuda.synchronize()
    torch.cuda._sleep(busy_cycles(device, 20))  # the forward: the host queues all below meanwhile
    eng.submit([("kv", (b,), b) for b in range(n)], to_pool=True)
    for t, _ in kinds["kv"]:
        t.zero_()  # the next step's rewrite of freed blocks, queued at once
    eng.wait()
    bad = 0
    for i, w in enumerate(want):
        got = eng.pool[:, i * block_bytes:(i + 1) * block_bytes]
        bad += not torch.equal(got.to(device), w.reshape(n, -1).view(torch.uint8))
    print(f"  {'ok ' if not bad else 'BAD'} {n} blocks x {layers} layers zeroed right after the store's submit: "
          f"{'the pool holds them as stored' if not bad else f'{bad} layers reached the pool rewritten'}")
    return bad


def busy_cycles(device, ms: float) -> int:
    """torch.cuda._sleep cycles that keep the default stream busy for about `ms`."""
    cycles = 1 << 20
    return int(ms / 1e3 / (timed(device, lambda: torch.cuda._sleep(cycles), 3) / cycles))


def next_forward(device, total: int) -> None:
    """A long prefill's store (`total` bytes) and the next forward queued at once: how long that
    forward waits with staging up to STAGE_LIMIT, and with one buffer (the engine before). The
    store is queued behind a 20 ms forward, so the host's issue time is not counted."""
    layers, bb = 8, 256 * KIB
    n = total // (layers * bb)
    kinds = layouts(device, n, bb, layers)["packed [nb, heads, bs, 2*hd]"]()
    ops = [("kv", (b,), b) for b in range(n)]
    forward = busy_cycles(device, 20)
    limit = transfer.STAGE_LIMIT
    out = {}
    try:
        for name, stage_limit in (("bounded", limit), ("one buffer", transfer.STAGE_BYTES)):
            transfer.STAGE_LIMIT = stage_limit
            eng = engine(kinds, "auto", slots=n)
            store_s = timed(device, lambda: (eng.submit(ops, True), eng.wait()), 2)  # also allocates staging
            waits = []
            for _ in range(3):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(forward)
                a.record()
                eng.submit(ops, to_pool=True)
                torch.cuda._sleep(1000)  # the next forward
                b.record()
                b.synchronize()
                waits.append(a.elapsed_time(b))
                eng.wait()
            eng.get_finished()
            out[name] = (min(waits), store_s * 1e3)
            del eng
    finally:
        transfer.STAGE_LIMIT = limit
    (new, store_ms), (old, _) = out["bounded"], out["one buffer"]
    print(f"  store of {total >> 20} MiB: {store_ms:.2f} ms to the host; the next forward waits "
          f"{new:.2f} ms (staging up to {limit >> 20} MiB) vs {old:.2f} ms (one {transfer.STAGE_BYTES >> 20} MiB "
          f"buffer): ratio {old / max(new, 1e-6):.1f}x")


def pinned_pool(device) -> int:
    """Bytes pinned for a 1 GiB + 4 KiB pool, ours against torch's allocator; 1 if registered
    memory is not usable at its host address."""
    rows, row = 1, (1 << 30) + 4096
    n = rows * row
    lib = host_memory.cudart()
    t0 = time.perf_counter()
    ours = host_memory.allocate(rows, row, pin=True)
    ours_s = time.perf_counter() - t0
    same = host_memory.CudaHost(lib).device_pointer(ours.data_ptr()) == ours.data_ptr() if lib else False
    ours[0, :8] = 1
    ok = ours.is_pinned() and bool(ours[0, :8].to(device).sum() == 8)
    del ours
    stats = getattr(torch.cuda, "host_memory_stats", dict)  # torch >= 2.6
    before = stats().get("allocated_bytes.current", 0)
    t0 = time.perf_counter()
    theirs = torch.empty((rows, row), dtype=torch.uint8, pin_memory=True)
    theirs_s = time.perf_counter() - t0
    pinned = stats().get("allocated_bytes.current", 0) - before
    del theirs
    torch.cuda.synchronize()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # give torch's cached pinned block back
    print(f"  {'ok ' if ok and same else 'BAD'} pool of {n} bytes: host_memory pins {-(-n // 4096) * 4096} bytes "
          f"in {ours_s:.2f} s (device address {'=' if same else '!='} host address); torch's allocator pins "
          f"{pinned} bytes in {theirs_s:.2f} s ({pinned / n:.2f}x)")
    return 0 if ok and same else 1


def direct_loads(device, nfiles: int, rounds: int) -> int:
    """Block files read into the KV cache: pinned staging rows + load jobs against a pageable
    scratch slot + a copy per layer per block (before). Bytes checked (mismatching blocks)."""
    layers, bb = 32, 64 * KIB  # a 8B model's block: 32 layers x 64 KiB
    kinds = layouts(device, 2 * nfiles, bb, layers)["packed [nb, heads, bs, 2*hd]"]()
    staging = 32
    eng = engine(kinds, "auto", slots=staging)
    width = eng.slot_bytes
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    paths = []
    rng = np.random.default_rng(0)
    for i in range(nfiles):
        paths.append(os.path.join(root, f"{i}.kvb"))
        with open(paths[-1], "wb") as f:
            f.write(rng.integers(0, 256, width, dtype=np.uint8).tobytes())
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    scratch = torch.empty((1, width), dtype=torch.uint8)
    group = eng.layers["kv"][0]

    def before():  # blocks nfiles.. : the old path
        for i, fd in enumerate(fds):
            os.preadv(fd, [scratch[0].numpy()], 0)
            for layer in group:
                transfer.slots_to_layer(layer, [nfiles + i], [0], scratch)

    def staged():  # blocks 0.. : load_direct_staged
        for at in range(0, nfiles, staging):
            eng.wait_loads()
            for row, fd in enumerate(fds[at:at + staging]):
                os.preadv(fd, [eng.pool[row].numpy()], 0)
            eng.submit([("kv", (at + r,), r) for r in range(min(staging, nfiles - at))], to_pool=False)

    try:
        old_s = timed(device, before, rounds)
        new_s = timed(device, staged, rounds)
        bad = sum(not torch.equal(host_bytes(ly.tensor[i]), host_bytes(ly.tensor[nfiles + i]))  # bytes: NaNs
                  for ly in group for i in range(nfiles))
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            os.unlink(p)
        os.rmdir(root)
    mib = nfiles * width / 2**20
    print(f"  {'ok ' if not bad else 'BAD'} {nfiles} files x {width >> 20} MiB ({layers} layers): staged "
          f"{new_s * 1e3:.1f} ms ({mib / 1024 / new_s:.1f} GiB/s), per layer per block {old_s * 1e3:.1f} ms "
          f"({mib / 1024 / old_s:.1f} GiB/s): ratio {old_s / new_s:.2f}x")
    return bad


def guarded(check, *args) -> int:
    """A check's mismatches; 1 if it raised (printed, and the other checks go on)."""
    try:
        return check(*args) or 0
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU run)")
    ap.add_argument("--gap-ms", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    modes = ["auto", "kernel", "dma"] if cuda else ["auto"]
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}, "
          f"triton {'yes' if transfer.triton is not None else 'no'}")
    if cuda:
        eng = engine({"kv": [(torch.zeros(4, 1024, device=device), 0)]}, "auto", 1)
        how = (f"row copies by {'libcudart cudaMemcpyAsync' if eng.ops.memcpy else 'torch copy_'}, "
               f"{eng.ops.programs} kernel programs" if eng.cuda else "no Triton or pinned pool: the torch path")
        print(f"engine: CUDA path {eng.cuda} ({how}), copy engine from {transfer.DMA_MIN_ROW_BYTES // KIB} KiB rows, "
              f"staging {transfer.STAGE_BYTES >> 20} MiB buffers up to {transfer.STAGE_LIMIT >> 20} MiB, "
              f"d2h stream {'separate' if eng.cuda and eng.ops.d2h is not eng.ops.stream else 'n/a'}")
    t0 = time.perf_counter()
    print("1. layouts: store, load to other blocks, every byte")
    bad = check_layouts(device, modes, nb=64, block_bytes=(4 if args.quick else 16) * KIB, n=20, seed=args.seed)
    print(f"2. throughput ({time.perf_counter() - t0:.0f} s)")
    met = throughput(device, modes, (32 if args.quick else 256) << 20, 3 if args.quick else 5, args.seed)
    print(f"3. steps ({time.perf_counter() - t0:.0f} s)")
    bad += guarded(steps, device, 64 * KIB, 256, args.gap_ms, 20)
    if cuda:
        print(f"4. the store fence ({time.perf_counter() - t0:.0f} s)")
        bad += guarded(rewrite_after_store, device, 256 * KIB, 128)
        bad += guarded(next_forward, device, 1 << 30)
        print(f"5. the pinned pool ({time.perf_counter() - t0:.0f} s)")
        bad += guarded(pinned_pool, device)
        print(f"6. direct disk loads ({time.perf_counter() - t0:.0f} s)")
        bad += guarded(direct_loads, device, 96, 3)
    print(f"done in {time.perf_counter() - t0:.0f} s: {'BYTE MISMATCHES: ' + str(bad) if bad else 'every byte checked'}; "
          f"throughput targets {'met' if met else 'missed'}")
    return 1 if bad else 0  # byte mismatches, wrong reports, or a check that raised


if __name__ == "__main__":
    sys.exit(main())
