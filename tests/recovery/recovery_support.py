"""Recovery-test helpers: a deterministic run, the server as a killable subprocess.

The run is deterministic so that a run killed and restarted any number of times must
end with the *same bits* as an uninterrupted one:

- each client's update depends only on (round, seed, global weights);
- its steps are multiples of 1/64 (or zero), so every delta is a float32 whose float64
  weighted sum at the server is exact: the order in which uploads arrive cannot change
  the mean (float addition is not associative in general; here it is exact);
- every connected client trains every round (``fraction_fit = 1``, ``min_clients`` =
  ``min_fit_clients`` = the number of clients), and FedAdam with Adam bias correction
  carries moments and a step count from round to round, so a lost or doubled strategy
  state shows in the final model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedloom import Weights
from fedloom.client_sdk import Client, ClientStats, EvaluateOutput, FitOutput, start_client
from fedloom.config import ClientConfig, ServerConfig, from_mapping
from fedloom.server import save_weights
from fedloom.server.checkpoint import load_checkpoint
from fedloom.server.store import RunStore

NUM_CLIENTS = 3
NUM_ROUNDS = 6
CRASH_EXIT = 86


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DeterministicClient(Client):
    """new = global + k/64 with integer k from (seed, round) and the global weights."""

    def __init__(self, seed: int, num_examples: int, fit_delay_s: float = 0.0) -> None:
        self.seed = seed
        self.num_examples = num_examples
        self.fit_delay_s = fit_delay_s  # "training time": widens the window for kills
        self.rounds: list[int] = []

    def fit(self, weights: Weights, config):  # type: ignore[no-untyped-def]
        server_round = int(config["server_round"])
        self.rounds.append(server_round)
        time.sleep(self.fit_delay_s)
        rng = np.random.default_rng([self.seed, server_round])
        new: dict[str, np.ndarray] = {}
        for name, g in weights.items():
            noise = rng.integers(-64, 65, size=g.shape)
            if g.dtype.kind != "f":  # integer tensors (a step counter) take integer steps
                new[name] = g + (noise // 32).astype(g.dtype)
                continue
            pull = np.rint(-16.0 * g.astype(np.float64))  # about -g/4, in 1/64 steps
            k = np.clip(noise + pull, -256, 256)
            new[name] = g + (k / 64.0).astype(g.dtype)
        return FitOutput(Weights(new), self.num_examples, {"train_loss": float(server_round)})

    def evaluate(self, weights: Weights, config):  # type: ignore[no-untyped-def]
        return EvaluateOutput(0.0, self.num_examples, {})


def initial_weights() -> Weights:
    rng = np.random.default_rng(1234)
    tensors: dict[str, np.ndarray] = {
        "layer.w": rng.normal(size=(6, 5)).astype(np.float32),
        "layer.b": np.zeros(5, np.float32),
        "steps": np.zeros((), np.int64),  # an integer tensor takes the integer rule
    }
    return Weights(tensors)


def run_settings(state_dir: Path, port: int, **overrides: Any) -> dict[str, Any]:
    """The run's settings, as the TOML file the server command reads."""
    settings: dict[str, Any] = {
        "address": f"127.0.0.1:{port}",
        "num_rounds": NUM_ROUNDS,
        "min_clients": NUM_CLIENTS,
        "min_fit_clients": NUM_CLIENTS,
        "fraction_fit": 1.0,
        "fraction_evaluate": 0.0,
        "round_timeout_s": 60.0,
        "long_poll_s": 1.0,
        "heartbeat_interval_s": 0.5,
        "client_timeout_s": 10.0,
        "keep_checkpoints": 2,
        "state_dir": str(state_dir),
        "progress": False,
        "insecure": True,  # plaintext on loopback; tests/security covers TLS
        "strategy": {"name": "fedadam", "eta": 0.05, "bias_correction": "adam"},
    }
    settings.update(overrides)
    return settings


def server_config(settings: dict[str, Any]) -> ServerConfig:
    return from_mapping(ServerConfig, settings)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def write_toml(path: Path, settings: dict[str, Any]) -> None:
    lines = [f"{k} = {_toml_value(v)}" for k, v in settings.items() if not isinstance(v, dict)]
    for table, values in settings.items():
        if isinstance(values, dict):
            lines.append(f"[{table}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")


class ClientPool:
    """Deterministic clients in threads; they reconnect by themselves across restarts."""

    def __init__(
        self, address: str, num_clients: int = NUM_CLIENTS, fit_delay_s: float = 0.0
    ) -> None:
        self.clients = [
            DeterministicClient(seed=i, num_examples=i + 1, fit_delay_s=fit_delay_s)
            for i in range(num_clients)
        ]
        self.stop = threading.Event()
        self.stats: dict[int, ClientStats] = {}
        self.errors: list[BaseException] = []
        config = ClientConfig(
            server_address=address,
            rpc_timeout_s=5.0,
            reconnect_initial_s=0.05,
            reconnect_max_s=0.3,
            insecure=True,
        )
        self.threads = [
            threading.Thread(target=self._run, args=(i, c, address, config), daemon=True)
            for i, c in enumerate(self.clients)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int, client: Client, address: str, config: ClientConfig) -> None:
        try:
            self.stats[i] = start_client(
                address,
                client,
                name=f"site-{i}",
                config=config,
                stop=self.stop,
                handle_signals=False,
            )
        except BaseException as exc:  # reported by join()
            self.errors.append(exc)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.stop.set()
        for t in self.threads:
            t.join(5.0)
        assert not self.errors, self.errors
        assert all(not t.is_alive() for t in self.threads), "a client thread did not end"


class ServerProcess:
    """``fedloom server --config FILE --initial-weights FILE`` as a child process."""

    def __init__(self, folder: Path, settings: dict[str, Any]) -> None:
        self.folder = folder
        self.config_path = folder / "server.toml"
        self.weights_path = folder / "initial.safetensors"
        write_toml(self.config_path, settings)
        save_weights(self.weights_path, initial_weights())
        self.log_path = folder / "server.log"
        self.starts = 0

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "fedloom.cli", "server",
            "--config", str(self.config_path),
            "--initial-weights", str(self.weights_path),
            "--log-level", "INFO",
        ]  # fmt: skip

    def start(self, crash_at: str | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != "FEDLOOM_CRASH_AT"}
        if crash_at:
            env["FEDLOOM_CRASH_AT"] = crash_at
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {self.starts} (crash_at={crash_at})\n".encode())
            log.flush()
            return subprocess.Popen(self.command(), env=env, stdout=log, stderr=log)

    def wait_until_serving(self, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> bool:
        """Wait for this start's "listening" log line; False if the process ended first."""
        marker = f"==== start {self.starts} "
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if "server listening on" in text[text.rfind(marker) :]:
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.02)
        raise AssertionError(f"server did not start serving in {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait(self, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.wait(5)
            raise AssertionError(
                f"server did not exit in {timeout_s} s:\n{self.log_tail()}"
            ) from exc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL: no cleanup, no flush, as a power cut would."""
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def run_state(state_dir: Path) -> tuple[str, str, int]:
    """(run id, status, last committed round) of the newest run in ``state_dir``."""
    if not (state_dir / "fedloom.db").exists():
        return "", "none", -1
    store = RunStore(state_dir / "fedloom.db")
    try:
        runs = store.runs()
        if not runs:
            return "", "none", -1
        run = runs[-1]
        last = store.latest_round(run.run_id)
        return run.run_id, run.status, last.round if last else -1
    finally:
        store.close()


def final_checkpoint(state_dir: Path) -> tuple[Weights, Any, list[int]]:
    """The newest run's last committed weights and strategy state, and its rounds."""
    store = RunStore(state_dir / "fedloom.db")
    try:
        runs = store.runs()
        assert len(runs) == 1, f"expected one run, found {[r.run_id for r in runs]}"
        assert runs[0].status == "finished"
        rounds = store.rounds(runs[0].run_id)
        last = rounds[-1]
        checkpoint = load_checkpoint(state_dir / last.checkpoint, last.sha256)
        return checkpoint.weights, checkpoint.strategy_state, [r.round for r in rounds]
    finally:
        store.close()


def assert_same_state(got: Any, want: Any, where: str = "state") -> None:
    """Strategy states equal, arrays bit for bit."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=where)
    else:
        assert got == want, where


def assert_bitwise_equal(got: Weights, want: Weights) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def run_with_restarts(
    folder: Path,
    crashes: Sequence[str],
    *,
    timeout_s: float = 60.0,
    **overrides: Any,
) -> tuple[ServerProcess, ClientPool]:
    """Start the server command, let it die at each crash point in turn (restarting it
    with the same command each time), then let it finish the run; ``overrides`` change
    the run's settings."""
    port = free_port()
    server = ServerProcess(folder, run_settings(folder / "state", port, **overrides))
    pool = ClientPool(f"127.0.0.1:{port}")
    try:
        for crash_at in crashes:
            code = server.wait(server.start(crash_at), timeout_s)
            assert code == CRASH_EXIT, f"{crash_at}: exit {code}\n{server.log_tail()}"
        code = server.wait(server.start(), timeout_s)
        assert code == 0, f"exit {code}\n{server.log_tail()}"
        pool.join(15.0)
    finally:
        pool.stop.set()
    return server, pool


#: A finished run: final weights, strategy state, committed rounds.
Reference = tuple[Weights, Any, list[int]]
_reference: dict[str, Reference] = {}


def reference_run(tmp_root: Path, **overrides: Any) -> Reference:
    """The uninterrupted run (in-process server, same settings, changed by
    ``overrides``): final weights, strategy state and committed rounds. Computed once
    per test session and settings."""
    key = repr(sorted(overrides.items()))
    if key not in _reference:
        from fedloom.server import Server

        folder = tmp_root / f"reference-{len(_reference)}"
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        config = server_config(run_settings(folder / "state", port, **overrides))
        handle = Server(config, initial_weights=initial_weights()).start()
        pool = ClientPool(handle.address)
        history = handle.wait(60)
        pool.join(15.0)
        assert [r.status for r in history] == ["ok"] * NUM_ROUNDS
        if not overrides:  # every client trains every round
            assert all(c.rounds == list(range(1, NUM_ROUNDS + 1)) for c in pool.clients)
        _reference[key] = final_checkpoint(folder / "state")
    return _reference[key]
