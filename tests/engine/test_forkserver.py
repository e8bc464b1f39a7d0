"""The engine fork server (what every run_engine scenario runs on): a failing scenario reports its
exit code and traceback, a scenario past its time is killed and the server goes on."""

import json

import pytest

from vllm_kvbm_plugin.testing.engine_forkserver import ForkServer

pytestmark = pytest.mark.engine


def test_a_failed_or_timed_out_scenario_is_reported_and_the_next_one_runs(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"model": str(tmp_path / "no-model"), "llm": {},
                                                    "events": False, "steps": []}))
    server = ForkServer(tmp_path / "server.txt")
    try:
        def job(name: str) -> dict:
            return {"spec": str(tmp_path / "spec.json"), "out": str(tmp_path / f"{name}.json"),
                    "log": str(tmp_path / f"{name}.txt"), "env": {}}

        assert server.run(job("failed"), timeout=300) == 1
        assert "Traceback" in (tmp_path / "failed.txt").read_text()
        assert server.run(job("late"), timeout=0.01) is None  # killed long before it could fail
        assert server.run(job("after"), timeout=300) == 1  # the server still answers, in order
        assert not (tmp_path / "after.json").exists()
    finally:
        server.close()
    assert server.proc.returncode == 0
