"""Client-level differential privacy: settings, the accountant and the mechanisms.

- `PrivacyConfig`: the ``[privacy]`` table (central or distributed mode, clipping,
  noise, sampling, accountant, budget);
- `PrivacyAccountant`: the run's ledger of released rounds on Google's
  ``dp-accounting`` (RDP or PLD), checkpointed with the strategy;
- `calibrate_noise_multiplier`: the noise for a target (ε, δ, rounds, sampling).

Part of the kernel: imports numpy and dp-accounting, nothing of the server, the client
SDK or the strategies. The central mechanism is the strategy wrapper
`fedloom.strategies.CentralDPStrategy`; docs/privacy.md states the guarantee.
"""

from fedloom.privacy._accountant import (
    PrivacyAccountant,
    RoundEvent,
    calibrate_noise_multiplier,
    dp_event,
)
from fedloom.privacy._config import PrivacyConfig

__all__ = [
    "PrivacyAccountant",
    "PrivacyConfig",
    "RoundEvent",
    "calibrate_noise_multiplier",
    "dp_event",
]
