"""The Grafana dashboard (examples/grafana/vllm-kvbm.json) against real data: Debian's Prometheus
scrapes a real `vllm serve` with KVBMConnector's CPU, disk and remote (redis-server) tiers under a
short load that hits each tier, fails a disk read, pauses the server (remote errors, the breaker
opens and closes) and sends a `kvbm-pic:` request; then every panel's PromQL, with the dashboard's
variables substituted as Grafana would, must parse and return a series through Prometheus' HTTP API.
Everything listens on 127.0.0.1 only, on free ports; every process is stopped by its PID."""

import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from vllm_kvbm_plugin.testing.engine_forkserver import kill_group
from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary
from vllm_kvbm_plugin.testing.tiny_models import build

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "vllm-kvbm.json"
SLOT = 16384  # one tier entry of the tiny Llama (2 layers x K,V x 32 tokens x 2 heads x 32 x bf16)
FILE = 20480  # its block file on disk: SLOT + header + metadata room in 4 KiB blocks (block_file.file_footprint)
B = 32
# Grafana's values for the dashboard's variables: this server's labels, $__rate_interval as Grafana
# computes it for the default 15 s scrape interval (4 x 15 s), $__range of a 5-minute view.
VARIABLES = {"model_name": "model", "engine": "0", "__rate_interval": "1m", "__range": "5m"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_http(url: str, proc: subprocess.Popen, log: pathlib.Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[0]} exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    pytest.fail(f"{url} not ready after {timeout} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM the session it leads (vllm serve's engine process too), SIGKILL what is left after 10 s."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, rows' nested panels included."""
    out = []
    for p in dashboard["panels"]:
        for q in [p, *p.get("panels", [])]:
            out += [(q["title"], t["expr"]) for t in q.get("targets", [])]
    return out


def substitute(expr: str) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: VARIABLES[m.group(1)], expr)


class Load:
    """Token-id prompts of whole 32-token blocks (+ a few tokens) against the server."""

    def __init__(self, base: str):
        self.base = base
        self.rng = random.Random(33)

    def prompt(self, blocks: int = 6) -> list[int]:
        return [self.rng.randrange(10, 2000) for _ in range(blocks * B + 8)]

    def complete(self, prompt: list[int], salt: str | None = None) -> int:
        """The request's cached tokens (vLLM's prefix cache and the connector's hits)."""
        body = {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        usage = http(self.base + "/v1/completions", body)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def reset(self) -> None:
        """Drop vLLM's own prefix cache (dev mode endpoint); the tiers keep their blocks."""
        for _ in range(100):
            if http(self.base + "/reset_prefix_cache", {}).get("success"):
                return
            time.sleep(0.1)
        pytest.fail("/reset_prefix_cache kept failing")


def run_load(load: Load, redis_client, disk: pathlib.Path) -> dict:
    """With a CPU tier of 12 slots and a disk tier of 30 (two and five prompts), the remote tier
    holding all: hits from each tier, a failed disk read, remote errors and breaker changes,
    position-independent loads. scripts/launch_dashboard.sh runs it too."""
    cached = {}
    # position-independent loads: a preamble and two documents stored, then asked for swapped
    pre, docs, question = load.prompt(1)[:B], [load.prompt(2)[:2 * B] for _ in range(2)], load.prompt(0)
    load.complete(pre + docs[0] + docs[1] + question)
    cached["pic"] = load.complete(pre + docs[1] + docs[0] + question, salt="kvbm-pic:dashboard")
    remote_only, fails, disk_only, cpu = load.prompt(), load.prompt(), load.prompt(), load.prompt()
    load.complete(remote_only)
    for _ in range(5):  # push it out of the CPU and disk tiers
        load.complete(load.prompt())
    load.complete(fails)
    load.complete(disk_only)
    for _ in range(2):  # push both out of the CPU tier only
        load.complete(load.prompt())
    load.complete(cpu)
    load.reset()
    cached["cpu"] = load.complete(cpu)
    cached["local"] = load.complete(cpu)  # vLLM's own prefix cache
    cached["disk"] = load.complete(disk_only)
    # a disk read that fails verification (every block file's payload changed): a miss, which the
    # remote tier then serves
    for f in disk.rglob("*.kvb"):
        with open(f, "r+b") as fp:
            fp.seek(100)
            b = fp.read(1)
            fp.seek(100)
            fp.write(bytes([b[0] ^ 0xFF]))
    load.reset()
    cached["corrupt"] = load.complete(fails)
    cached["remote"] = load.complete(remote_only)  # after: its blocks would push `fails` off the disk
    # the server stops answering for 1.5 s: lookups time out, the breakers open, then close again
    redis_client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    load.complete(load.prompt())
    time.sleep(2)
    for _ in range(3):
        load.complete(load.prompt())
        time.sleep(0.5)
    return cached


def test_dashboard_is_importable_and_covers_every_metric(metric_types):
    """Grafana's import needs unique panel ids and known variables; every counter KVBMPromMetrics
    registers has a panel (a new metric without one fails here)."""
    from vllm_kvbm_plugin.connector.stats import KVBMPromMetrics

    d = json.loads(DASHBOARD.read_text())
    assert d["schemaVersion"] >= 36 and d["uid"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [q for p in d["panels"] for q in [p, *p.get("panels", [])]]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    exprs = " ".join(e for _, e in panel_queries(d))
    assert set(re.findall(r"\$\{?(\w+)", exprs)) <= set(variables) | {"__rate_interval", "__range"}
    types, registry = metric_types
    KVBMPromMetrics(type("C", (), {"kv_transfer_config": None})(), types, ["model_name", "engine"], {0: ["m", "0"]})
    names = {f"{m.name}_total" for m in registry.collect() if m.type == "counter"}
    assert len(names) >= 9 and all(n.startswith("vllm:kvbm_") for n in names), names
    assert {n for n in names if n not in exprs} == set()
    assert "vllm:kvbm_transfer_peak_bytes_per_second" in exprs  # the one gauge (measure_roofline)


@pytest.fixture
def prometheus_binary():
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus here (scripts/setup.sh installs Debian's when run as root)")
    if server_binary() is None:
        pytest.skip("no redis-server here (scripts/setup.sh installs Debian's when run as root)")
    return binary


def test_every_panel_returns_series(tmp_path, prometheus_binary):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dashboard)
    t_start = time.monotonic()
    model = build("llama")
    redis = RedisServer().start()
    serve = prom = None
    try:
        port, prom_port = free_port(), free_port()
        disk = tmp_path / "disk"
        extra = {"cpu_bytes_to_use": 12 * SLOT, "disk_path": str(disk), "disk_bytes_to_use": 30 * FILE,
                 "remote_url": redis.url, "measure_roofline": True, "pic_index_always": True}
        ktc = {"kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
               "kv_role": "kv_both", "kv_connector_extra_config": extra}
        serve_log = tmp_path / "serve.log"
        serve = subprocess.Popen(
            [str(pathlib.Path(sys.executable).parent / "vllm"), "serve", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager",
             "--block-size", str(B), "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--served-model-name", "model", "--distributed-executor-backend", "uni",
             "--kv-transfer-config", json.dumps(ktc)],
            stdout=open(serve_log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1",  # dev mode: POST /reset_prefix_cache
                 # with "uni": the worker runs inside EngineCore, one vLLM process less to start (~20 s)
                 "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs: [{{job_name: vllm, static_configs: [{{targets: ['127.0.0.1:{port}']}}]}}]\n")
        prom_log = tmp_path / "prometheus.log"
        prom = subprocess.Popen(
            [prometheus_binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=open(prom_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"http://127.0.0.1:{prom_port}/-/ready", prom, prom_log, 30)
        wait_http(f"http://127.0.0.1:{port}/v1/models", serve, serve_log, 240)
        t0 = time.monotonic()
        cached = run_load(Load(f"http://127.0.0.1:{port}"), redis.client(), disk)
        print(f"\nready after {t0 - t_start:.1f} s; load: {time.monotonic() - t0:.1f} s, cached tokens {cached}")
        time.sleep(3)  # two more scrapes: the last counters have two samples each

        def query(expr: str) -> list:
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            try:
                reply = http(url)
            except urllib.error.HTTPError as e:  # a parse error is a 400 with the reason
                pytest.fail(f"{expr}: {e.code} {e.read().decode()[:500]}")
            assert reply["status"] == "success", reply
            return reply["data"]["result"]

        assert query('up{job="vllm"}')[0]["value"][1] == "1"
        empty = []
        results = {}
        for title, expr in queries:
            results.setdefault(title, []).extend(res := query(substitute(expr)))
            if not res:
                empty.append(f"{title}: {substitute(expr)}")
        assert not empty, "panels without series:\n" + "\n".join(empty) + f"\n{serve_log.read_text()[-3000:]}"

        def labels(title: str, *names) -> set:
            return {tuple(r["metric"].get(n) for n in names) for r in results[title]}

        # the load reached every tier and fault it was built for, and the panels show it
        moved = labels("Blocks per second by tier and direction", "tier", "direction")
        assert {("cpu", "store"), ("cpu", "load"), ("disk", "write"), ("disk", "read"), ("remote", "write"),
                ("remote", "read")} <= moved, moved
        assert ("disk", "read") in labels("Tier failures by tier and operation", "tier", "operation")
        # the scheduler's breaker opened and closed again: the state panel says closed (0)
        state = {r["metric"]["side"]: r["value"][1] for r in results["Remote circuit breaker state"]}
        assert state.get("scheduler") == "0", state
        assert {("scheduler", "open"), ("scheduler", "closed")} <= labels("Remote circuit breaker changes",
                                                                          "side", "state")
        assert labels("Remote errors by operation", "operation") & {("lookup",), ("lookup_timeout",)}
        assert ("loaded",) in labels("Position-independent loads (kvbm-pic: requests)", "operation")
        assert min(cached[k] for k in ("cpu", "local", "disk", "remote")) == 6 * B and cached["pic"] > 0, cached
    finally:
        stop(serve)
        stop(prom)
        redis.stop()
