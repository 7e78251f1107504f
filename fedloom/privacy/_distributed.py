"""Distributed DP inside secure aggregation: the round's Skellam parameters on the wire,
the client's encoding, the server's decoding and the RDP ledger.

The server announces a round's `SkellamParams` in the fit config (`to_fit_config`). The
config is bound by the secure round's setup (its ``config_digest``), so every
participant encodes with the same parameters, or the round fails. A client with
those keys in its fit config encodes its delta with `encode_for_secagg`: clip to C,
randomized Hadamard rotation (signs from the announced seed), scaling, conditional
stochastic rounding, its share of Skellam noise, and a last element 1 (it counts the
contributors); SecAgg+ masks that uint32 vector as it is. The server unmasks the sum
(modulo 2**32) and `decode_secagg_total` turns it back into the noised sum of clipped
deltas and the number of contributors.

Accounting (`SkellamLedger`): each round adds the Theorem-3.5 RDP bound of Agarwal,
Kairouz and Liu (NeurIPS 2021) at the noise actually in the sum. The neighbouring
relation is zero-out: two runs differ in one client's data, replaced by data whose
update is zero (the client still takes part). Secure aggregation shows the server who
took part, so participation itself is not what is hidden; the content of each update
is. Of the ``s`` survivors whose input was summed, the ledger counts ``s - 1 - c`` noise
shares: ``c`` clients colluding with the server know (and can subtract) theirs, and the
one share more left out is slack (under zero-out every survivor's noise stays in the
sum). Every survivor's Δ1 and Δ2 bound ``enc(x) - enc(0)``, since zero encodes to
zero. No amplification by sampling is claimed (dp-accounting has no subsampled-Skellam
bound); dp-accounting converts the composed RDP to ε.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedloom.errors import ConfigError, SecureAggregationError
from fedloom.fit_config import (
    DDP_BITS,
    DDP_CLIENT_MU,
    DDP_CLIP_NORM,
    DDP_MIN_SURVIVORS,
    DDP_ROTATION_SEED,
    DDP_SCALE,
)
from fedloom.privacy._hadamard import rotation_signs
from fedloom.privacy._skellam import (
    DEFAULT_ORDERS,
    SkellamParams,
    decode_sum,
    encode,
    round_rdp,
    skellam_epsilon,
)
from fedloom.secagg._config import SecAggConfig

#: Fit-config keys of a distributed-DP round (all five, or none), defined in
#: `fedloom.fit_config`; the short names are this package's.
CLIP_KEY = DDP_CLIP_NORM
SCALE_KEY = DDP_SCALE
MU_KEY = DDP_CLIENT_MU
BITS_KEY = DDP_BITS
SEED_KEY = DDP_ROTATION_SEED
DDP_KEYS = (CLIP_KEY, SCALE_KEY, MU_KEY, BITS_KEY, SEED_KEY)
#: Fit-config key: the least survivors whose sum may be unmasked (the round's survivor
#: floor; the secure round raises ``min_survivors`` to it, and clients enforce it).
MIN_SURVIVORS_KEY = DDP_MIN_SURVIVORS


def to_fit_config(params: SkellamParams, rotation_seed: bytes) -> dict[str, Any]:
    """The fit-config entries that announce a round's parameters to its clients."""
    return {CLIP_KEY: params.clip_norm, SCALE_KEY: params.scale,
            MU_KEY: params.client_noise_mu, BITS_KEY: params.bits,
            SEED_KEY: rotation_seed.hex()}


def from_fit_config(config: Mapping[str, Any], dimension: int
                    ) -> tuple[SkellamParams, bytes] | None:
    """The announced parameters and rotation seed, or None in a round without them.

    Raises `SecureAggregationError` for a partial or malformed announcement (a client
    refuses the round rather than guess).
    """
    present = [key for key in DDP_KEYS if key in config]
    if not present:
        return None
    if len(present) != len(DDP_KEYS):
        raise SecureAggregationError(
            f"a distributed-DP round announces all of {', '.join(DDP_KEYS)}; got only "
            f"{', '.join(present)}")
    try:
        seed = bytes.fromhex(str(config[SEED_KEY]))
        numbers = [config[key] for key in (CLIP_KEY, SCALE_KEY, MU_KEY)]
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in numbers):
            raise ValueError("clip norm, scale and noise must be numbers")
        bits = config[BITS_KEY]
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise ValueError("bits must be an integer")
        params = SkellamParams(clip_norm=float(numbers[0]), dimension=dimension,
                               scale=float(numbers[1]), bits=bits,
                               client_noise_mu=float(numbers[2]))
    except (ValueError, ConfigError) as exc:
        raise SecureAggregationError(f"the round's distributed-DP parameters: {exc}") from exc
    if len(seed) < 16:
        raise SecureAggregationError("the round's rotation seed must be at least 16 bytes")
    return params, seed


def encode_for_secagg(update: np.ndarray, params: SkellamParams, seed: bytes,
                      rng: np.random.Generator | None = None,
                      noise: np.ndarray | None = None) -> np.ndarray:
    """A client's masked-input vector: the Skellam encoding of ``update``, then a 1.

    ``update`` is the flat delta (length ``params.dimension``); the result is uint32 of
    length ``d' + 1``. The noise comes from a CSPRNG-seeded generator unless ``rng``
    is given (tests); ``noise`` is drawn ahead by a `NoiseReserve`, or here.
    """
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    signs = rotation_signs(seed, params.padded_dimension)
    out = np.empty(params.padded_dimension + 1, np.uint32)
    encode(update, params, signs, rng, noise, out=out[:-1])
    out[-1] = 1
    return out


def decode_secagg_total(total: np.ndarray, params: SkellamParams, seed: bytes
                        ) -> tuple[np.ndarray, int]:
    """(the noised sum of the clipped deltas, float64 of d; the number of contributors)."""
    values = np.asarray(total)
    if values.shape != (params.padded_dimension + 1,):
        raise SecureAggregationError(
            f"a distributed-DP sum has {params.padded_dimension + 1} values, got {values.shape}")
    signs = rotation_signs(seed, params.padded_dimension)
    return decode_sum(values[:-1], params, signs), int(values[-1])


def noise_multiplier_of(params: SkellamParams, survivors: int) -> float:
    """The noise multiplier z (std over C, in the update domain) of ``survivors`` clients'
    noise: ``sqrt(2 mu_client survivors) / (gamma C)``."""
    return math.sqrt(2.0 * params.client_noise_mu * survivors) / (params.scale * params.clip_norm)


def accounted_noise_multiplier(params: SkellamParams, noisy: int) -> float:
    """The noise multiplier the ledger accounts for a sum with ``noisy`` clients' noise
    (`noisy_shares`): ``sqrt(2 mu_client noisy) / Δ2``, the noise's standard deviation
    over the L2 bound of one client's encoded update (the Gaussian multiplier whose ε
    the Skellam bound tracks). Below `noise_multiplier_of` of the same survivors: it
    leaves out the shares the ledger does not count and uses Δ2, which the rounding
    makes a little larger than gamma C."""
    if noisy < 1:
        return 0.0
    return math.sqrt(2.0 * params.client_noise_mu * noisy) / params.l2_bound


def noisy_shares(survivors: int, colluding: int) -> int:
    """Noise shares the ledger counts in a sum over ``survivors`` (module docstring)."""
    return survivors - 1 - colluding


class SkellamLedger:
    """The run's composed RDP of distributed-DP rounds, and its ε at ``delta``."""

    def __init__(self, delta: float) -> None:
        self.delta = delta
        self.orders = tuple(DEFAULT_ORDERS)
        self._rdp = np.zeros(len(self.orders))
        self.num_rounds = 0

    def round_rdp(self, params: SkellamParams, noisy: int) -> np.ndarray:
        """One round's RDP with ``noisy`` clients' noise (infinite when none)."""
        if noisy < 1:
            return np.full(len(self.orders), np.inf)
        return round_rdp(params, noisy, self.orders)

    def epsilon(self) -> float:
        if self.num_rounds == 0:
            return 0.0
        return skellam_epsilon(self.orders, self._rdp, self.delta)[0]

    def epsilon_if(self, params: SkellamParams, noisy: int) -> float:
        """ε were a round with ``noisy`` noise shares released next (no change)."""
        rdp = self._rdp + self.round_rdp(params, noisy)
        if not np.isfinite(rdp).any():
            return math.inf
        return skellam_epsilon(self.orders, rdp, self.delta)[0]

    def record(self, params: SkellamParams, noisy: int) -> float:
        self._rdp = self._rdp + self.round_rdp(params, noisy)
        self.num_rounds += 1
        return self.epsilon()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "skellam-rdp", "orders": list(self.orders),
                "rdp": [float(v) for v in self._rdp], "rounds": self.num_rounds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "skellam-rdp":
            raise ConfigError("privacy", f"the run's privacy ledger is {state.get('kind')!r}, "
                              "not the distributed mode's; resume with the run's settings")
        orders = tuple(int(o) for o in np.asarray(state["orders"]).reshape(-1))
        rdp = np.asarray(state["rdp"], np.float64).reshape(-1)
        if orders != self.orders or rdp.shape != (len(orders),) or np.any(rdp < 0):
            raise ValueError("a Skellam ledger must hold one non-negative RDP value per order")
        rounds = int(np.asarray(state["rounds"]).reshape(-1)[0])
        if rounds < 0:
            raise ValueError(f"a Skellam ledger's round count must be >= 0, got {rounds}")
        self._rdp, self.num_rounds = rdp, rounds


def announces_distributed_dp(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` announces a distributed-DP round (any of its keys)."""
    return any(key in config for key in DDP_KEYS)


def masked_length(config: Mapping[str, Any], size: int) -> int:
    """The float-vector length a secure round announces (``RoundSetup.vector_length``):
    the model's ``size``, or its padded length in a distributed-DP round."""
    announced = from_fit_config(config, size)
    return size if announced is None else announced[0].padded_dimension


def survivor_floor(config: Mapping[str, Any]) -> int:
    """The round's survivor floor announced in ``config`` (0 when none)."""
    floor = config.get(MIN_SURVIVORS_KEY, 0)
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
        raise SecureAggregationError(f"{MIN_SURVIVORS_KEY} must be an integer >= 0, got "
                                     f"{floor!r}")
    return floor


def round_secagg(secagg: SecAggConfig, fit_config: Mapping[str, Any]) -> SecAggConfig:
    """One round's secure-aggregation settings: the run's, with the survivor floor raised
    to what the round's distributed-DP noise needs (`survivor_floor`)."""
    floor = survivor_floor(fit_config)
    if floor <= secagg.survivor_floor:
        return secagg
    return dataclasses.replace(secagg, min_survivors=floor)
