import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("KVBM_TINY_MODELS", str(ROOT / ".cache" / "tiny-models"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory):
    """Run an engine scenario (see vllm_kvbm_plugin.testing.engine_run) in a fresh process."""

    def run(spec: dict, env: dict | None = None, timeout: int = 600) -> dict:
        d = tmp_path_factory.mktemp("engine")
        (d / "spec.json").write_text(json.dumps(spec))
        log = d / "log.txt"
        with open(log, "w") as out:
            # own session + log file: engine child processes can never hold our pipes open
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_kvbm_plugin.testing.engine_run", d / "spec.json", d / "out.json"],
                env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout)
            finally:
                kill_group(proc.pid)
        text = log.read_text()
        if rc != 0 or not (d / "out.json").exists():
            pytest.fail(f"engine run failed ({rc}); log tail:\n{text[-4000:]}")
        result = json.loads((d / "out.json").read_text())
        result["log"] = text
        return result

    return run
