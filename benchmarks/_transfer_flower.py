"""Flower's side of benchmarks/transfer.py: its deployment engine on loopback.

One fresh cluster per model size: a SuperLink and ``num_nodes`` SuperNodes
(``flower-superlink`` / ``flower-supernode --insecure`` on loopback), every process
under an address-space cap (``prlimit --as``; children such as the ServerApp and
ClientApp processes inherit it), then ``flwr run`` of the hand-written app in
``flower_transfer_app/``. The
ServerApp stamps the end of every round (see its module); `TreeSampler` follows the
peak RSS of the SuperLink, the ServerApp it starts, the SuperNodes and their ClientApps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from _procmem import TreeSampler, rss_bytes

APP = Path(__file__).resolve().parent / "flower_transfer_app"
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f} s")


def _role(cmdline: str) -> str | None:
    for marker, role in (
        ("flwr-serverapp", "serverapp"),
        ("flwr-clientapp", "clientapp"),
        ("flower-superlink", "superlink"),
        ("flower-supernode", "supernode"),
        ("flower-superexec", "superexec"),
    ):
        if marker in cmdline:
            return role
    return None


class Cluster:
    """A SuperLink and SuperNodes, each in its own session, capped by ``prlimit``."""

    def __init__(self, workdir: Path, num_nodes: int, mem_cap_bytes: int) -> None:
        self.workdir = workdir
        self.num_nodes = num_nodes
        self.cap = mem_cap_bytes
        self.port = _free_port()
        self.superlink: subprocess.Popen[bytes] | None = None
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.home = workdir / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "loop"\n\n[superlink.loop]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / log_name, "wb")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            ["prlimit", f"--as={self.cap}", "--", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self._env(),
        )

    def _env(self) -> dict[str, str]:
        # The SuperLink and SuperNodes start `flower-superexec` from PATH.
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "FLWR_HOME": str(self.home), "PATH": path}

    def start(self) -> None:
        self.superlink = self._spawn(
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
            "superlink.log",
        )
        _wait_port(self.port, 90)
        for i in range(self.num_nodes):
            node_port = _free_port()
            self.nodes.append(
                self._spawn(
                    [
                        str(BIN / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{self.port}",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(node_port),
                        "--node-config",
                        f"partition-id={i} num-partitions={self.num_nodes}",
                    ],
                    f"supernode-{i}.log",
                )
            )
        for node in self.nodes:
            if node.poll() is not None:
                raise RuntimeError(f"a SuperNode exited at start; see {self.workdir}")

    def submit(self, run_config: dict[str, Any]) -> None:
        pairs = " ".join(
            f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in run_config.items()
        )
        done = subprocess.run(
            [str(BIN / "flwr"), "run", str(APP), "loop", "--run-config", pairs],
            env=self._env(),
            capture_output=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"flwr run failed: {done.stdout.decode()} {done.stderr.decode()}")

    def alive(self) -> bool:
        return self.superlink is not None and self.superlink.poll() is None

    def stop(self) -> None:
        """End every process this cluster started, children (some detached) included."""
        procs = [p for p in [self.superlink, *self.nodes] if p is not None]
        family: list[psutil.Process] = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                family += psutil.Process(proc.pid).children(recursive=True)
        for proc in procs:  # each leads its own session: its group holds its children
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for child in family:
            with contextlib.suppress(psutil.Error):
                child.terminate()
        _, alive = psutil.wait_procs(family, timeout=15)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def run(num_params: int, rounds: int, num_nodes: int, mem_cap_bytes: int) -> dict[str, Any]:
    """One Flower run on a fresh cluster: round end stamps and peak RSS per role."""
    with tempfile.TemporaryDirectory(prefix="flwr-bench-") as tmp:
        workdir = Path(tmp)
        cluster = Cluster(workdir, num_nodes, mem_cap_bytes)
        out = workdir / "rounds.json"
        started = time.time()
        try:
            cluster.start()
            assert cluster.superlink is not None
            time.sleep(3.0)  # let the SuperNodes register and the SuperLink settle
            idle = rss_bytes(cluster.superlink.pid)
            roots = [cluster.superlink.pid, *(n.pid for n in cluster.nodes)]
            sampler = TreeSampler(roots, _role).start()
            cluster.submit(
                {
                    "num-params": num_params,
                    "num-rounds": rounds,
                    "num-nodes": num_nodes,
                    "out-file": str(out),
                }
            )
            deadline = time.monotonic() + 120 + 120 * rounds
            while not out.exists():
                if not cluster.alive() or time.monotonic() > deadline:
                    sampler.stop()
                    tail = (workdir / "superlink.log").read_text(errors="replace")[-2000:]
                    return {"error": "the Flower run did not finish", "log_tail": tail}
                time.sleep(0.5)
            sampler.stop()
            stamps = json.loads(out.read_text())
        finally:
            cluster.stop()
    return {
        "round_ends": stamps["round_ends"],
        "superlink_idle_rss": idle,
        "peak_rss": sampler.peaks,
        "processes": sampler.pids,
        "wall_s": time.time() - started,
    }
