"""`PrivacyAccountant` and `calibrate_noise_multiplier` against dp-accounting and Flower.

Every expected ε is computed here, independently of fedloom: either with dp-accounting
on events written from the mechanism (the sum of clipped updates plus Gaussian noise of
std ``z * C``), with Flower 1.42's own RDP accountant, or, for a plain Gaussian, from
the closed-form Rényi divergence (Mironov 2017) and dp-accounting's RDP-to-(ε, δ)
conversion (Canonne, Kamath, Steinke 2020, Prop. 12 of arXiv:2004.00010 v4).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from fedloom.errors import ConfigError
from fedloom.privacy import PrivacyAccountant, RoundEvent, calibrate_noise_multiplier, dp_event

DELTA = 1e-5
Relation = dp_accounting.NeighboringRelation

# dp-accounting warns (absl) for every RDP order it skips in sampled-Gaussian sums.
logging.getLogger("absl").setLevel(logging.ERROR)


def reference_event(event: RoundEvent, sampling: str) -> Any:
    """The round as a dp-accounting event, written from the mechanism.

    - ``"fixed"``: m of n uniformly without replacement, replace-one neighbours. Replacing
      one client's clipped delta u (norm <= C) by v moves the sum by u - v, of norm up to
      2C; noise std z C over sensitivity 2C is a Gaussian of multiplier z / 2.
    - ``"poisson"``: each client with probability q, add-or-remove (sensitivity C): z.
    - ``"none"``: a plain Gaussian of the event's multiplier (no amplification; the
      strategy halves z when a round's sample could be displaced, see
      `test_none_halves_z_when_an_added_client_could_displace_one`).
    """
    z = event.noise_multiplier
    if sampling == "fixed":
        gaussian = dp_accounting.GaussianDpEvent(z / 2)
        if event.sampled == event.population:
            return gaussian  # everyone takes part: nothing to amplify
        return dp_accounting.SampledWithoutReplacementDpEvent(
            event.population, event.sampled, gaussian)
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(event.rate, dp_accounting.GaussianDpEvent(z))
    assert sampling == "none"
    return dp_accounting.GaussianDpEvent(z)


def reference_backend(kind: str, sampling: str) -> Any:
    relation = Relation.REPLACE_ONE if sampling == "fixed" else Relation.ADD_OR_REMOVE_ONE
    if kind == "rdp":
        return rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    return pld_privacy_accountant.PLDAccountant(neighboring_relation=relation)


def reference_epsilon(events: Sequence[RoundEvent], sampling: str, kind: str = "rdp") -> float:
    backend = reference_backend(kind, sampling)
    for event in events:
        backend.compose(reference_event(event, sampling))
    return float(backend.get_epsilon(DELTA))


# Heterogeneous rounds: the population and the cohort change, and some rounds repeat
# (the ledger run-length encodes them).
FIXED_ROUNDS = [RoundEvent(1.1, 10, 100), RoundEvent(1.1, 10, 100), RoundEvent(0.9, 12, 80),
                RoundEvent(1.1, 10, 100)]
POISSON_ROUNDS = [RoundEvent(3.0, 0, 100, 0.1), RoundEvent(3.0, 0, 100, 0.1),
                  RoundEvent(3.0, 0, 80, 0.15), RoundEvent(2.5, 0, 80, 0.15)]
NONE_ROUNDS = [RoundEvent(3.0, 10, 100), RoundEvent(3.0, 10, 100), RoundEvent(4.0, 12, 80),
               RoundEvent(3.0, 10, 100), RoundEvent(3.0, 60, 60)]
ROUNDS = {"fixed": FIXED_ROUNDS, "poisson": POISSON_ROUNDS, "none": NONE_ROUNDS}


@pytest.mark.parametrize(("kind", "sampling"), [
    ("rdp", "fixed"), ("rdp", "poisson"), ("rdp", "none"), ("pld", "poisson"), ("pld", "none")])
def test_epsilon_equals_dp_accounting_on_the_same_events(kind: str, sampling: str) -> None:
    accountant = PrivacyAccountant(kind, sampling, DELTA)
    assert accountant.epsilon() == 0.0 and accountant.num_rounds == 0
    reference = reference_backend(kind, sampling)
    for i, event in enumerate(ROUNDS[sampling], start=1):
        assert dp_event(event, sampling) == reference_event(event, sampling)
        returned = accountant.record(event)
        reference.compose(reference_event(event, sampling))
        expected = float(reference.get_epsilon(DELTA))
        assert returned == pytest.approx(expected, rel=1e-9)
        assert accountant.epsilon() == pytest.approx(expected, rel=1e-9)
        assert accountant.num_rounds == i


def test_full_participation_is_a_plain_gaussian_on_sensitivity_two_c() -> None:
    """m == n: no amplification, and the replace-one sensitivity 2C halves z."""
    z, n, rounds = 2.0, 7, 10
    accountant = PrivacyAccountant("rdp", "fixed", DELTA)
    for _ in range(rounds):
        accountant.record(RoundEvent(z, n, n))
    expected = reference_epsilon([RoundEvent(z, n, n)] * rounds, "fixed")
    assert accountant.epsilon() == pytest.approx(expected, rel=1e-9)
    # The same as no amplification at multiplier z / 2, and more than at z.
    halved = PrivacyAccountant("rdp", "none", DELTA)
    plain = PrivacyAccountant("rdp", "none", DELTA)
    for _ in range(rounds):
        halved.record(RoundEvent(z / 2, n, n))
        plain.record(RoundEvent(z, n, n))
    assert accountant.epsilon() == pytest.approx(halved.epsilon(), rel=1e-9)
    assert accountant.epsilon() > 2 * plain.epsilon()


def _closed_form_gaussian_epsilon(sensitivity: float, std: float, rounds: int) -> float:
    """ε(δ) of ``rounds`` Gaussian releases from their Rényi divergence.

    RDP of order a of one Gaussian release: a * sensitivity**2 / (2 * std**2) (Mironov
    2017, Prop. 7); composition adds it up. Converted at each of dp-accounting's default
    orders with eps = r + log1p(-1/a) - log(delta * a) / (a - 1) and minimised.
    """
    best = math.inf
    for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS:
        if a <= 1.01:
            continue
        r = rounds * a * sensitivity**2 / (2 * std**2)
        best = min(best, r + math.log1p(-1 / a) - math.log(DELTA * a) / (a - 1))
    return best


@pytest.mark.parametrize("z", [1.0, 2.5])
def test_the_halved_multiplier_is_the_replace_one_sensitivity(z: float) -> None:
    clip, rng = 1.0, np.random.default_rng(3)
    others = [rng.normal(size=6) for _ in range(4)]
    others = [u * min(1.0, clip / float(np.linalg.norm(u))) for u in others]
    u = rng.normal(size=6)
    u *= clip / np.linalg.norm(u)
    # Replace one: u by -u (both within C) moves the clipped sum by exactly 2C ...
    moved = np.linalg.norm((sum(others) + u) - (sum(others) - u))
    assert moved == pytest.approx(2 * clip)
    # ... while adding or removing one client moves it by at most C.
    assert np.linalg.norm((sum(others) + u) - sum(others)) == pytest.approx(clip)

    rounds, n = 10, 5
    full = PrivacyAccountant("rdp", "fixed", DELTA)
    none = PrivacyAccountant("rdp", "none", DELTA)
    for _ in range(rounds):
        full.record(RoundEvent(z, n, n))
        none.record(RoundEvent(z, n, n))
    # noise std z C on the sum in both; sensitivity 2C (replace one) and C (add/remove)
    assert full.epsilon() == pytest.approx(
        _closed_form_gaussian_epsilon(2 * clip, z * clip, rounds), rel=1e-9)
    assert none.epsilon() == pytest.approx(
        _closed_form_gaussian_epsilon(clip, z * clip, rounds), rel=1e-9)


# -- Flower 1.42's accountant as an oracle -------------------------------------------------


def _flower_epsilon(method: str, z: float, sample_size: int, population: int,
                    rounds: int) -> float:
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting import PrivacyConfig as FlowerPrivacyConfig
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    config = FlowerPrivacyConfig(
        target_delta=DELTA, population_size=population,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod(method))
    accountant = RdpAccountant(config)
    accountant.compose(GaussianPrivacyEvent(z, sample_size, population), rounds)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("rounds", [1, 10, 100])
@pytest.mark.parametrize("z", [0.7, 1.5, 4.0])
def test_no_amplification_equals_flowers_accountant(z: float, rounds: int) -> None:
    """Flower's fixed-clipping DP accounts each round as a plain Gaussian of multiplier z
    (uniform weights, no amplification, add-or-remove): fedloom's ``sampling = "none"``
    event. (Its strategy records z / 2 when an added client could displace a
    participant, which Flower's does not: see the strategy's test.)"""
    n, m = 50, 10
    accountant = PrivacyAccountant("rdp", "none", DELTA)
    for _ in range(rounds):
        accountant.record(RoundEvent(z, m, n))
    expected = _flower_epsilon("no-amplification", z, m, n, rounds)
    assert accountant.epsilon() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("rounds", [1, 4])
@pytest.mark.parametrize("z", [1.0, 3.0])
def test_poisson_equals_flowers_poisson_accountant(z: float, rounds: int) -> None:
    """Flower's Poisson mode: rate sample_size / population_size, add-or-remove."""
    n, m = 50, 10
    accountant = PrivacyAccountant("rdp", "poisson", DELTA)
    for _ in range(rounds):
        accountant.record(RoundEvent(z, 0, n, m / n))
    expected = _flower_epsilon("poisson", z, m, n, rounds)
    assert accountant.epsilon() == pytest.approx(expected, rel=1e-9)


# -- projection and the ledger ---------------------------------------------------------------


def _filled(kind: str, sampling: str) -> PrivacyAccountant:
    accountant = PrivacyAccountant(kind, sampling, DELTA)
    for event in ROUNDS[sampling][:3]:
        accountant.record(event)
    return accountant


@pytest.mark.parametrize(("kind", "sampling"), [("rdp", "none"), ("pld", "none")])
def test_epsilon_if_does_not_change_the_ledger(kind: str, sampling: str) -> None:
    accountant = _filled(kind, sampling)
    before, state = accountant.epsilon(), json.dumps(accountant.state_dict())
    nxt = ROUNDS[sampling][3]
    projected = accountant.epsilon_if(nxt)
    assert projected == pytest.approx(
        reference_epsilon(ROUNDS[sampling][:4], sampling, kind), rel=1e-9)
    assert projected > before
    assert accountant.epsilon() == before and accountant.num_rounds == 3
    assert json.dumps(accountant.state_dict()) == state
    # Projecting again, or another event, still changes nothing; the other event's
    # projection is its own (not the one kept from the previous call).
    assert accountant.epsilon_if(nxt) == projected
    other = ROUNDS[sampling][2]
    assert other != nxt
    assert accountant.epsilon_if(other) == pytest.approx(
        reference_epsilon([*ROUNDS[sampling][:3], other], sampling, kind), rel=1e-9)
    assert accountant.epsilon() == before and json.dumps(accountant.state_dict()) == state


@pytest.mark.parametrize(("kind", "sampling"), [("rdp", "none"), ("pld", "none")])
def test_record_after_projection_equals_record_alone(kind: str, sampling: str) -> None:
    events = ROUNDS[sampling]
    projected, plain = _filled(kind, sampling), _filled(kind, sampling)
    # Project the event that is then recorded ...
    forecast = projected.epsilon_if(events[3])
    assert projected.record(events[3]) == plain.record(events[3]) == forecast
    # ... and project one event but record another.
    projected.epsilon_if(events[0])
    assert projected.record(events[1]) == pytest.approx(plain.record(events[1]), rel=1e-12)
    assert projected.state_dict() == plain.state_dict()
    assert projected.epsilon() == pytest.approx(
        reference_epsilon([*events[:4], events[1]], sampling, kind), rel=1e-9)


@pytest.mark.parametrize(("kind", "sampling"), [
    ("rdp", "fixed"), ("rdp", "poisson"), ("rdp", "none"), ("pld", "poisson"), ("pld", "none")])
def test_state_dict_round_trip_continues_the_same_ledger(kind: str, sampling: str) -> None:
    events = ROUNDS[sampling][:3]  # the first two repeat: run-length encoded
    original = PrivacyAccountant(kind, sampling, DELTA)
    for event in events:
        original.record(event)
    state = json.loads(json.dumps(original.state_dict()))
    restored = PrivacyAccountant(kind, sampling, DELTA)
    restored.load_state_dict(state)
    assert restored.num_rounds == len(events)
    assert restored.state_dict() == original.state_dict()
    # Repeated rounds are composed with a count on reload; PLD discretises a composed
    # Gaussian slightly differently from the same Gaussian composed one by one.
    tolerance = 1e-9 if kind == "rdp" else 1e-3
    assert restored.epsilon() == pytest.approx(original.epsilon(), rel=tolerance)
    # Both go on identically.
    assert restored.record(events[0]) == pytest.approx(original.record(events[0]),
                                                       rel=tolerance)


@pytest.mark.parametrize(("written", "loaded"), [
    (("rdp", "fixed"), ("rdp", "poisson")),
    (("rdp", "poisson"), ("pld", "poisson")),
    (("pld", "none"), ("rdp", "none")),
    (("rdp", "none"), ("rdp", "fixed")),
])
def test_a_ledger_of_other_terms_is_refused(written: tuple[str, str],
                                            loaded: tuple[str, str]) -> None:
    source = PrivacyAccountant(*written, DELTA)
    source.record(ROUNDS[written[1]][0])
    target = PrivacyAccountant(*loaded, DELTA)
    with pytest.raises(ConfigError) as info:
        target.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert info.value.setting == "privacy"
    assert target.num_rounds == 0 and target.epsilon() == 0.0


GOOD_EVENT = [1.0, 5, 10, 0.0]


@pytest.mark.parametrize("events", [
    pytest.param({"not": "a list"}, id="events-not-a-list"),
    pytest.param(None, id="events-null"),
    pytest.param([GOOD_EVENT], id="entry-not-a-pair"),
    pytest.param([[GOOD_EVENT, 1, 2]], id="entry-of-three"),
    pytest.param([[GOOD_EVENT, 0]], id="count-zero"),
    pytest.param([[GOOD_EVENT, -3]], id="count-negative"),
    pytest.param([[GOOD_EVENT, "x"]], id="count-string"),
    pytest.param([[GOOD_EVENT, None]], id="count-null"),
    pytest.param([[GOOD_EVENT, float("inf")]], id="count-infinite"),
    pytest.param([[GOOD_EVENT, 1.5]], id="count-fractional"),
    pytest.param([[[1.0, 5, 10], 1]], id="event-of-three"),
    pytest.param([["1.0, 5, 10, 0.0", 1]], id="event-string"),
    pytest.param([[[0.0, 5, 10, 0.0], 1]], id="z-zero"),
    pytest.param([[[-1.0, 5, 10, 0.0], 1]], id="z-negative"),
    pytest.param([[[float("nan"), 5, 10, 0.0], 1]], id="z-nan"),
    pytest.param([[[None, 5, 10, 0.0], 1]], id="z-null"),
    pytest.param([[[1.0, -1, 10, 0.0], 1]], id="m-negative"),
    pytest.param([[[1.0, 5, float("inf"), 0.0], 1]], id="n-infinite"),
    pytest.param([[[1.0, 5, float("nan"), 0.0], 1]], id="n-nan"),
    pytest.param([[[1.0, 2.5, 10, 0.0], 1]], id="m-fractional"),
    pytest.param([[[1.0, 5, 10, 1.5], 1]], id="q-above-one"),
    pytest.param([[[1.0, 11, 10, 0.0], 1]], id="m-above-n"),
    pytest.param([[[1.0, 0, 10, 0.0], 1]], id="m-zero-under-fixed"),
])
def test_malformed_ledgers_raise_value_error(events: Any) -> None:
    """A ledger read from a checkpoint (JSON: null, Infinity and fractions included) is
    either a list of [[z, m, n, q], count] with count a positive integer and m, n whole
    numbers, or refused with ValueError; never truncated into fewer rounds or clients."""
    accountant = PrivacyAccountant("rdp", "fixed", DELTA)
    accountant.record(RoundEvent(1.0, 10, 10))  # everyone: a plain Gaussian, cheap
    before = accountant.state_dict()
    with pytest.raises(ValueError):  # ConfigError is a ValueError too
        accountant.load_state_dict({"kind": "rdp", "sampling": "fixed", "events": events})
    assert accountant.state_dict() == before  # a refused ledger changes nothing


@pytest.mark.parametrize("events", [
    pytest.param([[1.0, 1]], id="event-a-number"),
    pytest.param([[[1.0, 5, 10, -0.5], 1]], id="q-negative"),
    pytest.param([[[1.0, 5, 10, np.array([0.1, 0.2])], 1]], id="q-of-two-values"),
])
def test_malformed_events_raise_value_error_whatever_the_sampling(events: Any) -> None:
    """Checks of the event itself, not left to a sampling mode that reads the field (a
    ``"none"`` round reads neither m, n nor q)."""
    accountant = PrivacyAccountant("rdp", "none", DELTA)
    with pytest.raises(ValueError):
        accountant.load_state_dict({"kind": "rdp", "sampling": "none", "events": events})
    assert accountant.num_rounds == 0


@pytest.mark.parametrize("event", [[1.0, -1, 10, 0.0], [1.0, 5, -1, 0.0]],
                         ids=["m-minus-one", "n-minus-one"])
def test_negative_client_counts_are_refused_under_none(event: list[float]) -> None:
    accountant = PrivacyAccountant("rdp", "none", DELTA)
    with pytest.raises(ValueError, match="whole number"):
        accountant.load_state_dict({"kind": "rdp", "sampling": "none",
                                    "events": [[event, 1]]})


def test_a_ledger_of_arrays_loads_as_its_numbers() -> None:
    """A checkpoint may hand numbers back as 0-d or 1-element arrays: they are the same
    ledger (and a Poisson rate of 1, everyone every round, is a valid rate)."""
    events = [RoundEvent(2.0, 0, 10, 1.0), RoundEvent(2.0, 0, 10, 0.5)]
    original = PrivacyAccountant("rdp", "poisson", DELTA)
    for event in events:
        original.record(event)
    as_arrays = {"kind": "rdp", "sampling": "poisson", "events": [
        [[np.array(v) if i % 2 else np.array([v]) for i, v in enumerate(e.to_state())],
         np.array([1])] for e in events]}
    restored = PrivacyAccountant("rdp", "poisson", DELTA)
    restored.load_state_dict(as_arrays)
    assert restored.state_dict() == original.state_dict()
    assert restored.epsilon() == pytest.approx(reference_epsilon(events, "poisson"), rel=1e-9)


def test_the_ledger_run_length_encodes_consecutive_repeats_only() -> None:
    """A repeat of the last round extends its count (a long run keeps a short ledger); the
    same event after another starts a new entry, whether it was projected first or not."""
    a_event, b_event = FIXED_ROUNDS[0], FIXED_ROUNDS[2]
    events = [a_event, a_event, b_event, b_event, a_event]
    plain = PrivacyAccountant("rdp", "fixed", DELTA)
    projected = PrivacyAccountant("rdp", "fixed", DELTA)
    for event in events:
        plain.record(event)
        projected.epsilon_if(event)
        projected.record(event)
    a, b = a_event.to_state(), b_event.to_state()
    assert plain.state_dict()["events"] == [[a, 2], [b, 2], [a, 1]]
    assert projected.state_dict() == plain.state_dict() and plain.num_rounds == 5
    assert plain.epsilon() == pytest.approx(reference_epsilon(events, "fixed"), rel=1e-9)


def test_an_unknown_accountant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown accountant 'moments'"):
        PrivacyAccountant("moments", "none", DELTA)


@pytest.mark.parametrize(("kind", "sampling"), [("rdp", "none"), ("rdp", "fixed")])
def test_recording_another_event_than_the_projected_one_spends_that_event(
        kind: str, sampling: str) -> None:
    """A projection is reused only for the event it projected: recording a different
    round (say the sample came out smaller) composes that round."""
    events = ROUNDS[sampling]
    projected, recorded = events[0], events[2]
    assert projected != recorded
    accountant = PrivacyAccountant(kind, sampling, DELTA)
    accountant.epsilon_if(projected)
    assert accountant.record(recorded) == pytest.approx(
        reference_epsilon([recorded], sampling, kind), rel=1e-9)
    assert accountant.state_dict()["events"] == [[recorded.to_state(), 1]]


# -- calibration ------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "rounds", "kind", "setting"), [
    (2.0, 3, "rdp", {"sampling": "fixed", "sampled": 5, "population": 20}),
    (2.0, 3, "rdp", {"sampling": "poisson", "rate": 0.3}),
    (1.0, 1, "pld", {"sampling": "poisson", "rate": 0.2}),
    (2.0, 3, "pld", {"sampling": "none"}),
])
def test_calibrated_noise_meets_the_target_and_is_tight(
        target: float, rounds: int, kind: str, setting: dict[str, Any]) -> None:
    z = calibrate_noise_multiplier(target, DELTA, rounds, accountant=kind, **setting)
    sampling = setting["sampling"]
    event = RoundEvent(z, setting.get("sampled", 0), setting.get("population", 0),
                       setting.get("rate", 0.0))

    def spent(multiplier: float) -> float:
        scaled = RoundEvent(multiplier, event.sampled, event.population, event.rate)
        return reference_epsilon([scaled] * rounds, sampling, kind)

    assert spent(z) <= target
    assert spent(z * 0.98) > target


@pytest.mark.parametrize(("args", "kwargs", "setting"), [
    ((1e-4, DELTA, 1000), {"sampling": "none"}, "target_epsilon"),  # needs z > 1000
    ((0.0, DELTA, 10), {"sampling": "none"}, "target_epsilon"),
    ((-1.0, DELTA, 10), {"sampling": "none"}, "target_epsilon"),
    ((float("nan"), DELTA, 10), {"sampling": "none"}, "target_epsilon"),
    ((float("inf"), DELTA, 10), {"sampling": "none"}, "target_epsilon"),
    ((1.0, 0.0, 10), {"sampling": "none"}, "delta"),
    ((1.0, 1.0, 10), {"sampling": "none"}, "delta"),
    ((1.0, DELTA, 0), {"sampling": "none"}, "rounds"),
    ((1.0, DELTA, 10), {"sampling": "fixed", "sampled": 0, "population": 10}, "sampled"),
    ((1.0, DELTA, 10), {"sampling": "fixed", "sampled": 11, "population": 10}, "sampled"),
    ((1.0, DELTA, 10), {"sampling": "poisson", "rate": 0.0}, "rate"),
    ((1.0, DELTA, 10), {"sampling": "poisson", "rate": 1.5}, "rate"),
    # a setting the sampling needs, left out, is refused rather than defaulted
    ((1.0, DELTA, 10), {"sampling": "fixed", "population": 10}, "sampled"),
    ((1.0, DELTA, 10), {"sampling": "poisson"}, "rate"),
    ((1.0, DELTA, 10), {"sampling": "fixed", "sampled": 5, "population": 10,
                        "accountant": "pld"}, "accountant"),
    # an unknown accountant (it silently took the PLD branch)
    ((1.0, DELTA, 10), {"sampling": "poisson", "rate": 0.1, "accountant": "xyz"},
     "accountant"),
])
def test_impossible_calibrations_raise_config_error(
        args: tuple[float, float, int], kwargs: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        calibrate_noise_multiplier(*args, **kwargs)
    assert info.value.setting == setting


def test_none_calibration_over_a_partial_round_is_twice_the_full_one() -> None:
    """A ``"none"`` round over m < n clients is recorded at z / 2 (an added client may
    displace a participant), so its calibrated z is twice the full round's."""
    full = calibrate_noise_multiplier(2.0, DELTA, 5, sampling="none")
    part = calibrate_noise_multiplier(2.0, DELTA, 5, sampling="none", sampled=10,
                                      population=50)
    assert part == pytest.approx(2 * full, rel=2e-3)


def test_poisson_sampling_of_everyone_calibrates_as_no_sampling() -> None:
    """q = 1 (every client every round) is a valid rate, and with nothing to amplify its
    calibrated z is that of a round without sampling."""
    z = calibrate_noise_multiplier(2.0, DELTA, 3, sampling="poisson", rate=1.0)

    def spent(multiplier: float) -> float:
        return reference_epsilon([RoundEvent(multiplier, 0, 10, 1.0)] * 3, "poisson")

    assert spent(z) <= 2.0 < spent(z * 0.98)
    assert z == pytest.approx(calibrate_noise_multiplier(2.0, DELTA, 3, sampling="none"),
                              rel=2e-3)


@pytest.mark.parametrize(("sampled", "population"), [(10, 10), (1, 10)])
def test_fixed_sampling_of_everyone_or_of_one_client_calibrates(sampled: int,
                                                                  population: int) -> None:
    """m = n (no amplification, the replace-one Gaussian at z / 2) and m = 1 are both
    valid fixed-size rounds: calibrated, met and tight under the reference accounting."""
    z = calibrate_noise_multiplier(2.0, DELTA, 3, sampling="fixed", sampled=sampled,
                                   population=population)

    def spent(multiplier: float) -> float:
        return reference_epsilon([RoundEvent(multiplier, sampled, population)] * 3, "fixed")

    assert spent(z) <= 2.0 < spent(z * 0.98)


@pytest.mark.parametrize(("sampling", "extra"), [
    ("fixed", []), ("poisson", ["--sampling", "poisson"])])
def test_the_printed_calibration_meets_the_target(
        sampling: str, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`fedloom privacy calibrate` prints z rounded up: the four-decimal value a user
    copies into a config spends at most the target (rounded to nearest, 2.3232 spent
    8.000084 of a budget of 8 and the run stopped a round early)."""
    from fedloom import cli

    argv = ["privacy", "calibrate", "--epsilon", "8", "--rounds", "50", "--clients", "500",
            "--per-round", "50", "--delta", str(DELTA), *extra]
    assert cli.main(argv) == 0
    printed = float(capsys.readouterr().out.split("=")[1].split()[0])
    n, m = 500, 50
    event = (RoundEvent(printed, 0, n, m / n) if sampling == "poisson"
             else RoundEvent(printed, m, n))
    assert reference_epsilon([event] * 50, sampling) <= 8.0
