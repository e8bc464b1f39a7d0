"""Soak with faults: client load against `vllm serve` with KVBMConnector's CPU, disk and remote tiers
while a seeded injector strikes: redis-server SIGKILLed and restarted empty, `CLIENT PAUSE`, disk
block files truncated or flipped (one the engine holds open for a direct load when one shows up
within 10 s, racing that load), deleted, replaced by a FIFO or a symlink, the disk tier's filesystem
(a size-limited tmpfs mounted here: as root, else inside a user namespace of our own, `unshare
--user --map-root-user --mount`; a run that can do neither fails unless `--no-disk-full`) filled
then freed, and the engine SIGKILLed and restarted on the same disk path and Redis. Every
completion's greedy tokens are compared with a reference `vllm serve` without connector (started
beside it, prompts replayed at the end); one that first differs where the reference's two best
tokens are within NEAR_TIE is reported as a near tie, not a mismatch (vLLM's own paths differ by
float noise there). Sampled: RSS, open fds, disk bytes vs disk_bytes_to_use, redis memory. KV
events of each engine lifetime are recorded by `vllm-kvbm subscribe` and validated.
A soak must prove itself (issue 42): the CPU, disk and remote tiers must each have served hits
(vllm:kvbm_blocks_total on the server's /metrics, sampled before each engine kill: counters restart
with the engine), and a negative control runs at the first engine kill: with the load paused, a
fresh prompt is sent, its disk block files are forged while the engine is down (KV signs flipped,
a header that verifies: testing/soak_checks.py forge_block, with the tier secret the soak gave the
server as KVBM_KEY_SECRET), and the same prompt sent first after the restart must come back as a
mismatch (it is not counted among the soak's mismatches). `--no-negative-control` fails the run
unless `--allow-no-control` (local experiments); `--server kvbm-cpu` (tiers that serve no disk or
remote hits) fails too. Prints the acceptance checks of issues 31 and 42
and exits 1 if one fails.

    .venv/bin/python benchmarks/soak.py --minutes 20            # the acceptance run
    .venv/bin/python benchmarks/soak.py --minutes 2 --repeat 1  # what tests/serve/test_soak.py runs
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import math
import os
import pathlib
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_kvbm_plugin.testing.redis_server import RedisServer  # noqa: E402
from vllm_kvbm_plugin.testing.serving import Serve, kv_transfer_config, scrape  # noqa: E402
from vllm_kvbm_plugin.testing.soak_checks import (  # noqa: E402
    Control,
    control_check,
    forge_block,
    served_blocks,
    tier_checks,
)
from vllm_kvbm_plugin.testing.tiny_models import build  # noqa: E402

FAULTS = ("redis_kill", "redis_pause", "disk_truncate", "disk_flip", "disk_delete", "disk_fifo", "disk_symlink",
          "disk_full", "engine_kill")
HANG_S = 60
USERNS = "KVBM_SOAK_USERNS"  # set in the user namespace the soak re-runs itself in when not root
NEAR_TIE = 1e-5  # a reference top-2 logprob gap this small may flip on float noise alone (~20x the noise)


def post(port: int, body: dict, timeout: float = HANG_S) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode(errors="replace")
        return r.status, (json.loads(data) if r.status == 200 else data[:300])
    finally:
        conn.close()


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="kvbm-soak-"))
        self.disk_root = self.work / "disk"
        self.disk_root.mkdir(mode=0o700)
        self.mounted = False
        self.kinds = tuple(k for k in FAULTS if k != "disk_full" or not args.no_disk_full)
        self.model = args.model or str(build(args.model_kind))
        block = args.block_size
        self.prompt_blocks = args.prefix_blocks + 1
        self.prefixes = [[self.rng.randrange(10, 2000) for _ in range(args.prefix_blocks * block)]
                         for _ in range(args.prefixes)]
        self.records: list[dict] = []
        self.samples: list[dict] = []
        self.faults: list[dict] = []
        self.lock = threading.Lock()
        self.stop_at = 0.0
        self.restarting = threading.Event()  # set from an engine kill until the new server answers
        self.lifetime = 0
        self.secret = secrets.token_hex(16)  # the server's KVBM_KEY_SECRET: forge_block MACs with it
        self.quiet = threading.Event()  # clients send nothing new while set (the control's preparation)
        self.in_flight = 0
        self.blocks: dict[int, dict] = {}  # engine lifetime -> its last vllm:kvbm_blocks_total by (tier, direction)
        self.control_prompt: list[int] | None = None  # set once the control's blocks are forged
        self.forged = 0
        self.control_rec: dict | None = None

    # --- setup -------------------------------------------------------------------------------
    def mount(self) -> None:
        """A tmpfs of disk_bytes + 25 % as the disk tier's filesystem, so it can be filled."""
        size = self.args.disk_bytes + self.args.disk_bytes // 4 + (4 << 20)
        if self.args.no_disk_full:
            return
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(self.disk_root)],
                           capture_output=True, text=True)
        self.mounted = r.returncode == 0
        if not self.mounted:
            raise SystemExit(f"[soak] FAIL: no tmpfs for the full-disk fault ({r.stderr.strip()}): run as root or "
                             "where `unshare --user --map-root-user --mount true` works, or pass --no-disk-full")

    def start(self) -> None:
        a = self.args
        self.mount()
        self.redis = RedisServer(maxmemory=f"{max(64, 4 * a.disk_bytes >> 20)}mb").start()
        self.events = f"ipc://{self.work}/kv-events"
        ktc = kv_transfer_config(a.server, a.cpu_bytes, str(self.disk_root / "kv"), a.disk_bytes,
                                 self.redis.url)
        common = dict(dtype=a.dtype, block_size=a.block_size, num_gpu_blocks=a.gpu_blocks,
                      max_model_len=(self.prompt_blocks + 2) * a.block_size + a.output_len)
        self.server = Serve(self.model, self.work / "server.log", ktc=ktc, events_endpoint=self.events,
                            env={"KVBM_KEY_SECRET": self.secret}, **common)
        self.reference = Serve(self.model, self.work / "reference.log", extra=("--no-enable-prefix-caching",),
                               **common)
        self.start_subscriber()
        both = [threading.Thread(target=s.start) for s in (self.server, self.reference)]
        t0 = time.monotonic()
        for t in both:
            t.start()
        for t in both:
            t.join()
        for s in (self.server, self.reference):
            if s.proc is None or s.proc.poll() is not None:
                raise RuntimeError(f"server did not start; log tail:\n{s.tail()}")
        print(f"[soak] servers ready after {time.monotonic() - t0:.0f} s", flush=True)

    def start_subscriber(self) -> None:
        self.lifetime += 1
        out = self.work / f"events-{self.lifetime}.jsonl"
        self.subscriber = subprocess.Popen(
            [sys.executable, "-m", "vllm_kvbm_plugin.cli", "subscribe", "--endpoint", self.events, "--topic", "kv",
             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".summary"), "w"),
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def stop_subscriber(self) -> None:
        self.subscriber.send_signal(signal.SIGINT)
        try:
            self.subscriber.wait(10)
        except subprocess.TimeoutExpired:
            self.subscriber.kill()
            self.subscriber.wait()

    def cleanup(self) -> None:
        for s in (getattr(self, "server", None), getattr(self, "reference", None)):
            if s is not None:
                s.stop()
        if getattr(self, "subscriber", None) is not None and self.subscriber.poll() is None:
            self.stop_subscriber()
        if getattr(self, "redis", None) is not None:
            self.redis.stop()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.disk_root)], check=False)
        if self.args.keep:
            print(f"[soak] work directory kept: {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    def running(self) -> bool:
        """Load and sampling go on until the end, and through an engine restart begun before it."""
        return time.monotonic() < self.stop_at or self.restarting.is_set()

    # --- load --------------------------------------------------------------------------------
    def prompt(self, rng: random.Random) -> list[int]:
        return self.rng_prefix(rng) + [rng.randrange(10, 2000) for _ in range(self.args.block_size + 5)]

    def rng_prefix(self, rng: random.Random) -> list[int]:
        return self.prefixes[rng.randrange(len(self.prefixes))]

    def client(self, n: int) -> None:
        rng = random.Random(self.args.seed * 1000 + n)
        while self.running():
            with self.lock:  # the control's preparation waits for in_flight to drop to 0
                paused = self.quiet.is_set()
                self.in_flight += not paused
            if paused:
                time.sleep(0.05)
                continue
            rec = self.send(self.prompt(rng))
            with self.lock:
                self.records.append(rec)
                self.in_flight -= 1
            if rec["status"] != 200:
                time.sleep(0.5)

    def send(self, prompt: list[int]) -> dict:
        """One completion from the server under test, as a record (status, tokens or error, timing)."""
        body = {"model": "model", "prompt": prompt, "max_tokens": self.args.output_len, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        t0 = time.monotonic()
        rec = {"t": t0, "prompt": prompt, "restart_window": self.restarting.is_set(), "lifetime": self.lifetime}
        try:
            status, out = post(self.server.port, body)
            rec["status"] = status
            if status == 200:
                rec["tokens"] = out["choices"][0]["token_ids"]
                rec["cached"] = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            else:
                rec["error"] = out
        except TimeoutError:
            rec["status"], rec["error"] = "hang", f"no answer in {HANG_S} s"
        except (OSError, http.client.HTTPException) as e:  # refused, reset or cut short: the server is down
            rec["status"], rec["error"] = "conn", repr(e)
        rec["latency"] = time.monotonic() - t0
        rec["restart_window"] = rec["restart_window"] or self.restarting.is_set()
        return rec

    # --- faults ------------------------------------------------------------------------------
    def disk_write_failures(self) -> int:
        """Disk writes that failed as a whole so far (the worker logs each pause)."""
        return self.server.tail(1 << 30).count("disk tier write failed")

    def block_files(self) -> list[pathlib.Path]:
        return sorted(p for p in (self.disk_root / "kv").rglob("*.kvb") if p.is_file() and not p.is_symlink())

    def inject(self, kind: str, rng: random.Random) -> str:
        a = self.args
        if kind == "redis_kill":
            self.redis.kill()
            time.sleep(rng.uniform(1, 3))
            self.redis.start()
            return "killed, restarted empty"
        if kind == "redis_pause":
            ms = rng.randrange(2000, 5000)
            self.redis.client().execute_command("CLIENT", "PAUSE", ms, "ALL")
            return f"paused {ms} ms"
        if kind == "disk_full":
            filler = self.disk_root / "filler"
            st = os.statvfs(self.disk_root)
            free = st.f_bavail * st.f_frsize
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            failed_before = self.disk_write_failures()
            try:  # the space the tier frees by evicting is taken too, until the hold ends
                hold_until = time.monotonic() + rng.uniform(4, 8)
                while time.monotonic() < hold_until:
                    try:
                        while True:
                            os.write(fd, b"\0" * 4096)
                    except OSError:
                        time.sleep(0.05)
            finally:
                os.close(fd)
                filler.unlink()
            failed = self.disk_write_failures() - failed_before
            return f"filled {free >> 20} MiB for a while, freed; {failed} write failures logged"
        if kind == "engine_kill":
            control = a.negative_control and self.control_prompt is None
            files = self.prepare_control() if control else []  # pauses the load until the kill
            self.scrape_blocks()
            self.restarting.set()
            t0 = time.monotonic()
            try:
                self.server.kill()
                self.quiet.clear()
                for f in files:  # no engine runs: nothing reads or replaces them meanwhile
                    forge_block(str(f), bytes.fromhex(self.secret), 4 if a.dtype in ("float32", "float") else 2)
                    self.forged += 1
                self.stop_subscriber()
                self.start_subscriber()
                self.server.start()
            finally:
                self.quiet.clear()
                self.restarting.clear()
            back = time.monotonic() - t0
            if control:  # first after the restart: the CPU tier is empty, its blocks come from disk
                self.control_rec = self.send(self.control_prompt)
            self.stop_at = max(self.stop_at, time.monotonic() + self.args.after_restart_s)
            return f"SIGKILLed, back after {back:.0f} s" + (f"; negative control: {len(files)} block files forged"
                                                           if control else "")
        for _ in range(10):  # the tier may evict the chosen file meanwhile: choose again
            try:
                return self.damage_file(kind, rng)
            except FileNotFoundError:
                time.sleep(0.05)
        return "skipped (every chosen block file was evicted first)"

    def prepare_control(self) -> list[pathlib.Path]:
        """Pause the load (until the engine kill), send a fresh prompt and return its block files:
        the disk files that appear meanwhile, nothing else writing."""
        with self.lock:
            self.quiet.set()
        deadline = time.monotonic() + HANG_S
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        before = self.settled_files()
        rng = random.Random(self.args.seed + 2)
        self.control_prompt = [rng.randrange(10, 2000) for _ in range(self.prompt_blocks * self.args.block_size + 5)]
        rec = self.send(self.control_prompt)
        with self.lock:
            self.records.append(rec)  # not forged yet: it must match like any other
        deadline = time.monotonic() + 20
        new = set()
        while not new and time.monotonic() < deadline:
            new = self.settled_files() - before
        return sorted(new)

    def settled_files(self, still_s: float = 1.0, wait_s: float = 20.0) -> set[pathlib.Path]:
        """The block files once nothing changed under the disk tier for still_s (writes done)."""
        last, since, deadline = None, time.monotonic(), time.monotonic() + wait_s
        while True:
            now = set(self.block_files()) | set((self.disk_root / "kv").rglob("*.kvb.tmp*"))
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= still_s or time.monotonic() > deadline:
                return {f for f in now if f.name.endswith(".kvb")}
            time.sleep(0.1)

    def held_file(self, wait_s: float = 10.0) -> pathlib.Path | None:
        """A block file the engine holds open right now (verified, to be read straight into the KV
        cache a step later), polled for up to wait_s: damaging it races that load, which a file
        damaged while nobody holds it (found at its next verification) never does."""
        root, deadline = str(self.disk_root), time.monotonic() + wait_s
        pids = self.server.pids()
        while time.monotonic() < deadline:
            for pid in pids:
                try:
                    fds = os.listdir(f"/proc/{pid}/fd")
                except OSError:
                    continue
                for fd in fds:
                    try:
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if target.startswith(root) and target.endswith(".kvb"):
                        return pathlib.Path(target)
            time.sleep(0.002)
        return None

    def damage_file(self, kind: str, rng: random.Random) -> str:
        files = self.block_files()
        if not files:
            return "skipped (no block file)"
        held = self.held_file() if kind in ("disk_flip", "disk_truncate") else None
        f = held or rng.choice(files)
        if kind == "disk_truncate":
            os.truncate(f, f.stat().st_size // 2)
        elif kind == "disk_flip":
            with open(f, "r+b") as fp:
                off = rng.randrange(f.stat().st_size)
                fp.seek(off)
                b = fp.read(1)
                fp.seek(off)
                fp.write(bytes([b[0] ^ 0xFF]))
        elif kind == "disk_delete":
            f.unlink()
        elif kind == "disk_fifo":
            f.unlink()
            os.mkfifo(f, 0o600)
        elif kind == "disk_symlink":
            other = [g for g in files if g != f]
            target = rng.choice(other) if other else pathlib.Path("/etc/hostname")
            f.unlink()
            f.symlink_to(target)
        return f.name + (" (held open by the engine)" if held else "")

    def injector(self, start: float) -> None:
        a = self.args
        rng = random.Random(a.seed + 1)
        kinds = []
        for _ in range(a.repeat):  # rounds of every kind, the engine kill last (its restart is long)
            round_ = [k for k in self.kinds if k != "engine_kill"]
            rng.shuffle(round_)
            if round_[-1] == "disk_full":  # its paused disk writes would keep the control's blocks off disk
                round_[0], round_[-1] = round_[-1], round_[0]
            kinds += round_ + ["engine_kill"]
        span = a.minutes * 60 - a.warmup_s - 10
        slots = [a.warmup_s + span * (i + rng.uniform(0.1, 0.6)) / len(kinds) for i in range(len(kinds))]
        for kind, at in zip(kinds, slots):
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() >= self.stop_at:
                break
            t0 = time.monotonic()
            try:
                what = self.inject(kind, rng)
            except Exception as e:  # noqa: BLE001 - reported, the soak goes on
                what = f"injector error: {e!r}"
            self.faults.append({"kind": kind, "t": t0 - start, "what": what})
            print(f"[soak] {t0 - start:6.1f} s {kind}: {what}", flush=True)

    # --- sampling ----------------------------------------------------------------------------
    def disk_usage(self) -> tuple[int, int, int]:
        """(bytes the disk tier takes, as `du` counts them; its block files; bytes of files being
        written). On the tmpfs the bytes come from statvfs, one consistent figure: a walk races
        with the tier's unlinks and writes and can count an evicted file and its successor both.
        disk_full's filler is not counted."""
        walked, files, temps = 0, 0, 0
        for p in self.disk_root.rglob("*"):
            try:
                st = p.lstat()
            except OSError:
                continue
            if p.name != "filler" and not p.is_dir():
                walked += st.st_blocks * 512
                files += p.name.endswith(".kvb")
                temps += st.st_size if ".kvb.tmp" in p.name else 0
        if not self.mounted:
            return walked, files, temps
        st = os.statvfs(self.disk_root)
        try:
            filler = (self.disk_root / "filler").lstat().st_blocks * 512
        except OSError:
            filler = 0
        return (st.f_blocks - st.f_bfree) * st.f_frsize - filler, files, temps

    def scrape_blocks(self) -> None:
        """Keep this engine lifetime's vllm:kvbm_blocks_total by (tier, direction): the counters
        restart with the engine, so each lifetime's last scrape counts."""
        life = self.lifetime
        if self.restarting.is_set():
            return
        try:
            metrics = scrape(self.server.url)
        except (OSError, http.client.HTTPException):  # down or being killed: its last scrape stays
            return
        if life == self.lifetime and not self.restarting.is_set():
            self.blocks[life] = {(dict(ls)["tier"], dict(ls)["direction"]): v
                                 for (name, ls), v in metrics.items() if name == "vllm:kvbm_blocks_total"}

    def sampler(self, start: float) -> None:
        while self.running():
            self.scrape_blocks()
            disk, files, temps = self.disk_usage()
            try:
                redis_mem = int(self.redis.client().info("memory")["used_memory"])
            except Exception:  # noqa: BLE001 - killed or paused right now
                redis_mem = None
            self.samples.append({"t": time.monotonic() - start, "lifetime": self.lifetime,
                                 "restarting": self.restarting.is_set(), "rss": self.server.rss_bytes(),
                                 "fds": self.server.open_fds(), "disk": disk, "disk_files": files,
                                 "disk_temp": temps, "redis": redis_mem})
            time.sleep(self.args.sample_s)

    # --- run and judge -----------------------------------------------------------------------
    def run(self) -> bool:
        a = self.args
        self.start()
        start = self.started = time.monotonic()
        self.stop_at = start + a.minutes * 60
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(a.concurrency)]
        threads += [threading.Thread(target=self.injector, args=(start,), daemon=True),
                    threading.Thread(target=self.sampler, args=(start,), daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(a.minutes * 60 + 2 * HANG_S + 600)
        self.scrape_blocks()
        self.stop_subscriber()
        return self.judge()

    def replay(self) -> tuple[int, int]:
        """Each distinct answered prompt through the reference: (completions that differ, those of
        them that differ first at a near tie), each one printed with what may explain it."""
        ref = {}
        mismatched = ties = 0
        for rec in self.records:
            if "tokens" not in rec:
                continue
            key = tuple(rec["prompt"])
            if key not in ref:
                status, out = post(self.reference.port, {"model": "model", "prompt": rec["prompt"],
                                                         "max_tokens": self.args.output_len, "temperature": 0,
                                                         "ignore_eos": True, "return_token_ids": True}, 300)
                ref[key] = out["choices"][0]["token_ids"] if status == 200 else None
            if ref[key] != rec["tokens"]:
                tie = self.explain_mismatch(rec, ref[key])
                mismatched += not tie
                ties += tie
        return mismatched, ties

    def control(self) -> Control | None:
        """The negative control's outcome (None: off), printed."""
        if not self.args.negative_control:
            return None
        rec = self.control_rec
        if rec is None or "tokens" not in rec:
            print(f"[soak] negative control: no answer after the restart ({rec and rec.get('error')})", flush=True)
            return Control(self.forged, 0, False)
        status, out = post(self.reference.port, {"model": "model", "prompt": rec["prompt"],
                                                 "max_tokens": self.args.output_len, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True}, 300)
        expected = out["choices"][0]["token_ids"] if status == 200 else None
        mismatched = expected is not None and expected != rec["tokens"]
        print(f"[soak] negative control: {'mismatch (expected)' if mismatched else 'NO MISMATCH'}: "
              f"{rec['cached']} of {len(rec['prompt'])} prompt tokens loaded, {rec['tokens']} vs {expected}",
              flush=True)
        return Control(self.forged, rec["cached"], mismatched)

    def explain_mismatch(self, rec: dict, expected: list | None) -> bool:
        """Print a differing completion: when it was sent, the faults before its answer, what was
        cached, and the reference's two best tokens where it first differs. True for a near tie:
        the served token is the reference's runner-up by less than NEAR_TIE, a gap vLLM's own prefix
        cache and batching can flip (float noise up to ~5e-7 in logprobs: benchmarks/float_noise.py)."""
        t = rec["t"] - self.started
        first = next((i for i, (a, b) in enumerate(zip(rec["tokens"], expected or ())) if a != b), None)
        before = [f"{f['kind']} at {f['t']:.1f} s" for f in self.faults if f["t"] <= t + rec["latency"]][-2:]
        top = []  # the reference's (logprob, token id), best first
        if first is not None:
            status, out = post(self.reference.port, {"model": "model", "prompt": rec["prompt"] + expected[:first],
                                                     "max_tokens": 1, "temperature": 0, "logprobs": 2,
                                                     "return_tokens_as_token_ids": True}, 300)
            if status == 200:
                top = sorted(((lp, int(tok.split(":")[-1]))
                              for tok, lp in out["choices"][0]["logprobs"]["top_logprobs"][0].items()), reverse=True)
        gap = top[0][0] - top[1][0] if len(top) > 1 else None
        tie = gap is not None and gap < NEAR_TIE and rec["tokens"][first] == top[1][1]
        print(f"[soak] {'near tie' if tie else 'MISMATCH'}: sent at {t:.1f} s (lifetime {rec['lifetime']}, "
              f"{rec['latency']:.2f} s, {rec.get('cached', 0)} of {len(rec['prompt'])} prompt tokens cached), "
              f"first different token #{first}, the reference's top two there {top[:2]} (gap {gap}): "
              f"{rec['tokens']} vs {expected}; last faults before its answer: {before or 'none'}", flush=True)
        return tie

    def judge(self) -> bool:
        a = self.args
        ok = [r for r in self.records if r["status"] == 200]
        errors = [r for r in self.records if r["status"] not in (200, "hang") and not r["restart_window"]]
        window_errors = [r for r in self.records if r["status"] not in (200, "hang") and r["restart_window"]]
        hangs = [r for r in self.records if r["status"] == "hang"]
        mismatched, ties = self.replay()
        counts = collections.Counter(f["kind"] for f in self.faults if "skipped" not in f["what"]
                                     and "injector error" not in f["what"])
        bound = int(a.disk_bytes * (1 + a.disk_slack))
        top = max(self.samples, key=lambda s: s["disk"], default={"disk": 0, "disk_files": 0, "disk_temp": 0})
        max_disk = top["disk"]
        rss_growth, fd_growth = self.growth("rss"), self.growth("fds")
        streams = sorted(self.work.glob("events-*.jsonl"))
        v = subprocess.run([sys.executable, "-m", "vllm_kvbm_plugin.cli", "validate", *map(str, streams)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        events = sum(len(f.read_text().splitlines()) for f in streams)
        cached = sum(r.get("cached", 0) for r in ok)
        tier_blocks = collections.Counter()
        for blocks in self.blocks.values():
            tier_blocks.update(blocks)
        checks = [
            ("every fault kind at least %d x" % a.repeat,
             all(counts[k] >= a.repeat for k in self.kinds), dict(counts)),
            ("0 mismatched tokens", mismatched == 0, f"{mismatched} of {len(ok)} completions"
             f"{f' ({ties} more differ first at a near tie, gap < {NEAR_TIE:g}: float noise)' if ties else ''}"),
            ("0 HTTP errors outside the engine's restart window", not errors,
             f"{len(errors)} ({len(window_errors)} inside it){': ' + str(errors[0]['error'])[:200] if errors else ''}"),
            ("0 hangs (answer or refusal within %d s)" % HANG_S, not hangs, len(hangs)),
            ("disk never above its bound", max_disk <= bound, f"max {max_disk >> 10} KiB ({top['disk_files']} block files, "
             f"{top['disk_temp'] >> 10} KiB being written), bound {bound >> 10} KiB "
             f"(disk_bytes_to_use{f' + {a.disk_slack:.0%}' if a.disk_slack else ''})"),
            ("RSS after warm-up within 10 % of its first sample", rss_growth <= 0.10,
             f"{rss_growth:+.1%} worst lifetime"),
            ("no leaked file descriptors", fd_growth <= 0.10, f"{fd_growth:+.1%} worst lifetime"),
            ("event streams validate with 0 errors", v.returncode == 0 and events > 0,
             f"{len(streams)} streams, {events} batches; validator exit {v.returncode}"
             f"{'' if v.returncode == 0 else ': ' + (v.stdout + v.stderr).strip()[-600:]}"),
            *tier_checks(served_blocks(tier_blocks)),
            control_check(self.control(), a.allow_no_control),
        ]
        redis_mem = [s["redis"] for s in self.samples if s["redis"] is not None]
        print(f"\n[soak] {a.minutes} min, {len(self.records)} requests ({len(ok)} answered, {cached} tokens cached), "
              f"{len(self.faults)} faults; redis used_memory max {max(redis_mem, default=0) >> 20} MiB; "
              f"RSS max {max((s['rss'] for s in self.samples), default=0) >> 20} MiB, "
              f"{self.lifetime} engine lifetimes", flush=True)
        print("[soak] vllm:kvbm_blocks_total, all lifetimes: "
              + ", ".join(f"{t}/{d} {v:.0f}" for (t, d), v in sorted(tier_blocks.items())), flush=True)
        for name, passed, detail in checks:
            print(f"  [{'PASS' if passed else 'FAIL'}] {name}: {detail}")
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps({
                "faults": self.faults, "samples": self.samples, "requests": len(self.records), "answered": len(ok),
                "kvbm_blocks": {f"{t}/{d}": v for (t, d), v in sorted(tier_blocks.items())},
                "checks": [{"name": n, "passed": p, "detail": str(d)} for n, p, d in checks]}, indent=1))
        return all(p for _, p, _ in checks)

    def growth(self, key: str) -> float:
        """Worst growth, over the engine's lifetimes, of the last sample over the first one after
        warm-up (a third of that lifetime, at least warmup_s after its start)."""
        worst = 0.0
        by_life = collections.defaultdict(list)
        for s in self.samples:
            if not s["restarting"] and s[key]:
                by_life[s["lifetime"]].append(s)
        for samples in by_life.values():
            t0, t1 = samples[0]["t"], samples[-1]["t"]
            warm = [s for s in samples if s["t"] >= t0 + max(self.args.warmup_s, (t1 - t0) / 3)]
            if len(warm) >= 2:
                worst = max(worst, warm[-1][key] / warm[0][key] - 1)
        return worst


def user_namespace(argv: list[str]) -> None:
    """Not root: run again as root of a user and mount namespace of our own, where mounting the
    full-disk fault's tmpfs needs no privilege (servers and Redis run in it too; loopback is the
    host's). Where no such namespace can be made this returns, and mount() fails loudly."""
    cmd = ["unshare", "--user", "--map-root-user", "--mount"]
    if shutil.which("unshare") and subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
        print("[soak] not root: running again in a user namespace of its own (for the tmpfs)", flush=True)
        os.environ[USERNS] = "1"
        os.execvp(cmd[0], [*cmd, sys.executable, str(pathlib.Path(__file__).resolve()), *argv])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20)
    p.add_argument("--repeat", type=int, default=2, help="how often each fault kind strikes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--model-kind", default="llama", help="tiny model to build when --model is not given")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--prefix-blocks", type=int, default=8)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="vLLM's own cache (default: ~2/3 of the prefixes' blocks)")
    p.add_argument("--cpu-bytes", type=int, default=None, help="default: a third of the prefixes' KV")
    p.add_argument("--disk-bytes", type=int, default=None, help="default: two thirds of the prefixes' KV")
    p.add_argument("--warmup-s", type=float, default=15)
    p.add_argument("--sample-s", type=float, default=2)
    p.add_argument("--after-restart-s", type=float, default=20,
                   help="load kept up at least this long after the engine's restart")
    p.add_argument("--disk-slack", type=float, default=0.0,
                   help="disk bytes allowed above disk_bytes_to_use, as a fraction (default 0: the bound is strict)")
    p.add_argument("--server", default="kvbm-cpu-disk-remote", choices=("kvbm-cpu", "kvbm-cpu-disk",
                                                                          "kvbm-cpu-disk-remote"),
                   help="the tiers under test (with fewer than all three, the missing tiers' checks fail)")
    p.add_argument("--no-negative-control", dest="negative_control", action="store_false",
                   help="no forged block (the run then fails unless --allow-no-control)")
    p.add_argument("--allow-no-control", action="store_true", help="let a run without its negative control pass")
    p.add_argument("--no-disk-full", action="store_true", help="no full-disk fault (no tmpfs to fill)")
    p.add_argument("--json", default=None, help="write faults, samples and checks here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, event streams)")
    args = p.parse_args(argv)
    if not args.no_disk_full and os.geteuid() != 0 and USERNS not in os.environ:
        user_namespace(sys.argv[1:] if argv is None else argv)
    working = args.prefixes * args.prefix_blocks
    running = args.concurrency * (args.prefix_blocks + 3) + 8  # what the requests in flight need
    args.gpu_blocks = args.gpu_blocks or max(math.ceil(working * 2 / 3), running)
    model = args.model or str(build(args.model_kind))
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    block_bytes = (2 * cfg["num_hidden_layers"] * args.block_size * cfg["num_key_value_heads"]
                   * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
                   * (4 if args.dtype == "float32" else 2))
    args.cpu_bytes = args.cpu_bytes or max(working // 3, 4) * block_bytes
    args.disk_bytes = args.disk_bytes or max(2 * working // 3, 8) * block_bytes
    args.model = model
    print(f"[soak] {args.minutes} min, seed {args.seed}, {args.prefixes} prefixes x {args.prefix_blocks} blocks, "
          f"vLLM {args.gpu_blocks} blocks, CPU tier {args.cpu_bytes >> 10} KiB, disk {args.disk_bytes >> 10} KiB",
          flush=True)
    soak = Soak(args)
    try:
        return 0 if soak.run() else 1
    finally:
        soak.cleanup()


if __name__ == "__main__":
    sys.exit(main())
