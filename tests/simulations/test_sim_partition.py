"""Partitioners: every index exactly once, reproducible by seed, skew where promised."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.errors import ConfigError
from fedloom.simulations.partition import dirichlet_partition, iid_partition, shard_partition


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    assert len(joined) == n
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


LABELS = np.random.default_rng(7).integers(0, 10, size=2000)


# -- IID ---------------------------------------------------------------------------------
def test_iid_covers_and_balances() -> None:
    parts = iid_partition(103, 10, seed=1)
    _assert_exact_cover(parts, 103)
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3


def test_iid_reproducible_and_seed_sensitive() -> None:
    assert _same(iid_partition(500, 7, seed=3), iid_partition(500, 7, seed=3))
    assert not _same(iid_partition(500, 7, seed=3), iid_partition(500, 7, seed=4))


@pytest.mark.parametrize(("n", "k", "setting"), [(5, 6, "num_clients"), (5, 0, "num_clients"),
                                                  (0, 1, "num_examples")])
def test_iid_refuses_bad_arguments(n: int, k: int, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        iid_partition(n, k, seed=0)
    assert err.value.setting == setting


# -- Dirichlet ---------------------------------------------------------------------------
def test_dirichlet_covers_and_respects_min_size() -> None:
    parts = dirichlet_partition(LABELS, 20, alpha=0.3, seed=0, min_size=20)
    _assert_exact_cover(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 20


def test_dirichlet_reproducible_and_seed_sensitive() -> None:
    a = dirichlet_partition(LABELS, 10, alpha=0.5, seed=11)
    assert _same(a, dirichlet_partition(LABELS, 10, alpha=0.5, seed=11))
    assert not _same(a, dirichlet_partition(LABELS, 10, alpha=0.5, seed=12))


def _label_skew(parts: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean total-variation distance between each client's label mix and the global one."""
    classes = np.unique(labels)
    overall = np.array([(labels == c).mean() for c in classes])
    tv = []
    for p in parts:
        local = np.array([(labels[p] == c).mean() for c in classes])
        tv.append(0.5 * np.abs(local - overall).sum())
    return float(np.mean(tv))


def test_dirichlet_skew_grows_as_alpha_falls() -> None:
    skews = [
        np.mean([_label_skew(dirichlet_partition(LABELS, 10, a, seed=s, min_size=1), LABELS)
                 for s in range(3)])
        for a in (100.0, 1.0, 0.1)
    ]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.1  # near IID
    assert skews[2] > 0.5  # most clients dominated by a few labels


def test_dirichlet_shares_follow_the_dirichlet_law() -> None:
    # For p ~ Dir(alpha * 1_K), E[sum_i p_i^2] = (alpha + 1) / (K alpha + 1). With many
    # examples per class, a class's split across clients is p up to rounding; average
    # the statistic over 10 classes x 20 seeds (min_size=0: no rejection bias).
    k, alpha = 5, 0.5
    labels = np.repeat(np.arange(10), 5000)
    stats = []
    for seed in range(20):
        parts = dirichlet_partition(labels, k, alpha, seed=seed, min_size=0)
        counts = np.array([[np.sum(labels[p] == c) for p in parts] for c in range(10)])
        shares = counts / counts.sum(axis=1, keepdims=True)
        stats.extend((shares**2).sum(axis=1))
    expected = (alpha + 1) / (k * alpha + 1)  # 0.4286
    assert abs(np.mean(stats) - expected) < 0.04


def test_dirichlet_gives_up_with_a_config_error() -> None:
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(ConfigError) as err:
        dirichlet_partition(labels, 10, alpha=0.01, seed=0, min_size=9, max_retries=5)
    assert err.value.setting == "min_size"
    assert "raise alpha" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": 1.0, "min_size": 300}, "min_size"),
        ({"alpha": 1.0, "max_retries": 0}, "max_retries"),
    ],
)
def test_dirichlet_refuses_bad_arguments(kwargs: dict, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        dirichlet_partition(LABELS[:1000], 5, seed=0, **kwargs)
    assert err.value.setting == setting


def test_dirichlet_refuses_bad_labels() -> None:
    with pytest.raises(ConfigError) as err:
        dirichlet_partition(np.zeros((3, 3)), 2, 1.0, seed=0)
    assert err.value.setting == "labels"


# -- shards ------------------------------------------------------------------------------
def test_shards_cover_and_are_pathological() -> None:
    # 10 labels x 20 examples, 20 clients x 2 shards = 40 shards of 5: every shard holds
    # one label (each label fills exactly 4 shards), so no client sees more than 2.
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 20))
    parts = shard_partition(labels, 20, 2, seed=5)
    _assert_exact_cover(parts, 200)
    assert all(len(p) == 10 for p in parts)
    assert max(len(np.unique(labels[p])) for p in parts) <= 2


def test_shards_reproducible_and_seed_sensitive() -> None:
    a = shard_partition(LABELS, 50, 2, seed=1)
    _assert_exact_cover(a, len(LABELS))
    assert _same(a, shard_partition(LABELS, 50, 2, seed=1))
    assert not _same(a, shard_partition(LABELS, 50, 2, seed=2))


def test_shards_are_more_skewed_than_iid() -> None:
    shards = shard_partition(LABELS, 50, 2, seed=0)
    iid = iid_partition(len(LABELS), 50, seed=0)
    assert _label_skew(shards, LABELS) > 2 * _label_skew(iid, LABELS)


@pytest.mark.parametrize(("k", "spc", "setting"), [(10, 0, "shards_per_client"),
                                                   (100, 30, "shards_per_client"),
                                                   (0, 2, "num_clients")])
def test_shards_refuse_bad_arguments(k: int, spc: int, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        shard_partition(LABELS, k, spc, seed=0)
    assert err.value.setting == setting
