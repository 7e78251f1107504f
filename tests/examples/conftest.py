"""Run the apps under ``examples/`` as a user would: their own scripts, in processes of
their own, from the repository root, each with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Apps:
    """Starts example scripts; `close` kills whatever is still running (and, since each
    runs in a session of its own, anything it started, such as Ray's workers)."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, script: str, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / script), *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def finish(self, process: subprocess.Popen[str], timeout_s: float) -> str:
        """Wait for ``process``; its output. Fails the test when it overruns or fails."""
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            output, _ = process.communicate()
            pytest.fail(f"{process.args} ran past {timeout_s} s:\n{output[-4000:]}")
        assert process.returncode == 0, f"{process.args} exited {process.returncode}:\n" + \
            output[-4000:]
        return output

    def run(self, script: str, *args: str, timeout_s: float) -> str:
        return self.finish(self.start(script, *args), timeout_s)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture
def apps() -> Iterator[Apps]:
    started = Apps()
    try:
        yield started
    finally:
        started.close()
