import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("KVBM_TINY_MODELS", str(ROOT / ".cache" / "tiny-models"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory):
    """Run an engine scenario (see vllm_kvbm_plugin.testing.engine_run) in a fresh process."""

    def run(spec: dict, env: dict | None = None, timeout: int = 600) -> dict:
        d = tmp_path_factory.mktemp("engine")
        (d / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_kvbm_plugin.testing.engine_run", d / "spec.json", d / "out.json"],
            env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        )
        (d / "log.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not (d / "out.json").exists():
            pytest.fail(f"engine run failed ({proc.returncode}); log tail:\n{(proc.stdout + proc.stderr)[-4000:]}")
        result = json.loads((d / "out.json").read_text())
        result["log"] = proc.stdout + proc.stderr
        return result

    return run
