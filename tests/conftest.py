"""Shared fixtures: server configurations for loopback tests; Hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE``; the budgets are in ``tests/property_budget.py``):

- ``default``: each test's own budget of examples, new ones on every local run
  (failures are kept in ``.hypothesis/`` and replayed first);
- ``ci`` (set by ``.ci/run``): the same budget, derandomized, so a CI run checks the
  same examples each time;
- ``explore``: 20 times the budget, random, to search harder before a change lands:
  ``HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest -q tests/strategies``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings
from property_budget import EXPLORE_FACTOR, PROFILE

from fedloom import ServerConfig

settings.register_profile("ci", derandomize=True, print_blob=True)
# Tests that state no budget get Hypothesis's 100 examples, times the factor here too.
settings.register_profile("explore", max_examples=100 * EXPLORE_FACTOR, print_blob=True)
settings.load_profile(PROFILE)


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
