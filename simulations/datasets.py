"""Data sets that need no download: scikit-learn's digits, FedProx's Synthetic(alpha, beta).

- `load_digits` wraps ``sklearn.datasets.load_digits`` (1,797 8x8 images of the digits
  0-9, bundled with scikit-learn) as a stratified train/test `DataSplit`;
- `synthetic` generates Synthetic(alpha, beta) of Li et al., "Federated Optimization in
  Heterogeneous Networks" (FedProx, MLSys 2020), following Shamir et al. (2014): one
  `DataSplit` per client, where alpha controls how much the clients' *models* differ
  and beta how much their *inputs* differ.

>>> split = load_digits()
>>> split.x_train.shape, split.x_train.dtype, split.y_train.dtype
((1437, 64), dtype('float32'), dtype('int64'))
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fedloom.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataSplit:
    """Train and test arrays: ``x`` float32 of shape (n, features), ``y`` int64 of (n,)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def __post_init__(self) -> None:
        pairs = ((self.x_train, self.y_train, "train"), (self.x_test, self.y_test, "test"))
        for x, y, part in pairs:
            if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
                raise ValueError(
                    f"{part}: x must be (n, features) and y (n,), got {x.shape} and {y.shape}"
                )

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        """One more than the largest label seen in train or test."""
        top = max(int(self.y_train.max(initial=-1)), int(self.y_test.max(initial=-1)))
        return top + 1


def _check_fraction(test_fraction: float) -> None:
    if not (math.isfinite(test_fraction) and 0.0 < test_fraction < 1.0):
        raise ConfigError("test_fraction", f"must be in (0, 1), got {test_fraction}")


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> DataSplit:
    """scikit-learn's digits, pixels scaled from 0..16 to [0, 1], split stratified by label.

    Args:
        test_fraction: share of the 1,797 examples held out for testing.
        seed: seeds the split.
    """
    _check_fraction(test_fraction)
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return DataSplit(
        np.ascontiguousarray(x_train),
        np.ascontiguousarray(y_train),
        np.ascontiguousarray(x_test),
        np.ascontiguousarray(y_test),
    )


def synthetic(
    alpha: float,
    beta: float,
    num_clients: int,
    *,
    num_features: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    test_fraction: float = 0.2,
    min_samples: int = 50,
    log_mean_samples: float = 4.0,
    log_sigma_samples: float = 2.0,
    max_samples: int | None = None,
    iid: bool = False,
) -> list[DataSplit]:
    """FedProx's Synthetic(alpha, beta): one `DataSplit` per client, reproducible by ``seed``.

    For client k (Li et al. 2020, section 5.1; their generator's code):
    ``u_k ~ N(0, alpha)``, ``W_k ~ N(u_k, 1)`` (features x classes), ``b_k ~ N(u_k, 1)``;
    ``B_k ~ N(0, beta)``,
    ``v_k ~ N(B_k, 1)`` (features), ``x ~ N(v_k, S)`` with ``S = diag(j^-1.2)``;
    ``y = argmax(softmax(x W_k + b_k))``. Normals are given by their standard deviation,
    as in the reference code. The number of examples follows their power law,
    ``floor(lognormal(4, 2)) + 50``, optionally capped by ``max_samples``; each client
    keeps ``test_fraction`` of its examples for testing. ``iid=True`` gives
    Synthetic-IID: one shared ``W, b`` ~ N(0, 1) and ``v = 0`` for every client.

    Args:
        alpha: spread of the clients' models (0 = same model mean); >= 0.
        beta: spread of the clients' input means; >= 0.
        num_clients: how many clients (the paper uses 30).
        num_features: input dimension (60 in the paper).
        num_classes: number of labels (10 in the paper).
        seed: seeds everything.
        test_fraction: per-client share of held-out examples.
        min_samples: the ``+ 50`` of the power law.
        log_mean_samples: mean of the log-normal number of examples.
        log_sigma_samples: its standard deviation.
        max_samples: caps a client's examples (the log-normal tail is heavy).
        iid: generate Synthetic-IID instead.

    >>> clients = synthetic(0.5, 0.5, num_clients=3, seed=1)
    >>> len(clients), clients[0].num_features
    (3, 60)
    """
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ConfigError(name, f"must be a finite number >= 0, got {value}")
    if num_clients < 1:
        raise ConfigError("num_clients", f"must be at least 1, got {num_clients}")
    if num_features < 1 or num_classes < 2:
        raise ConfigError("num_features/num_classes", "need at least 1 feature and 2 classes")
    if min_samples < 2:
        raise ConfigError(
            "min_samples", f"must be at least 2 (one train, one test), got {min_samples}"
        )
    if max_samples is not None and max_samples < min_samples:
        raise ConfigError("max_samples", f"must be at least min_samples ({min_samples})")
    _check_fraction(test_fraction)

    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(log_mean_samples, log_sigma_samples, num_clients).astype(np.int64)
    sizes = sizes + min_samples
    if max_samples is not None:
        sizes = np.minimum(sizes, max_samples)
    std_x = np.power(np.arange(1, num_features + 1, dtype=np.float64), -1.2 / 2)

    shared_w = rng.normal(0.0, 1.0, (num_features, num_classes))
    shared_b = rng.normal(0.0, 1.0, num_classes)
    model_means = rng.normal(0.0, alpha, num_clients)
    input_centres = rng.normal(0.0, beta, num_clients)

    out: list[DataSplit] = []
    for k in range(num_clients):
        if iid:
            w, b, v = shared_w, shared_b, np.zeros(num_features)
        else:
            w = rng.normal(model_means[k], 1.0, (num_features, num_classes))
            b = rng.normal(model_means[k], 1.0, num_classes)
            v = rng.normal(input_centres[k], 1.0, num_features)
        n = int(sizes[k])
        x = v + rng.standard_normal((n, num_features)) * std_x
        y = np.argmax(x @ w + b, axis=1).astype(np.int64)  # softmax is monotone
        n_test = min(n - 1, max(1, round(n * test_fraction)))
        order = rng.permutation(n)
        test, train = order[:n_test], order[n_test:]
        xf = x.astype(np.float32)
        out.append(DataSplit(xf[train], y[train], xf[test], y[test]))
    return out
