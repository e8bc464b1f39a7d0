"""Run engine scenarios (`engine_run`) in children forked from one process that imported vLLM once.

    python -m vllm_kvbm_plugin.testing.engine_forkserver

Importing torch and vLLM takes ~10 s of every engine scenario; a child forked after the imports
starts with them done (vLLM forks its own engine-core and worker processes the same way). Each child
is still a fresh engine and plugin: nothing of ours is imported here (numba imported before vLLM
builds an engine crashes it), no engine is built, no plugin is loaded, and each child gets exactly
the environment its job names (engine_run sets its own defaults).

One JSON line per job on stdin: {"spec": path, "out": path, "log": path, "env": {...}}. Answers on
stdout: {"pid": N} once the child runs (its own session: kill its group to stop it), then
{"pid": N, "rc": N} when it has ended. Jobs run one at a time. `ForkServer` is the client.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import traceback
from typing import Any


def _child(job: dict) -> None:
    """Become the scenario's process: own session, output to the log, the job's environment."""
    try:
        os.setsid()
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = ["engine_run", job["spec"], job["out"]]
        from vllm_kvbm_plugin.testing import engine_run

        engine_run.main()  # exits with 0 itself
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # reached only when the scenario failed


def main() -> None:
    import torch  # noqa: F401  the slow imports, done once
    import vllm  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401

    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(job)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}), flush=True)


class ForkServer:
    """The client: starts the server (own session, stderr to `log_path`) and runs jobs on it."""

    def __init__(self, log_path: str | os.PathLike[str]) -> None:
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, bufsize=0, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # PIPEs
        self._jobs, self._answers = self.proc.stdin, self.proc.stdout

    def _answer(self, timeout: float) -> dict[str, Any] | None:
        """The next answer line, or None after `timeout` seconds (unbuffered: select sees it all)."""
        if not select.select([self._answers], [], [], timeout)[0]:
            return None
        line = self._answers.readline()
        if not line:
            raise RuntimeError(f"the engine fork server died; its log: {self.log.name}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, job: dict[str, Any], timeout: float) -> int | None:
        """Run one scenario; its exit code, or None if it ran out of time (then killed)."""
        self._jobs.write((json.dumps(job) + "\n").encode())
        started = self._answer(120)  # the first job waits for the server's imports
        if started is None:
            raise RuntimeError(f"the engine fork server did not start a scenario; its log: {self.log.name}")
        ended = self._answer(timeout)
        kill_group(started["pid"])  # the scenario's leftovers, or the scenario itself on a timeout
        if ended is None:
            self._answer(60)  # the server reports the killed child
            return None
        return ended["rc"]

    def close(self) -> None:
        self._jobs.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
        self.log.close()


def kill_group(pid: int) -> None:
    """SIGKILL a process's whole session (its engine children too), if it still exists."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main()
