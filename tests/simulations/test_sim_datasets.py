"""Data sets: shapes, dtypes, stratification, reproducibility, Synthetic(alpha, beta)'s law."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits as sklearn_digits

from fedloom.errors import ConfigError
from fedloom.simulations.datasets import DataSplit, load_digits, synthetic


def test_digits_shapes_dtypes_and_range() -> None:
    d = load_digits()
    assert d.x_train.shape == (1437, 64) and d.x_test.shape == (360, 64)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    assert d.x_train.min() >= 0.0 and d.x_train.max() == 1.0
    assert d.num_features == 64 and d.num_classes == 10


def test_digits_is_sklearns_data_scaled_by_16() -> None:
    d = load_digits()
    raw = sklearn_digits()
    x = np.concatenate([d.x_train, d.x_test]) * 16
    y = np.concatenate([d.y_train, d.y_test])
    # Same multiset of (image, label) rows as scikit-learn's.
    ours = sorted(map(tuple, np.column_stack([x, y]).round().astype(int).tolist()))
    theirs = sorted(map(tuple, np.column_stack([raw.data, raw.target]).astype(int).tolist()))
    assert ours == theirs


def test_digits_split_is_stratified() -> None:
    d = load_digits(test_fraction=0.25, seed=3)
    total = np.bincount(np.concatenate([d.y_train, d.y_test]))
    test = np.bincount(d.y_test, minlength=10)
    # Each class's test count is its share of the test set, to within one example.
    assert np.all(np.abs(test - total * len(d.y_test) / total.sum()) <= 1.0)


def test_digits_reproducible_and_seed_sensitive() -> None:
    a, b, c = load_digits(seed=1), load_digits(seed=1), load_digits(seed=2)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert not np.array_equal(a.y_test, c.y_test)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, float("nan")])
def test_digits_refuses_bad_fraction(fraction: float) -> None:
    with pytest.raises(ConfigError) as err:
        load_digits(test_fraction=fraction)
    assert err.value.setting == "test_fraction"


def test_datasplit_checks_shapes() -> None:
    with pytest.raises(ValueError):
        DataSplit(np.zeros((3, 2)), np.zeros(2), np.zeros((1, 2)), np.zeros(1))


def test_synthetic_shapes_and_reproducibility() -> None:
    a = synthetic(0.5, 0.5, num_clients=8, seed=4)
    b = synthetic(0.5, 0.5, num_clients=8, seed=4)
    c = synthetic(0.5, 0.5, num_clients=8, seed=5)
    assert len(a) == 8
    for s in a:
        assert s.x_train.shape[1] == 60 and s.x_train.dtype == np.float32
        assert s.y_train.dtype == np.int64 and s.y_train.min() >= 0 and s.y_train.max() < 10
        assert len(s.y_train) + len(s.y_test) >= 50  # power law: floor(lognormal) + 50
    for s, t in zip(a, b, strict=True):
        np.testing.assert_array_equal(s.x_train, t.x_train)
        np.testing.assert_array_equal(s.y_test, t.y_test)
    assert not np.array_equal(a[0].x_train[:5], c[0].x_train[:5])


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_synthetic_beta_spreads_client_inputs(beta: float) -> None:
    # A client's mean input over its 60 features and n examples estimates
    # mean_j(v_kj) ~ N(B_k, 1/60), with B_k ~ N(0, beta): across clients its variance is
    # beta^2 + 1/60 (+ the within-client noise mean_j(j^-1.2)/(60 n) < 0.0002).
    clients = synthetic(0.0, beta, num_clients=300, seed=0, max_samples=60, test_fraction=0.1)
    means = np.array([s.x_train.mean() for s in clients])
    expected = beta**2 + 1 / 60
    assert abs(means.var() - expected) < 0.25 * expected


def test_synthetic_alpha_makes_labels_depend_on_the_client() -> None:
    # Synthetic-IID clients share one labelling function and one input law; the clients
    # of Synthetic(3, 3) draw their own, so their label mixes differ far more.
    iid = synthetic(0.0, 0.0, num_clients=2, seed=0, iid=True, max_samples=2000)
    non = synthetic(3.0, 3.0, num_clients=2, seed=0, max_samples=2000)
    hist = [np.bincount(s.y_train, minlength=10) / len(s.y_train) for s in iid]
    hist_non = [np.bincount(s.y_train, minlength=10) / len(s.y_train) for s in non]
    tv_iid = 0.5 * np.abs(hist[0] - hist[1]).sum()
    tv_non = 0.5 * np.abs(hist_non[0] - hist_non[1]).sum()
    assert tv_iid < tv_non


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"alpha": -1.0, "beta": 0.0, "num_clients": 2}, "alpha"),
        ({"alpha": 0.0, "beta": float("inf"), "num_clients": 2}, "beta"),
        ({"alpha": 0.0, "beta": 0.0, "num_clients": 0}, "num_clients"),
        ({"alpha": 0.0, "beta": 0.0, "num_clients": 2, "max_samples": 10}, "max_samples"),
    ],
)
def test_synthetic_refuses_bad_arguments(kwargs: dict, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        synthetic(**kwargs)
    assert err.value.setting == setting
