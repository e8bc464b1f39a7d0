"""`vllm serve` as benchmarks/bench_serve.py, benchmarks/soak.py and tests/serve/test_soak.py run it:
our own process session on a free loopback port (stopped or SIGKILLed by its PID, engine child
included), the connector configurations they compare, and a Prometheus text scrape."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value, as scraped

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM = pathlib.Path(sys.executable).with_name("vllm")
MODULE = "vllm_kvbm_plugin.connector"
OFFLOADING = "vllm_kvbm_plugin.offloading"
# server name -> (connector, tiers)
SERVERS = {
    "none": (None, ()),
    "kvbm-cpu": ("kvbm", ("cpu",)),
    "kvbm-cpu-disk": ("kvbm", ("cpu", "disk")),
    "kvbm-cpu-disk-remote": ("kvbm", ("cpu", "disk", "remote")),
    "offload-cpu": ("offload", ("cpu",)),
    "offload-cpu-disk": ("offload", ("cpu", "disk")),
    "offload-cpu-disk-remote": ("offload", ("cpu", "disk", "remote")),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_transfer_config(server: str, cpu_bytes: int, disk_path: str | None = None, disk_bytes: int = 0,
                       remote_url: str | None = None) -> dict[str, Any] | None:
    """The --kv-transfer-config of one of SERVERS (None: no connector)."""
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; valid: {', '.join(SERVERS)}")
    kind, tiers = SERVERS[server]
    if kind is None:
        return None
    if kind == "kvbm":
        extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes}
        if "disk" in tiers:
            extra |= {"disk_path": disk_path, "disk_bytes_to_use": disk_bytes}
        if "remote" in tiers:
            extra["remote_url"] = remote_url
        return {"kv_connector": "KVBMConnector", "kv_connector_module_path": MODULE, "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    extra = {"spec_name": "KVBMOffloadingSpec", "spec_module_path": OFFLOADING, "cpu_bytes_to_use": cpu_bytes}
    secondary: list[dict[str, Any]] = []
    if "disk" in tiers:
        secondary.append({"type": "KVBMDiskTier", "module_path": OFFLOADING, "path": disk_path,
                          "bytes_to_use": disk_bytes})
    if "remote" in tiers:
        secondary.append({"type": "KVBMRemoteTier", "module_path": OFFLOADING, "url": remote_url})
    if secondary:
        extra["secondary_tiers"] = secondary
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


class Serve:
    """One `vllm serve` (started with `start()`, restartable with the same arguments)."""

    def __init__(self, model: str, log: pathlib.Path, *, dtype: str = "float32", block_size: int = 32,
                 num_gpu_blocks: int | None = None, max_model_len: int = 4096, ktc: dict[str, Any] | None = None,
                 events_endpoint: str | None = None, env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.args = [str(VLLM), "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
                     "--dtype", dtype, "--block-size", str(block_size), "--max-model-len", str(max_model_len),
                     "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                     "--served-model-name", "model", "--seed", "0", *extra]
        if num_gpu_blocks:
            self.args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
        if ktc:
            self.args += ["--kv-transfer-config", json.dumps(ktc)]
        if events_endpoint:
            self.args += ["--kv-events-config", json.dumps(
                {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint, "topic": "kv"})]
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600) -> float:
        """Start and wait until /v1/models answers; returns the seconds it took."""
        t0 = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); log tail:\n{self.tail()}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).close()
                return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vllm serve not ready after {timeout} s; log tail:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def pids(self) -> list[int]:
        """The server's process and its descendants (the engine core)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            todo += [int(c) for c in children]
        return out

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pids())

    def rss_bytes(self) -> int:
        return sum(_proc_status(pid, "VmRSS") for pid in self.pids())

    def open_fds(self) -> int:
        n = 0
        for pid in self.pids():
            try:
                n += len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                pass
        return n

    def kill(self) -> None:
        """SIGKILL the whole session, as a crash would."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the live processes `pids` used so far (threads included)."""
    ticks = 0
    for pid in pids:
        try:
            f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(f[11]) + int(f[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _proc_status(pid: int, key: str) -> int:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> Metrics:
    """/metrics as {(name, ((label, value), ...)): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = tuple(sorted((k, v) for k, v in _LABEL.findall(m.group(2) or "")
                                  if k not in ("model_name", "engine")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(metrics: Metrics, name: str, **labels: str) -> float:
    """Sum of `name` over the samples whose labels include `labels`."""
    return sum(v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls))


def delta(after: Metrics, before: Metrics) -> Metrics:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def summarize(m: Metrics) -> dict[str, Any]:
    """Hit rates (vLLM's own prefix cache, the connector's) and bytes moved per tier and direction."""
    q, h = total(m, "vllm:prefix_cache_queries_total"), total(m, "vllm:prefix_cache_hits_total")
    eq, eh = total(m, "vllm:external_prefix_cache_queries_total"), total(m, "vllm:external_prefix_cache_hits_total")
    moved: dict[str, float] = {}
    for (name, labels), v in m.items():
        lab = dict(labels)
        if name == "vllm:kvbm_bytes_total" and v:
            key = f"{lab.get('tier')}:{lab.get('direction')}"
            moved[key] = moved.get(key, 0) + v
        elif name in ("vllm:kv_offload_load_bytes_total", "vllm:kv_offload_store_bytes_total") and v:
            key = f"{lab.get('transfer_type', lab.get('tier', 'cpu'))}:{name.split('_')[2]}"
            moved[key] = moved.get(key, 0) + v
    return {"vllm_hit_rate": h / q if q else 0.0, "connector_hit_rate": eh / eq if eq else 0.0,
            "bytes_moved": moved}
