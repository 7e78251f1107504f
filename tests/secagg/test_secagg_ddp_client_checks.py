"""A distributed-DP client's checks, played against a server that would cut its noise.

Threat model: the server is malicious. It may retry a round's attempt with a new setup
(fewer survivors to unmask), announce any Skellam parameters, and hopes a client whose
update came out non-finite drops out (its absence would then depend on its data). The
client must check the noise of every attempt before it sends its input, measure the
noise as the server's ledger accounts it, and take part with a zero update instead of
dropping out.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
from e2e_harness import RecordingClient
from helpers import small_weights

from fedloom.client_sdk import Client, FitOutput
from fedloom.client_sdk.secure_fit import SecureFit
from fedloom.messages import Session, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.privacy._distributed import (
    MIN_SURVIVORS_KEY,
    accounted_noise_multiplier,
    noise_multiplier_of,
    noisy_shares,
    to_fit_config,
)
from fedloom.privacy._skellam import calibrate
from fedloom.secagg import (
    AdvertiseKeysRequest,
    MaskedInputRequest,
    RoundId,
    RoundSetup,
    SecAggConfig,
    config_digest,
    model_digest,
)
from fedloom.types import TaskKind
from fedloom.weights import Weights

WEIGHTS = small_weights()
SIZE = sum(spec.size for spec in WEIGHTS.specs())
PARAMS = calibrate(1.0, SIZE, 10, 1.0, dropout_rate=0.2)  # 10 sampled, floor 8
CONFIG = {"server_round": 1, **to_fit_config(PARAMS, b"s" * 16), MIN_SURVIVORS_KEY: 8}
BASE = SecAggConfig(enabled=True, neighbours=4, threshold=3, max_weight=100.0,
                    max_participants=16, bits=24, allow_unauthenticated=True)
IDS = [f"c{i}" for i in range(10)]
SESSION = Session("c0", b"s" * 32)


def _task(request: Any) -> TaskHeader:
    payload = serialize(WEIGHTS)
    return TaskHeader("t" * 32, "run", 1, TaskKind.SECAGG, CONFIG, 30.0,
                      PayloadInfo.describe(WEIGHTS.specs(), payload), secagg=request)


def _setup(attempt: int, min_survivors: int) -> RoundSetup:
    sha = PayloadInfo.describe(WEIGHTS.specs(), serialize(WEIGHTS)).sha256
    return RoundSetup.create(dataclasses.replace(BASE, min_survivors=min_survivors),
                             RoundId("run", 1, attempt), IDS, PARAMS.padded_dimension,
                             model_digest=model_digest(WEIGHTS.specs(), sha),
                             config_digest=config_digest(CONFIG))


def _masked_input_failure(fit: SecureFit, attempt: int, min_survivors: int) -> str:
    """Start an attempt and ask for its masked input at once (the share-keys stage is
    skipped, so a client that gets past its own checks trains, then refuses the
    stage's order); the refusal."""
    setup = _setup(attempt, min_survivors)
    fit.execute(SESSION, _task(AdvertiseKeysRequest(setup)), WEIGHTS)
    result, _ = fit.execute(SESSION, _task(MaskedInputRequest(setup.round_id, (), ())), WEIGHTS)
    assert result.failure is not None
    return result.failure


def test_a_retried_attempt_that_would_unmask_fewer_survivors_is_refused() -> None:
    """Attempt 1 binds the noise's floor (8 survivors); the client trains and encodes,
    then the attempt fails. Attempt 2 of the same round would unmask a sum over 4: the
    client reuses its encoded update, but checks the new setup's floor first."""
    fit = SecureFit(RecordingClient(0, 10), "c0", min_noise_multiplier=0.5)
    first = _masked_input_failure(fit, 1, 8)
    assert "out of order" in first and len(fit.client.sent) == 1  # checked, trained
    second = _masked_input_failure(fit, 2, 4)
    assert "needs 8 survivors" in second and "sum of 4" in second
    assert len(fit.client.sent) == 1  # trained once: the retry did not get that far


def test_the_noise_floor_is_the_noise_the_ledger_accounts() -> None:
    """The client's minimum applies to what the server's ledger counts: the floor less
    the colluding clients and one, over Δ2 (not over gamma C)."""
    floor, colluding = 8, SecAggConfig().colluding_clients
    accounted = accounted_noise_multiplier(PARAMS, noisy_shares(floor, colluding))
    naive = noise_multiplier_of(PARAMS, floor)
    assert accounted < naive  # the shares left out, and Δ2 > gamma C
    expected = np.sqrt(2 * PARAMS.client_noise_mu * (floor - 1 - colluding)) / PARAMS.l2_bound
    assert accounted == pytest.approx(expected, rel=1e-12)
    setup = _setup(1, floor)
    between = (accounted + naive) / 2  # met by the naive figure, not by the accounted one
    with pytest.raises(Exception, match="requires at least"):
        SecureFit(RecordingClient(0, 10), "c0", min_noise_multiplier=between)._check_noise(
            PARAMS, setup, floor)
    SecureFit(RecordingClient(0, 10), "c0", min_noise_multiplier=accounted * 0.999
              )._check_noise(PARAMS, setup, floor)


def test_a_tiny_scale_cannot_pass_for_noise() -> None:
    """A server that announces a tiny gamma makes the rounding, not the clipped update, the
    bulk of Δ2: the naive gamma C figure would pass, the accounted one does not."""
    tiny = dataclasses.replace(PARAMS, scale=PARAMS.scale * 1e-6,
                               client_noise_mu=PARAMS.client_noise_mu * 1e-12)
    assert noise_multiplier_of(tiny, 8) == pytest.approx(noise_multiplier_of(PARAMS, 8))
    fit = SecureFit(RecordingClient(0, 10), "c0", min_noise_multiplier=0.5)
    with pytest.raises(Exception, match="requires at least"):
        fit._check_noise(tiny, _setup(1, 8), 8)


@pytest.mark.parametrize("noisy", [1, 0, -1, -4])
def test_no_honest_noise_share_accounts_as_no_noise(noisy: int) -> None:
    """`noisy_shares` is at most 0 when the announced floor leaves no survivor beyond the
    colluders and the one share left out: the accounted multiplier is then 0 (not an
    error, not a stand-in value), and a client with any minimum refuses the round. One
    share counts at its own noise."""
    expected = np.sqrt(2 * PARAMS.client_noise_mu * noisy) / PARAMS.l2_bound if noisy > 0 else 0.0
    assert accounted_noise_multiplier(PARAMS, noisy) == pytest.approx(expected, rel=1e-12)
    colluding = SecAggConfig().colluding_clients
    floor = noisy + 1 + colluding
    if floor >= 1 and noisy < 1:
        fit = SecureFit(RecordingClient(0, 10), "c0", min_noise_multiplier=1e-9)
        with pytest.raises(Exception, match="noise multiplier 0; this client requires"):
            fit._check_noise(PARAMS, _setup(1, 8), floor)


class _NonFinite(Client):
    """Training that ends in NaN (e.g. diverged on this client's data)."""

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        new = Weights({n: np.full_like(a, np.nan) for n, a in weights.items()})
        return FitOutput(new, 10)

    def evaluate(self, weights: Weights, config: Any) -> Any:
        raise NotImplementedError


def test_a_non_finite_update_takes_part_as_zero(caplog: pytest.LogCaptureFixture) -> None:
    """Dropping out on a NaN update would make the client's absence depend on its data;
    it takes part with a zero update (its noise still in the sum) and says so."""
    fit = SecureFit(_NonFinite(), "c0")
    setup = _setup(1, 8)
    fit.protocol.advertise_keys(AdvertiseKeysRequest(setup))
    with caplog.at_level(logging.WARNING, logger="fedloom"):
        vector, num_examples = fit._update(_task(MaskedInputRequest(setup.round_id, (), ())),
                                           setup, WEIGHTS)
    assert num_examples == 10 and vector.dtype == np.uint32
    assert vector.shape == (PARAMS.padded_dimension + 1,) and vector[-1] == 1
    assert any("non-finite" in r.getMessage() for r in caplog.records)
    # zero plus Skellam noise: centred on zero (modulo 2**32), with the noise's spread
    signed = vector[:-1].astype(np.int64)
    signed[signed >= 1 << 31] -= 1 << 32
    assert abs(signed.mean()) < 6 * np.sqrt(2 * PARAMS.client_noise_mu / signed.size)
    assert signed.std() == pytest.approx(np.sqrt(2 * PARAMS.client_noise_mu), rel=0.5)
