"""`PrivacyConfig`: the ``[privacy]`` settings, validated with their reasons.

.. code-block:: toml

    [privacy]
    mode = "central"          # "off" | "central" | "distributed"
    noise_multiplier = 1.0    # z: noise std / clip norm on the sum of clipped updates
    clip_norm = 1.0           # C: each client's delta is clipped to this L2 norm
    clipping = "fixed"        # "fixed" | "adaptive" (C tracks a quantile of the norms)
    delta = 1e-5              # the delta epsilon is reported at
    target_epsilon = 8.0      # stop before a round would take epsilon past this (0: none)
    sampling = "fixed"        # "fixed" (m of n) | "poisson" | "none" (no amplification)
    accountant = "rdp"        # "rdp" | "pld"

The guarantee is client-level (ε, δ)-DP (McMahan et al., ICLR 2018): two federations
differ in one client's whole dataset. Each round releases the sum of the sampled
clients' clipped deltas plus Gaussian noise of standard deviation ``z * C``, divided by
a number that does not depend on the data (the number sampled), so the unweighted mean
of clipped updates is what every round publishes; the strategy's server optimizer then
post-processes it (FedAvgM, FedAdam, ... keep the guarantee).

Why each rule:

- ``noise_multiplier`` > 0 is the noise; calibrate it with
  `fedloom.privacy.calibrate_noise_multiplier` (``fedloom privacy calibrate``) for a
  target ε, δ, number of rounds and sampling rate.
- ``clipping = "adaptive"`` (Andrew et al., NeurIPS 2021) estimates the
  ``target_quantile`` of the update norms from noisy clipped counts (noise std
  ``count_noise_std``, the paper's default is the expected clients per round / 20) and
  moves C geometrically with ``clip_learning_rate``. The count is a second release; the
  paper splits z so the pair costs exactly what one release of multiplier z does:
  ``z_delta = (z**-2 - (2 * count_noise_std)**-2) ** -0.5``, which needs
  ``2 * count_noise_std > z``.
- ``sampling`` says what the accountant may assume about who takes part. ``"fixed"``:
  the server samples m of the n connected clients uniformly without replacement (what
  fedloom's sampler does), accounted under the replace-one relation, where the sum's
  sensitivity is 2C (Wang, Balle, Kasiviswanathan, AISTATS 2019). ``"poisson"``: each
  connected client takes part with probability ``fraction_fit``, independently
  (add-or-remove relation, sensitivity C). ``"none"``: no amplification by sampling (as
  if every client took part every round; the assumption of Flower's accountant).
  Over-selection makes the set of aggregated clients depend on who answers first and
  is refused.
- ``accountant``: ``"rdp"`` (Rényi DP, Mironov 2017; every sampling mode) or ``"pld"``
  (privacy loss distributions, tighter; ``"poisson"`` and ``"none"`` only: dp-accounting
  has no PLD for sampling without replacement). Both come from Google's ``dp-accounting``.
- ``mode = "distributed"`` runs inside secure aggregation: each client adds its share of
  discrete (Skellam) noise to its quantized update before masking, so the server never
  sees an un-noised sum; it needs ``[secure_aggregation] enabled`` (checked where both
  are known, `fedloom.config.ServerConfig`). ``expected_dropout`` is the share of
  sampled clients expected to vanish before their masked input: each client adds
  enough noise that the survivors alone carry the round's noise.
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.errors import ConfigError
from fedloom.settings import described

SECTION = "privacy"
MODES = ("off", "central", "distributed")
CLIPPINGS = ("fixed", "adaptive")
SAMPLINGS = ("fixed", "poisson", "none")
ACCOUNTANTS = ("rdp", "pld")


def _fail(setting: str, problem: str) -> ConfigError:
    return ConfigError(f"{SECTION}.{setting}", problem)


def _choice(setting: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _fail(setting, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _positive(setting: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise _fail(setting, f"must be a positive number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PrivacyConfig:
    """Differential-privacy settings (client-level, with a dp-accounting accountant).

    Attributes:
        mode: ``"off"``, ``"central"`` (the server adds Gaussian noise) or
            ``"distributed"`` (clients add Skellam noise under secure aggregation).
        noise_multiplier: z, the noise standard deviation over the clip norm, > 0.
        clip_norm: C, the L2 bound on each client's delta (the initial C when adaptive).
        clipping: ``"fixed"`` or ``"adaptive"`` (Andrew et al., NeurIPS 2021).
        target_quantile: adaptive: the share of updates C should leave unclipped.
        clip_learning_rate: adaptive: C is multiplied by ``exp(-rate * (b - quantile))``
            each round, b the noisy share of unclipped updates.
        count_noise_std: adaptive: std of the noise on the clipped count (0: the expected
            number of clients per round / 20, the paper's choice).
        delta: δ of the reported (ε, δ); below 1 / (number of clients) to mean anything.
        target_epsilon: the run stops before a round would take ε past this (0: never).
        sampling: ``"fixed"``, ``"poisson"`` or ``"none"``; see the module docstring.
        accountant: ``"rdp"`` or ``"pld"``.
        expected_dropout: distributed: the share of sampled clients expected to drop out
            before their masked input, in [0, 1).
    """

    mode: str = described(
        "off",
        '"off", "central" (the server adds the noise) or "distributed" (the clients '
        "do, under secure aggregation)")
    noise_multiplier: float = described(
        1.0,
        "z: noise std / clip norm (choose it with fedloom privacy calibrate)")
    clip_norm: float = described(
        1.0,
        "C: each client's delta is clipped to this L2 norm (initial C if adaptive)")
    clipping: str = described(
        "fixed",
        '"fixed" or "adaptive" (C follows target_quantile of the update norms)')
    target_quantile: float = described(
        0.5,
        "adaptive: the share of updates C should leave unclipped")
    clip_learning_rate: float = described(
        0.2,
        "adaptive: C *= exp(-rate * (unclipped share - quantile))")
    count_noise_std: float = described(
        0.0,
        "adaptive: noise std of the clipped count (0: clients per round / 20)")
    delta: float = described(1e-5, "the delta at which epsilon is reported")
    target_epsilon: float = described(
        0.0,
        "stop before a round would take epsilon past this (0: no budget)")
    sampling: str = described(
        "fixed",
        '"fixed" (m of n), "poisson" or "none" (no amplification by sampling)')
    accountant: str = described("rdp", '"rdp" or "pld" (pld: poisson or none sampling)')
    expected_dropout: float = described(
        0.0,
        "distributed: share of sampled clients expected to drop out")

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _choice("clipping", self.clipping, CLIPPINGS)
        _choice("sampling", self.sampling, SAMPLINGS)
        _choice("accountant", self.accountant, ACCOUNTANTS)
        _positive("noise_multiplier", self.noise_multiplier)
        _positive("clip_norm", self.clip_norm)
        _positive("clip_learning_rate", self.clip_learning_rate)
        if not 0.0 < self.target_quantile < 1.0:
            raise _fail("target_quantile", f"must be in (0, 1), got {self.target_quantile}")
        if not (math.isfinite(self.count_noise_std) and self.count_noise_std >= 0):
            raise _fail("count_noise_std", "must be >= 0 (0: expected clients per round / 20)")
        if not 0.0 < self.delta < 1.0:
            raise _fail("delta", f"must be in (0, 1), got {self.delta}")
        if not (math.isfinite(self.target_epsilon) and self.target_epsilon >= 0):
            raise _fail("target_epsilon", "must be >= 0 (0: no budget; epsilon is reported)")
        if not 0.0 <= self.expected_dropout < 1.0:
            raise _fail("expected_dropout", f"must be in [0, 1), got {self.expected_dropout}")
        if (self.clipping == "adaptive" and self.count_noise_std
                and 2.0 * self.count_noise_std <= self.noise_multiplier):
            raise _fail(
                "count_noise_std",
                f"adaptive clipping splits the noise between the sum and the clipped count, "
                f"which needs 2 * count_noise_std ({2 * self.count_noise_std:g}) above "
                f"noise_multiplier ({self.noise_multiplier:g})",
            )
        if self.accountant == "pld" and self.sampling == "fixed":
            raise _fail(
                "accountant",
                "dp-accounting has no PLD for sampling without replacement: use accountant "
                '= "rdp" with sampling = "fixed", or sampling = "poisson" with "pld"',
            )
        if self.mode == "distributed" and self.clipping == "adaptive":
            raise _fail(
                "clipping",
                '"adaptive" needs each client\'s clipped bit, which secure aggregation '
                'hides; use clipping = "fixed" in distributed mode',
            )
        if self.mode == "distributed" and self.sampling != "none":
            raise _fail(
                "sampling",
                "distributed mode is accounted without amplification by sampling (the "
                "Skellam mechanism has no subsampled bound in dp-accounting): set "
                'sampling = "none"',
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def count_noise_for(self, expected_clients: float) -> float:
        """The clipped count's noise std: the setting, or expected clients / 20."""
        return self.count_noise_std or max(expected_clients, 1.0) / 20.0

    def check_server(self, *, secure: bool, over_selection: float, min_fit_clients: int = 1,
                     round_retries: int = 0) -> None:
        """Refuse what a server cannot run with these settings (raises `ConfigError`)."""
        if not self.enabled:
            return
        if over_selection != 1.0:
            raise ConfigError(
                "over_selection",
                "must be 1 with [privacy]: with over-selection the aggregated clients are "
                "the first to answer, which the accountant cannot account for",
            )
        if self.mode == "central":
            # Rounds not released (too few updates) or drawn again (a retry) make the
            # released ones likelier to hold a given (reliable) client than the sample
            # the accountant counts: a retry is refused for any sampling, and a round
            # held back under Poisson sampling too.
            if round_retries > 0:
                raise ConfigError(
                    "round_retries",
                    "must be 0 with [privacy]: a failed round drawn again until one "
                    "succeeds skews who is in the released rounds (toward the clients that "
                    "answer), which the accountant does not count")
            if self.sampling == "poisson" and min_fit_clients > 1:
                raise ConfigError(
                    "min_fit_clients",
                    f"is {min_fit_clients}, but with [privacy] sampling = \"poisson\" every "
                    "round must be released whatever its size (a round held back for too "
                    "few updates skews who is in the released ones): set it to 1, or use "
                    'sampling = "fixed"')
        if self.mode == "distributed" and not secure:
            raise _fail(
                "mode",
                '"distributed" adds the noise inside secure aggregation: set '
                '[secure_aggregation] enabled = true, or use mode = "central"',
            )
        if self.mode == "central" and secure:
            raise _fail(
                "mode",
                '"central" needs the server to see each clipped update, which secure '
                'aggregation hides: use mode = "distributed" with secure aggregation',
            )
