"""A private run does not resume from an older checkpoint when its newest are unusable.

Rounds after the usable checkpoint released models (broadcast, evaluated, maybe
published) and spent budget; a resume from before them would rebuild the accountant
without those rounds and run them again with fresh noise, reporting less ε than spent.
A run without `[privacy]` falls back to the newest usable round, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import small_weights

from fedloom.config import ServerConfig
from fedloom.errors import ConfigError
from fedloom.privacy import PrivacyConfig
from fedloom.server.persistence import RunPersistence
from fedloom.server.store import RunStore
from fedloom.simulations.history import RoundRecord
from fedloom.strategies import FedAvg, apply_privacy


def _three_rounds(config: ServerConfig, finish: bool = False) -> Path:
    """Start a run, commit rounds 1-3 (and finish it), damage round 3's checkpoint."""
    strategy = apply_privacy(FedAvg(), config.privacy)
    persistence = RunPersistence.open(config, small_weights(), strategy)
    for r in (1, 2, 3):
        persistence.commit(RoundRecord(r), small_weights(), strategy.state_dict(), time.time())
    if finish:
        persistence.finish()
    store = RunStore(Path(config.state_dir) / "fedloom.db")
    latest = store.latest_round(store.runs()[-1].run_id)
    store.close()
    assert latest is not None and latest.round == 3
    path = Path(config.state_dir) / latest.checkpoint
    path.write_bytes(path.read_bytes()[:100])  # torn
    persistence.close()
    return path


@pytest.mark.parametrize("private", [False, True])
def test_a_private_run_refuses_to_resume_behind_its_lost_rounds(
        server_config: Callable[..., ServerConfig], private: bool) -> None:
    privacy = (PrivacyConfig(mode="central", noise_multiplier=1.0, clip_norm=1.0,
                             sampling="poisson") if private else PrivacyConfig())
    config = server_config(privacy=privacy, fraction_fit=0.5, min_fit_clients=1)
    _three_rounds(config)
    strategy = apply_privacy(FedAvg(), config.privacy)
    if not private:
        resumed = RunPersistence.open(config, small_weights(), strategy)
        assert resumed.completed_round == 2
        resumed.close()
        return
    with pytest.raises(ConfigError, match=r"newest checkpoints \(rounds 3\) are not usable"):
        RunPersistence.open(config, small_weights(), strategy)


def test_a_finished_private_run_still_opens_as_finished(
        server_config: Callable[..., ServerConfig]) -> None:
    """A finished run trains nothing, so nothing more is spent: it opens as it ended (and
    its clients are told so) even when its last checkpoint is unusable."""
    privacy = PrivacyConfig(mode="central", noise_multiplier=1.0, clip_norm=1.0,
                            sampling="poisson")
    config = server_config(privacy=privacy, fraction_fit=0.5, min_fit_clients=1)
    _three_rounds(config, finish=True)
    opened = RunPersistence.open(config, small_weights(), apply_privacy(FedAvg(), privacy))
    assert opened.finished and opened.completed_round == 2
    opened.close()
