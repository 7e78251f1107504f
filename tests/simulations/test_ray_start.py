"""`start_ray`: Flower's Ray arguments, and a head that does not come up retried with a
fresh one (a stand-in for ``ray`` records every call; the Ray-backed engine tests start
the real one through the same function)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fedloom.simulations import _ray_start
from fedloom.simulations._ray_start import ray_init_args, start_ray, stop_ray

GCS_TIMEOUT = "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y"


class FakeRay:
    """``ray.init`` fails with ``failures`` (one per call, in order), then starts."""

    def __init__(self, failures: list[Exception], running: bool = False) -> None:
        self.failures = list(failures)
        self.running = running
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def is_initialized(self) -> bool:
        return self.running

    def init(self, **kwargs: Any) -> None:
        self.calls.append(("init", kwargs))
        if self.failures:
            raise self.failures.pop(0)
        self.running = True

    def shutdown(self) -> None:
        self.calls.append(("shutdown", {}))
        self.running = False


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(failures: list[Exception], running: bool = False) -> FakeRay:
        ray = FakeRay(failures, running)
        monkeypatch.setattr(_ray_start, "ray", ray)
        monkeypatch.setenv("PYTHONPATH", "/elsewhere")
        return ray
    return install


def test_a_head_that_does_not_come_up_is_shut_down_and_started_afresh(
        fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    ray = fake([RuntimeError(GCS_TIMEOUT)])
    with caplog.at_level(logging.WARNING, logger=_ray_start.__name__):
        assert start_ray({"init_args": {"num_cpus": 2}}) is True
    assert [name for name, _ in ray.calls] == ["init", "shutdown", "init"]
    assert ray.calls[0][1] == ray.calls[2][1]  # the same arguments both times
    assert ray.running
    (warning,) = caplog.records
    assert "attempt 1 of 3" in warning.getMessage() and GCS_TIMEOUT in warning.getMessage()


def test_a_raylet_that_does_not_register_in_time_is_retried_too(fake: Any) -> None:
    # Ray raises this one as a bare Exception (ray/_private/node.py)
    ray = fake([Exception("The current node timed out during startup. This could happen "
                          "because some of the raylet failed to startup or the GCS has "
                          "become overloaded.")])
    assert start_ray({}) is True
    assert [name for name, _ in ray.calls] == ["init", "shutdown", "init"]


def test_gives_up_after_the_attempts_naming_the_last_error(fake: Any) -> None:
    ray = fake([RuntimeError("first"), ConnectionError("second"), TimeoutError("third")])
    with pytest.raises(RuntimeError, match=r"^Ray did not start in 3 attempts; last error: "
                                           r"third$") as info:
        start_ray({})
    assert isinstance(info.value.__cause__, TimeoutError)
    assert [name for name, _ in ray.calls] == ["init", "shutdown"] * 3
    assert not ray.running


@pytest.mark.parametrize("error", [ValueError("bad init argument"),
                                   TypeError("bad init argument"),
                                   Exception("bad init argument")])
def test_other_errors_are_not_retried(fake: Any, error: Exception) -> None:
    ray = fake([error])
    with pytest.raises(type(error), match="bad init argument"):
        start_ray({"init_args": {"bogus": 1}})
    assert [name for name, _ in ray.calls] == ["init"]


def test_a_running_ray_is_used_as_it_is(fake: Any) -> None:
    ray = fake([], running=True)
    assert start_ray({"init_args": {"address": "auto"}}) is False
    assert ray.calls == []
    stop_ray()  # the caller's own Ray is shut down only when the caller asks
    assert [name for name, _ in ray.calls] == ["shutdown"]


def test_flowers_arguments_and_the_workers_import_path(fake: Any) -> None:
    ray = fake([])
    start_ray({"init_args": {"num_cpus": 2, "log_to_driver": False}})
    (_, kwargs), = ray.calls
    pythonpath = kwargs.pop("runtime_env")["env_vars"]["PYTHONPATH"]
    assert pythonpath.endswith("/elsewhere") and pythonpath != "/elsewhere"
    # run_simulation's defaults (WARNING, logs to the driver) fill only what is unset.
    assert kwargs == {"num_cpus": 2, "log_to_driver": False, "logging_level": "WARNING",
                      "include_dashboard": False}
    assert ray_init_args({}, verbose=True) == {"include_dashboard": False}


def test_attempts_must_be_positive(fake: Any) -> None:
    fake([])
    with pytest.raises(ValueError, match="attempts must be at least 1, got 0"):
        start_ray({}, attempts=0)
