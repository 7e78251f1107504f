"""What the command line says for the mistakes a newcomer makes: a package of an extra
the install lacks, a file path given as ``--app``, a scenario file that is not there; and
flags that stand alone."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedloom import cli
from fedloom.client_sdk import Client, ClientStats
from fedloom.config import ClientConfig
from fedloom.errors import TransportError
from fedloom.privacy import calibrate_noise_multiplier
from fedloom.simulations.cli import main as simulate_main


def _missing(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.mark.parametrize(("module", "extra"), [("safetensors", "server"),
                                              ("dp_accounting.rdp", "server"),
                                              ("torch", "torch"), ("matplotlib", "demo")])
def test_a_package_of_a_missing_extra_is_named_with_its_install_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], module: str,
        extra: str) -> None:
    # A device's client install has none of the server's packages; a server command run
    # there says what to install and exits "refused" (a supervisor must not restart it).
    def run(args: object) -> int:
        raise _missing(module)

    monkeypatch.setattr(cli, "_run_runs", run)
    assert cli.main(["runs", "--state-dir", "x"]) == cli.EXIT_REFUSED
    err = capsys.readouterr().err
    assert f"needs the {module.split('.')[0]!r} package" in err
    assert f'pip install "fedloom[{extra}]"' in err


def test_any_other_import_error_is_not_mistaken_for_a_missing_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def run(args: object) -> int:
        raise _missing("some_typo_module")

    monkeypatch.setattr(cli, "_run_runs", run)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["runs", "--state-dir", "x"])


@pytest.mark.parametrize("app", ["../srv/mymodule.py:make_client", "mymodule.py:make_client",
                                 "srv/mymodule:make_client", "C:\\apps\\mymodule.py:make_client",
                                 "C:/apps/mymodule:make_client"])
def test_a_file_path_as_app_is_refused_with_the_form_to_use(
        capsys: pytest.CaptureFixture[str], app: str) -> None:
    code = cli.main(["client", "--server", "127.0.0.1:1", "--insecure", "--app", app])
    assert code == cli.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "is a file path; give the module's name" in err
    assert "mymodule:make_client for ./mymodule.py" in err


def test_a_missing_scenario_file_is_named_as_the_scenario(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main([str(tmp_path / "nope.toml")]) != 0
    err = capsys.readouterr().err
    assert "scenario: file" in err and "not found" in err and "--config" not in err


def test_secure_aggregation_flags_stand_alone_or_take_a_value() -> None:
    parser = cli.build_parser()
    alone = parser.parse_args(["server", "--secure-aggregation"])
    valued = parser.parse_args(["server", "--secure-aggregation", "false",
                                "--secagg-allow-unauthenticated"])
    assert alone.secagg_enabled is True
    assert valued.secagg_enabled is False and valued.secagg_allow_unauthenticated is True


def test_calibration_under_poisson_sampling_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    # dp-accounting warns for every RDP order it leaves out of an epsilon (about fifty
    # lines for this one); leaving an order out only loosens epsilon, and says nothing.
    with caplog.at_level(logging.WARNING):
        z = calibrate_noise_multiplier(8.0, 1e-5, 50, sampling="poisson", rate=0.1)
    assert z == pytest.approx(0.8574, abs=1e-4)
    assert not [r for r in caplog.records if r.name == "absl"]


def test_a_number_setting_of_the_wrong_type_in_python_names_the_setting() -> None:
    from fedloom.config import ServerConfig
    from fedloom.errors import ConfigError

    with pytest.raises(ConfigError, match=r"num_rounds: must be an integer, got '3'"):
        ServerConfig(insecure=True, num_rounds="3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"progress: must be true or false, got 1"):
        ServerConfig(insecure=True, progress=1)  # type: ignore[arg-type]
    assert ServerConfig(insecure=True, round_timeout_s=5).round_timeout_s == 5  # int: a number


def test_numpy_numbers_are_numbers() -> None:
    import numpy as np

    from fedloom.config import ServerConfig

    config = ServerConfig(insecure=np.bool_(True), num_rounds=np.int64(3),
                          min_clients=np.int32(2), fraction_fit=np.float32(0.5),
                          round_timeout_s=np.float64(30))
    assert config.num_rounds == 3 and config.min_clients == 2


def test_the_server_logs_an_import_error_that_is_no_missing_extra_and_exits_failed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    def run(args: object) -> int:
        raise _missing("some_typo_module")

    monkeypatch.setattr(cli, "_run_server", run)
    assert cli.main(["server", "--insecure"]) == cli.EXIT_FAILED
    assert "the server failed" in caplog.text and "some_typo_module" in caplog.text


def test_a_refusal_is_a_json_line_with_log_format_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["server", "--insecure", "--log-format", "json", "--num-rounds", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    record = json.loads(line)
    assert record["level"] == "ERROR"
    assert record["message"] == "fedloom server: error: num_rounds: must be at least 1"


def test_an_unknown_log_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["server", "--insecure", "--log-level", "LOUD"])
    assert exc.value.code == 2
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


def test_runs_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    from fedloom.server.store import RunStore

    RunStore(tmp_path / "fedloom.db").close()
    read, write = os.pipe()
    os.close(read)  # the reader (`| head`) is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fedloom.cli", "runs", "--json", "--state-dir",
             str(tmp_path)], stdout=write, stderr=subprocess.PIPE, timeout=60, check=False)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr and b"BrokenPipe" not in done.stderr


def test_a_json_refusal_is_written_whatever_the_log_level(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["server", "--insecure", "--log-format", "json", "--log-level", "critical",
                     "--num-rounds", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert json.loads(line)["message"].endswith("num_rounds: must be at least 1")


@pytest.mark.parametrize("level", ["warn", "fatal", "Debug"])
def test_the_old_level_names_still_work(level: str) -> None:
    args = cli.build_parser().parse_args(["server", "--insecure", "--log-level", level])
    assert getattr(logging, args.log_level) in (logging.WARNING, logging.CRITICAL, logging.DEBUG)


def test_a_broken_pipe_in_the_server_is_a_failure_not_a_finish(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A closed pipe under `fedloom runs` ends quietly; under the server it is a failure
    # (exit 1: restart), never a finished run (exit 0).
    def broken(args: object) -> int:
        raise BrokenPipeError("the progress display's pipe closed")

    monkeypatch.setattr(cli, "_run_server", broken)
    assert cli.main(["server", "--insecure"]) == cli.EXIT_FAILED


def test_an_empty_token_file_is_refused_by_name(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "token.txt"
    empty.write_text("\n")
    argv = ["client", "--server", "127.0.0.1:1", "--insecure", "--app", "x:y",
            "--token-file", str(empty)]
    assert cli.main(argv) == cli.EXIT_REFUSED
    assert f"--token-file: {empty} is empty" in capsys.readouterr().err


class _NoopClient(Client):
    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")


@pytest.mark.parametrize(("outcome", "status"), [
    (ClientStats(fits=3, run_finished=True), cli.EXIT_FINISHED),
    (ClientStats(fits=1, run_finished=False), cli.EXIT_STOPPED),  # SIGTERM mid-run
    (TransportError("gave up after 5 attempts to reach the server"), cli.EXIT_STOPPED),
    (KeyError("a bug in the app"), cli.EXIT_FAILED),
])
def test_the_client_exit_status_says_how_it_ended(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        outcome: object, status: int) -> None:
    # As the server's: 0 only when the run is over; 75 for a client stopped with its
    # run going on, or one that gave up reaching the server (a restart may do better);
    # 1 for a failure; 2 stays for what needs fixing first.
    def start_client(*args: object, **kwargs: object) -> ClientStats:
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, ClientStats)
        return outcome

    import fedloom.client_sdk as sdk

    monkeypatch.setattr(sdk, "start_client", start_client)
    monkeypatch.setattr(cli, "_load_attr", lambda spec, setting: _NoopClient())
    argv = ["client", "--server", "127.0.0.1:1", "--insecure", "--app", "m:c",
            "--log-format", "json"]
    assert cli.main(argv) == status
    err = capsys.readouterr().err
    assert all(json.loads(line) for line in err.strip().splitlines())  # every line JSON
    if isinstance(outcome, TransportError):
        assert "the client stops: gave up after 5 attempts" in err
    if isinstance(outcome, KeyError):
        assert "the client failed" in err and "a bug in the app" in err


def _client_command(monkeypatch: pytest.MonkeyPatch, *extra: str
                    ) -> tuple[int, ClientConfig | None]:
    """``fedloom client ... EXTRA`` with start_client stubbed: its exit status, and the
    config start_client was given (None when the command refused before it)."""
    given: list[ClientConfig] = []

    def start_client(*args: object, config: ClientConfig, **kwargs: object) -> ClientStats:
        given.append(config)
        return ClientStats(run_finished=True)

    import fedloom.client_sdk as sdk

    monkeypatch.setattr(sdk, "start_client", start_client)
    monkeypatch.setattr(cli, "_load_attr", lambda spec, setting: _NoopClient())
    argv = ["client", "--server", "127.0.0.1:1", "--insecure", "--app", "m:c", *extra]
    return cli.main(argv), (given[0] if given else None)


def test_the_client_commands_stop_timeout_reaches_its_config(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    status, config = _client_command(monkeypatch, "--stop-timeout-s", "8.5")
    assert status == cli.EXIT_FINISHED and config is not None and config.stop_timeout_s == 8.5
    _, config = _client_command(monkeypatch)
    assert config is not None
    assert config.stop_timeout_s == ClientConfig("h:1", insecure=True).stop_timeout_s
    assert _client_command(monkeypatch, "--stop-timeout-s", "0") == (cli.EXIT_REFUSED, None)
    assert "stop_timeout_s" in capsys.readouterr().err


def test_the_client_commands_secagg_max_attempts_reaches_the_protocol(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fedloom.client_sdk import ClientRunner
    from fedloom.messages import Session

    def attempts(config: ClientConfig | None) -> int:
        assert config is not None
        runner = ClientRunner(_NoopClient(), config)
        return runner._secure_fit(Session("c1", b"s" * 32)).protocol.max_attempts

    status, config = _client_command(monkeypatch, "--secagg-max-attempts", "5")
    assert status == cli.EXIT_FINISHED and attempts(config) == 5
    assert attempts(_client_command(monkeypatch)[1]) == 3
    assert _client_command(monkeypatch, "--secagg-max-attempts", "17") == (
        cli.EXIT_REFUSED, None)
