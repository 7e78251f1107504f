"""The determinism rules: per-(client, round) seeds, client identities, fit configs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedloom.simulations._seeds import first_state_words
from fedloom.simulations.plan import (
    SEED_BOUND,
    client_fit_config,
    client_fit_configs,
    client_info,
    client_infos,
    fit_seed,
    fit_seeds,
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


_WORDS = st.integers(0, 2**32 - 1)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda width: st.lists(
    st.lists(_WORDS, min_size=width, max_size=width), min_size=1, max_size=40)))
def test_first_state_words_equal_numpy_seed_sequence(columns: list[list[int]]) -> None:
    # The vectorized mirror against numpy's own SeedSequence, column by column, for
    # 1 to 4 entropy words (fewer than the pool's 4 words are padded by hashing zeros).
    entropy = np.array(columns, np.uint32).T.copy()
    expected = [int(np.random.SeedSequence(np.array(c, np.uint32)).generate_state(1)[0])
                for c in columns]
    assert first_state_words(entropy).tolist() == expected


def test_first_state_words_refuses_what_it_does_not_mirror() -> None:
    for bad in (np.zeros((3, 2), np.int64), np.zeros((5, 2), np.uint32), np.zeros(3, np.uint32)):
        with pytest.raises(ValueError, match="uint32 of shape"):
            first_state_words(bad)


@pytest.mark.parametrize("count", [1, 15, 16, 100])
@pytest.mark.parametrize(("base", "rnd"), [(0, 1), (7, 3), (2**32 - 1, 2**32 - 1), (2**32, 2)])
def test_fit_seeds_equal_fit_seed_client_by_client(count: int, base: int, rnd: int) -> None:
    # Below and above the batch size, and with inputs at and past one entropy word.
    indices = [0, 2**32 - 1, *range(5, 5 + 7 * (count - 2), 7)][:count]
    assert fit_seeds(base, indices, rnd) == [fit_seed(base, i, rnd) for i in indices]
    past = [*indices[:-1], 2**32]  # one index of two words: every seed still agrees
    assert fit_seeds(base, past, rnd) == [fit_seed(base, i, rnd) for i in past]


def test_fit_seeds_refuse_negative_inputs_in_a_batch() -> None:
    with pytest.raises(ValueError, match=r"^client_index must be >= 0, got -1$"):
        fit_seeds(0, [*range(20), -1], 1)


def test_client_fit_configs_equal_client_fit_config() -> None:
    plan, defaults = {"lr": 0.5, "seed": 1, "server_round": 2}, {"lr": 0.1, "local_epochs": 3}
    indices = list(range(0, 60, 3))
    configs = client_fit_configs(plan, base_seed=4, client_indices=indices, server_round=2,
                                 defaults=defaults)
    expected = [client_fit_config(plan, base_seed=4, client_index=i, server_round=2,
                                  defaults=defaults) for i in indices]
    assert configs == expected
    assert [list(c) for c in configs] == [list(c) for c in expected]  # same key order
    configs[0]["lr"] = 9.0  # each client's config is its own dict
    assert configs[1]["lr"] == 0.5 and plan["lr"] == 0.5


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


def test_sampler_reuses_an_ordering_only_for_the_same_tuple() -> None:
    # Offered the same tuple each round (as the engines do), the sampler sorts it once;
    # the picks equal a sampler's that is given a fresh, shuffled list every round.
    infos = client_infos(50)
    cached, fresh = ClientSampler(3), ClientSampler(3)
    rng = np.random.default_rng(0)
    for _ in range(5):
        shuffled = [infos[i] for i in rng.permutation(50)]
        assert cached.sample(infos, 0.2, 1) == fresh.sample(shuffled, 0.2, 1)
        assert cached.sample_poisson(infos, 0.3) == fresh.sample_poisson(shuffled, 0.3)
    # Another tuple of as many clients is sorted afresh, not read from the cache.
    others = tuple(client_info(i) for i in range(100, 150))
    assert set(cached.sample(others, 1.0, 1)) == {str(i) for i in range(100, 150)}
    assert set(cached.sample(infos, 1.0, 1)) == {str(i) for i in range(50)}


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
