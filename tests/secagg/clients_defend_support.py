"""What the tests of clients defending themselves share: the round's parameters, both
authentication modes, and a round run up to a stage."""

from __future__ import annotations

import pytest
from secagg_driver import Round, ids_of, make_inputs, run, setup_round

from fedloom.secagg import SecAggConfig, Stage

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=3.0, bits=20,
                      max_weight=100.0, max_participants=64)

BOTH_MODES = pytest.mark.parametrize("authenticated", [True, False],
                                     ids=["authenticated", "unauthenticated"])


def round_at(stage: Stage, authenticated: bool, config: SecAggConfig = CONFIG,
             n: int = 12) -> Round:
    return run(setup_round(config, make_inputs(ids_of(n), 8), authenticated=authenticated),
               stop_at=stage)
