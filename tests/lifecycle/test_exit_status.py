"""``fedloom server``'s exit status tells a supervisor whether the run is over (issue 20,
item 5): 0 finished, 75 stopped with rounds to go, 1 failed, 2 refused to run. A
SIGTERM used to exit 0 whatever the run's state, which a Kubernetes Job or systemd's
``Restart=on-failure`` reads as "done, do not restart"."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from lifecycle_support import ClientThreads, GatedClient, ServerCommand, wait_until

from fedloom import cli
from fedloom.errors import ConfigError
from fedloom.server import Server


def test_statuses_are_distinct() -> None:
    statuses = {cli.EXIT_FINISHED, cli.EXIT_FAILED, cli.EXIT_REFUSED, cli.EXIT_STOPPED}
    assert cli.EXIT_FINISHED == 0 and len(statuses) == 4


def test_sigterm_before_the_run_finished_exits_stopped(tmp_path: Path) -> None:
    server = ServerCommand(tmp_path)  # two clients needed, none come: it waits
    process = server.start()
    server.wait_serving(process)
    process.send_signal(signal.SIGTERM)
    assert server.wait(process, 30) == cli.EXIT_STOPPED, server.output()
    assert "before the run finished" in server.output()


def test_sigterm_after_the_run_finished_exits_finished(tmp_path: Path) -> None:
    server = ServerCommand(tmp_path, num_rounds=1, min_clients=1, min_fit_clients=1,
                           finished_grace_s=120.0)
    first = server.start()
    server.wait_serving(first)
    pool = ClientThreads(server.address, [GatedClient()])  # type: ignore[arg-type]
    try:
        # The run ends, its one client leaves: the server exits 0 without using its grace.
        assert server.wait(first, 30) == cli.EXIT_FINISHED, server.output()
        # Started again on the finished run, it waits for that client (long gone) in its
        # grace period; a SIGTERM there still means "the run is over".
        second = server.start()
        server.wait_serving(second)
        wait_until(lambda: "telling its clients" in server.output(), 10.0, "the grace period")
        second.send_signal(signal.SIGTERM)
        assert server.wait(second, 30) == cli.EXIT_FINISHED, server.output()
    finally:
        pool.close()


def test_an_unexpected_error_exits_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    def fail(self: Server) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Server, "run", fail)
    server = ServerCommand(tmp_path)
    code = cli.main(["server", "--config", str(server.config),
                     "--initial-weights", str(server.weights)])
    assert code == cli.EXIT_FAILED
    assert "the server failed" in caplog.text and "No space left" in caplog.text


def test_a_bad_setting_exits_refused(tmp_path: Path) -> None:
    server = ServerCommand(tmp_path)
    code = cli.main(["server", "--config", str(server.config), "--finished-grace-s", "-1"])
    assert code == cli.EXIT_REFUSED


def test_start_raises_what_stopped_the_server_before_it_served(tmp_path: Path) -> None:
    # The state folder cannot be made (a file is in its way): start() says so, rather
    # than handing back a server that never bound its port.
    import numpy as np

    from fedloom import Weights
    from fedloom.config import ServerConfig

    blocker = tmp_path / "state"
    blocker.write_text("not a folder")
    config = ServerConfig(address="127.0.0.1:0", insecure=True, state_dir=str(blocker),
                          progress=False)
    with pytest.raises(ConfigError, match=r"state_dir: cannot use .*state: File exists"):
        Server(config, initial_weights=Weights({"w": np.zeros(2, np.float32)})).start(10)
