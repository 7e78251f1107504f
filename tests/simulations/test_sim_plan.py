"""The determinism rules: per-(client, round) seeds, client identities, fit configs."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.simulations.plan import (
    SEED_BOUND,
    client_fit_config,
    client_info,
    client_infos,
    fit_seed,
    to_update,
)
from fedloom.strategies import ClientSampler
from fedloom.weights import Weights


@pytest.mark.parametrize("inputs", [
    (7, 3, 2), (0, 0, 0), (2**32 - 1, 999, 1), (2**32, 5, 3), (2**40 + 7, 2**33, 2**32 + 1),
])
def test_fit_seed_is_a_pure_function_of_its_three_integers(inputs: tuple[int, int, int]) -> None:
    # The documented derivation, recomputed independently: below and above 2**32,
    # where an int stops being one entropy word.
    expected = int(np.random.SeedSequence(list(inputs)).generate_state(1)[0]) % 2**31
    assert fit_seed(*inputs) == expected


def test_fit_seeds_are_distinct_and_in_range() -> None:
    seeds = {fit_seed(b, c, r) for b in range(3) for c in range(50) for r in range(1, 11)}
    assert len(seeds) == 3 * 50 * 10  # no collisions (e.g. base + index would collide)
    assert all(0 <= s < SEED_BOUND for s in seeds)


def test_fit_seed_refuses_negative_inputs() -> None:
    # fedloom's own message, not numpy's refusal of a negative seed.
    with pytest.raises(ValueError, match=r"^client_index must be >= 0, got -1$"):
        fit_seed(0, -1, 1)


def test_client_infos_sort_in_partition_order() -> None:
    infos = client_infos(12)
    assert [i.client_id for i in infos] == [str(i) for i in range(12)]
    # The sampler orders by (name, id); zero-padded names keep 2 before 10.
    assert sorted(infos, key=lambda c: (c.name, c.client_id)) == list(infos)
    assert client_info(3).client_id == "3"


def test_sampling_over_client_infos_is_seeded() -> None:
    a = ClientSampler(5).sample(client_infos(100), 0.1, 1)
    b = ClientSampler(5).sample(list(reversed(client_infos(100))), 0.1, 1)
    assert a == b and len(a) == 10


def test_client_fit_config_precedence() -> None:
    cfg = client_fit_config(
        {"lr": 0.5, "seed": 1, "server_round": 2},
        base_seed=4, client_index=9, server_round=2,
        defaults={"lr": 0.1, "local_epochs": 3},
    )
    # The plan overrides defaults; the engine's seed overrides everything.
    assert cfg == {"lr": 0.5, "local_epochs": 3, "server_round": 2, "seed": fit_seed(4, 9, 2)}


def test_to_update_is_the_delta_from_the_round_model() -> None:
    current = Weights([("w", np.array([1.0, 2.0], np.float32)), ("n", np.array(3, np.int64))])
    new = Weights([("w", np.array([1.5, 1.0], np.float32)), ("n", np.array(5, np.int64))])
    update = to_update("4", new, 10, {"train_loss": 0.5}, current, server_round=3)
    np.testing.assert_array_equal(update.delta["w"], [0.5, -1.0])
    assert update.delta["n"] == 2 and update.base_round == 2 and update.num_examples == 10


@pytest.mark.parametrize(
    "bad",
    [
        Weights({"w": np.array([np.nan, 0.0], np.float32)}),
        Weights({"w": np.zeros(3, np.float32)}),
        Weights({"v": np.zeros(2, np.float32)}),
    ],
)
def test_to_update_refuses_unusable_weights(bad: Weights) -> None:
    current = Weights({"w": np.zeros(2, np.float32)})
    with pytest.raises(ValueError):
        to_update("0", bad, 1, {}, current, 1)
