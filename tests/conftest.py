"""Shared fixtures: server configurations for loopback tests; Hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (set by ``.ci/run``) derandomizes every property test, so a
CI run checks the same examples each time; locally the default profile explores new
ones on every run (and keeps failures in ``.hypothesis/``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

from fedloom import ServerConfig

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def server_config(tmp_path: Path) -> Callable[..., ServerConfig]:
    def make(**overrides):  # type: ignore[no-untyped-def]
        base = dict(
            address="127.0.0.1:0",
            num_rounds=3,
            min_clients=3,
            min_fit_clients=3,
            state_dir=str(tmp_path / "state"),
            progress=False,
            round_timeout_s=30.0,
            long_poll_s=2.0,
            heartbeat_interval_s=0.5,
            client_timeout_s=5.0,
            insecure=True,  # loopback tests talk plaintext; tests/security covers TLS
        )
        base.update(overrides)
        return ServerConfig(**base)

    return make
