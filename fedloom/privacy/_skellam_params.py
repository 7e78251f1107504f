"""The parameters of the distributed Skellam mechanism (`SkellamParams`) and its limits.

What every client and the server of a round must agree on, with the sensitivities
(Δ1, Δ2) they imply, and how the clients' noise adds up to the sum's. The mechanism,
its formulas and its references are in `fedloom.privacy._skellam`.
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.errors import ConfigError
from fedloom.privacy._hadamard import padded_length

#: The conditional-rounding β the papers recommend and use in their experiments
#: (Kairouz, Liu & Steinke 2021; Agarwal, Kairouz & Liu 2021): each rounding attempt
#: fails the norm check with probability at most β.
DEFAULT_BETA = math.exp(-0.5)

#: Attempts at conditional rounding before giving up: with β = e^-0.5 all of them fail
#: with probability at most e^-50.
MAX_ROUNDING_ATTEMPTS = 100

#: The largest Poisson rate a client may draw. numpy's sampler (PTRS, Hörmann 1993)
#: tests acceptance with ``k log(λ) - λ - log(k!)``, terms near ``λ log λ`` whose
#: float64 rounding grows with λ. Measured on 4M draws (numpy 2.4): from 1e13 a KS test
#: against the normal limit fails, at 1e14 the variance is 0.7% high, at 1e16 41%.
#: At 2**32 those terms are about 1e11 and round by about 1e-5, so the sampled law is
#: Poisson to that relative accuracy (and passes the same checks). The calibration
#: lowers gamma to respect it, at a negligible cost: the rounding's ``d'/4`` in Δ2²
#: stays tiny against ``(c gamma)² = 2**33 n (1 - p) / z²`` (1e-5 of it at d' = 2**20,
#: z = 2, 10 survivors).
MAX_CLIENT_NOISE_MU = float(2**32)

MAX_BITS = 32  # the secure-aggregation ring is Z_{2^32}


@dataclasses.dataclass(frozen=True)
class SkellamParams:
    """What every client and the server of a round must agree on.

    Attributes:
        clip_norm: c, the L2 norm each flattened float update is clipped to.
        dimension: d, the length of the flattened update.
        scale: gamma, the factor applied after rotation and before rounding.
        bits: the modulus is ``2**bits`` (at most 32: the values travel as uint32 and
            are summed in Z_{2^32}, a multiple of ``2**bits``).
        beta: β of conditional randomized rounding, in [0, 1); 0 means plain
            stochastic rounding (and the looser ``Δ2 = c gamma + sqrt(d')``).
        client_noise_mu: μ_client, the Skellam parameter each client adds per
            coordinate (variance ``2 μ_client``); 0 adds no noise.
    """

    clip_norm: float
    dimension: int
    scale: float
    bits: int = MAX_BITS
    beta: float = DEFAULT_BETA
    client_noise_mu: float = 0.0

    def __post_init__(self) -> None:
        require(self.clip_norm > 0 and math.isfinite(self.clip_norm), "clip_norm",
                 f"must be a positive number, got {self.clip_norm!r}")
        require(isinstance(self.dimension, int) and self.dimension >= 1, "dimension",
                 f"must be a positive integer, got {self.dimension!r}")
        require(self.scale > 0 and math.isfinite(self.scale), "scale",
                 f"must be a positive number, got {self.scale!r}")
        require(isinstance(self.bits, int) and 2 <= self.bits <= MAX_BITS, "bits",
                 f"must be an integer in [2, {MAX_BITS}], got {self.bits!r}")
        require(0.0 <= self.beta < 1.0, "beta", f"must be in [0, 1), got {self.beta!r}")
        require(0 <= self.client_noise_mu <= MAX_CLIENT_NOISE_MU, "client_noise_mu",
                 f"must be in [0, {MAX_CLIENT_NOISE_MU:.0f}] (numpy's Poisson sampler is "
                 f"inexact above), got {self.client_noise_mu!r}; lower the scale")

    @property
    def padded_dimension(self) -> int:
        """d', the dimension rotated, rounded and summed (a power of two >= d)."""
        return padded_length(self.dimension)

    @property
    def modulus(self) -> int:
        """``2**bits``."""
        return 1 << self.bits

    @property
    def l2_bound(self) -> float:
        """Δ2, the L2 norm bound of one client's integer vector (formula in
        `fedloom.privacy._skellam`'s docstring)."""
        scaled_clip, dim = self.clip_norm * self.scale, float(self.padded_dimension)
        plain = scaled_clip + math.sqrt(dim)
        if self.beta == 0.0:
            return plain
        squared = scaled_clip**2 + dim / 4.0 + math.sqrt(2.0 * math.log(1.0 / self.beta)) * (
            scaled_clip + math.sqrt(dim) / 2.0
        )
        return min(plain, math.sqrt(squared))

    @property
    def l1_bound(self) -> float:
        """Δ1 = min(Δ2², sqrt(d') Δ2), the L1 norm bound of one client's integer vector."""
        l2 = self.l2_bound
        return l2 * min(l2, math.sqrt(self.padded_dimension))


def require(condition: bool, setting: str, problem: str) -> None:
    if not condition:
        raise ConfigError(setting, problem)


def per_client_noise_mu(total_mu: float, expected_clients: int, dropout_rate: float) -> float:
    """μ_client such that the expected ``n (1 - p)`` survivors together add ``Sk(total_mu)``.

    Sums of independent ``Sk(μ_i)`` are ``Sk(Σ μ_i)``, so each client adds
    ``total_mu / (n (1 - p))``.
    """
    require(isinstance(expected_clients, int) and expected_clients >= 1, "expected_clients",
             f"must be a positive integer, got {expected_clients!r}")
    require(0.0 <= dropout_rate < 1.0, "dropout_rate", f"must be in [0, 1), got {dropout_rate!r}")
    require(total_mu >= 0 and math.isfinite(total_mu), "total_mu",
             f"must be a number >= 0, got {total_mu!r}")
    return total_mu / (expected_clients * (1.0 - dropout_rate))


def realised_noise_mu(client_noise_mu: float, noisy_clients: int) -> float:
    """μ_total of the sum when ``noisy_clients`` clients each added ``Sk(client_noise_mu)``."""
    if noisy_clients < 0:
        raise ValueError(f"the number of noisy clients must be >= 0, got {noisy_clients}")
    return client_noise_mu * noisy_clients
