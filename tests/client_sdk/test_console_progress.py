"""An embedded client says what it does by default — joined, one line per round's task,
the end — when the application configured no logging; ``log_to_console=False`` keeps it
quiet, and an application's own logging set-up always wins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from helpers import ScriptedClient, small_weights
    from fedloom.client_sdk import start_client
    from fedloom.config import ClientConfig, ServerConfig
    from fedloom.server import Server

    config = ServerConfig(address="127.0.0.1:0", num_rounds=2, min_clients=1,
                          min_fit_clients=1, state_dir={state!r}, progress=False,
                          long_poll_s=1.0, heartbeat_interval_s=0.5, client_timeout_s=5.0,
                          insecure=True)
    handle = Server(config, initial_weights=small_weights()).start()
    client_config = ClientConfig(server_address=handle.address, insecure=True)
    start_client(handle.address, ScriptedClient(seed=0, num_examples=7), config=client_config,
                 handle_signals=False, log_to_console={console})
    handle.wait(30)
""")


def _run(tmp_path: Path, console: bool) -> str:
    script = SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]),
                           state=str(tmp_path / "state"), console=console)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_client_prints_its_rounds_when_the_app_configured_no_logging(tmp_path: Path) -> None:
    lines = [line for line in _run(tmp_path, True).splitlines() if "fedloom client:" in line]
    text = "\n".join(lines)
    assert "joined" in text
    assert "round 1: trained on 7 examples, update sent" in text
    assert "round 2: trained on 7 examples, update sent" in text
    assert "round 2: evaluated on 7 examples, loss" in text
    assert "the run is finished" in text


def test_log_to_console_false_keeps_it_quiet(tmp_path: Path) -> None:
    assert "fedloom client:" not in _run(tmp_path, False)
