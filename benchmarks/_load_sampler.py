"""What the load benchmarks measure with: the server process seen from outside (its CPU
time and RSS every few seconds from ``/proc``, Linux only; the machine's busy CPU over
the same time; the server's connected-clients gauge from its metrics endpoint), latency
percentiles, and the open-files limit that thousands of connections need.

The machine's busy time minus the server's and the clients' says how much CPU anything
else took while the benchmark ran (another job on the machine skews the figures).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import resource
import threading
import time
import urllib.request

import numpy as np

MB = 1e6
_TICK = os.sysconf("SC_CLK_TCK")


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (thousands of
    connections need as many descriptors); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    p50, p95, p99 = np.percentile(np.asarray(values), [50, 95, 99])
    return {
        "n": len(values),
        "p50": round(float(p50), 5),
        "p95": round(float(p95), 5),
        "p99": round(float(p99), 5),
        "max": round(float(max(values)), 5),
    }


def time_collections() -> list[float]:
    """The garbage collector's pauses, summed per generation (a list, filled in place)."""
    pauses = [0.0, 0.0, 0.0]
    started = [0.0]

    def timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(timer)
    return pauses



def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def process_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (not idle, not waiting on I/O)."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:8]]
    return (sum(values) - values[3] - values[4]) / _TICK


def scrape_gauge(port: int, name: str) -> float | None:
    """One gauge's value from a Prometheus endpoint on localhost (None if unreadable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


@dataclasses.dataclass(frozen=True)
class Sample:
    t: float  # wall clock (time.time())
    cpu_s: float  # the server's CPU seconds so far
    rss_bytes: int
    machine_busy_s: float
    connected: float | None  # the server's fedloom_clients_connected, if scraped


class ServerSampler:
    """Sample the server process every ``interval_s`` in a thread until `stop`."""

    def __init__(self, pid: int, interval_s: float = 1.0, metrics_port: int | None = None
                 ) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.metrics_port = metrics_port
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="server-sampler")

    def start(self) -> ServerSampler:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            connected = (scrape_gauge(self.metrics_port, "fedloom_clients_connected")
                         if self.metrics_port else None)
            self.samples.append(Sample(time.time(), process_cpu_s(self.pid),
                                       process_rss_bytes(self.pid), machine_busy_s(),
                                       connected))
        except OSError:  # the server has exited
            self._stop.set()

    def between(self, start: float, end: float) -> tuple[float, float]:
        """Server CPU seconds and machine busy seconds between two wall-clock times
        (linear between samples)."""
        if len(self.samples) < 2:
            return 0.0, 0.0
        t = np.array([s.t for s in self.samples])
        cpu = np.array([s.cpu_s for s in self.samples])
        busy = np.array([s.machine_busy_s for s in self.samples])

        def delta(values: np.ndarray) -> float:
            return float(np.interp(end, t, values) - np.interp(start, t, values))

        return delta(cpu), delta(busy)


def rss_slope_mb_per_min(samples: list[Sample]) -> float:
    """Least-squares slope of RSS over time, MB per minute (0 with under 2 samples)."""
    if len(samples) < 2:
        return 0.0
    t = np.array([s.t for s in samples]) / 60.0
    rss = np.array([s.rss_bytes for s in samples]) / MB
    return float(np.polyfit(t - t[0], rss, 1)[0])
