"""Process memory for the benchmarks: RSS, its high-water mark, and a tree sampler.

Linux only (reads ``/proc``). ``VmHWM`` is the kernel's own peak-RSS counter, so a
process that reads its own at the end misses nothing; for processes we do not own
(Flower's SuperLink, its ServerApp), `TreeSampler` polls ``VmHWM`` of every process in
a tree and keeps the largest value seen per process.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

MB = 1e6


def _status_kb(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size now."""
    return _status_kb(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Resident set size high-water mark since start (or since `reset_peak`)."""
    return _status_kb(pid, "VmHWM") * 1024


def reset_peak(pid: int | str = "self") -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0; needs ptrace rights)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def idle_rss_bytes() -> int:
    """This process's RSS after a garbage collection: its idle footprint."""
    gc.collect()
    return rss_bytes()


class TreeSampler:
    """Poll the peak RSS of every process under ``root_pids`` until `stop`.

    ``classify(cmdline) -> role or None`` names each process (``None``: not tracked);
    `peaks` then maps role -> largest ``VmHWM`` of one process of that role, and
    `pids` role -> how many processes of that role were seen.
    """

    def __init__(
        self,
        root_pids: list[int],
        classify: Callable[[str], str | None],
        interval_s: float = 0.1,
    ) -> None:
        self._roots = root_pids
        self._classify = classify
        self._interval = interval_s
        self._seen: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="mem-sampler")

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        for root in self._roots:
            try:
                procs = [psutil.Process(root)]
                procs += procs[0].children(recursive=True)
            except psutil.Error:
                continue
            for proc in procs:
                try:
                    role = self._seen.get(proc.pid, (None, 0))[0]
                    if role is None:
                        role = self._classify(" ".join(proc.cmdline()))
                    if role is None:
                        continue
                    peak = peak_rss_bytes(proc.pid)
                except (psutil.Error, OSError, KeyError):
                    continue
                old = self._seen.get(proc.pid, (role, 0))[1]
                self._seen[proc.pid] = (role, max(old, peak))

    @property
    def peaks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, peak in self._seen.values():
            out[role] = max(out.get(role, 0), peak)
        return out

    @property
    def pids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, _ in self._seen.values():
            out[role] = out.get(role, 0) + 1
        return out
