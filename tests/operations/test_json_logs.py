"""``fedloom server --log-format json``: every line it writes to stderr parses as JSON,
the rounds included (the live display's table is left out), wherever stderr goes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from helpers import ScriptedClient, run_clients, small_weights

from fedloom.server import save_weights


def test_every_stderr_line_of_a_json_logging_server_parses(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "server.toml"
    # progress is on (the default): the JSON format must turn its table off
    config.write_text(f"""address = "127.0.0.1:{port}"
num_rounds = 3
min_clients = 2
min_fit_clients = 2
state_dir = "{tmp_path / 'state'}"
insecure = true
long_poll_s = 1.0
heartbeat_interval_s = 0.5
client_timeout_s = 5.0
""")
    weights = tmp_path / "initial.safetensors"
    save_weights(weights, small_weights())
    stderr = tmp_path / "stderr.log"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedloom.cli", "server", "--config", str(config),
             "--initial-weights", str(weights), "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=err)
        threads = run_clients(f"127.0.0.1:{port}", [ScriptedClient(seed=i, num_examples=5)
                                                     for i in range(2)])
        try:
            assert proc.wait(60) == 0, stderr.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
        for t in threads:
            t.join(10)
    lines = [line for line in stderr.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    rounds = [r for r in records if "round" in r and "status" in r]
    assert [r["round"] for r in rounds][-3:] == [1, 2, 3]
    assert all(r["status"] == "ok" for r in rounds[-3:])
