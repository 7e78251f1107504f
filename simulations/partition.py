"""Partitioners: split one data set's indices among simulated clients, reproducibly.

Each returns ``list[np.ndarray]``: one sorted int64 index array per client, together
covering every index exactly once. The same arguments and seed give the same split.

- `iid_partition`: a seeded shuffle cut into near-equal parts;
- `dirichlet_partition`: label skew from Dirichlet(alpha) proportions per class (Hsu et al.,
  "Measuring the Effects of Non-Identical Data Distribution", 2019; the scheme of
  Yurochkin et al. 2019 that flwr-datasets' ``DirichletPartitioner`` implements);
- `shard_partition`: McMahan et al.'s pathological non-IID split (AISTATS 2017): sort
  by label, cut into ``num_clients * shards_per_client`` equal shards, deal each client
  ``shards_per_client`` of them at random.

They work on numpy arrays directly. (flwr-datasets partitions Hugging Face
``datasets.Dataset`` objects, which would pull pyarrow, pandas and the HF hub client
into every simulation install just to split index arrays.)

>>> parts = iid_partition(10, 3, seed=0)
>>> [len(p) for p in parts]
[4, 3, 3]
"""

from __future__ import annotations

import math

import numpy as np

from fedloom.errors import ConfigError


def _check_clients(num_clients: int, num_examples: int) -> None:
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ConfigError("num_clients", f"must be a positive integer, got {num_clients!r}")
    if num_clients > num_examples:
        raise ConfigError(
            "num_clients",
            f"{num_clients} clients cannot share {num_examples} examples; use at most "
            f"{num_examples} clients",
        )


def _labels(labels: np.ndarray) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError("labels", f"must be a non-empty 1-d array, got shape {arr.shape}")
    return arr


def iid_partition(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(num_examples)`` with ``seed`` and cut it into near-equal parts.

    Part sizes differ by at most one (the first ``num_examples % num_clients`` parts are
    one longer).
    """
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 1:
        raise ConfigError("num_examples", f"must be a positive integer, got {num_examples!r}")
    _check_clients(num_clients, num_examples)
    order = np.random.default_rng(seed).permutation(num_examples)
    return [np.sort(p).astype(np.int64) for p in np.array_split(order, num_clients)]


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_retries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among clients in Dirichlet(alpha) shares.

    For each class c, draw ``p ~ Dir(alpha * 1)`` over the clients and cut the (shuffled)
    examples of c at the cumulative shares ``floor(cumsum(p) * n_c)``. Small alpha gives each
    client few classes; large alpha approaches IID. When some client ends with fewer than
    ``min_size`` examples the draw is repeated (the RNG moves on), at most
    ``max_retries`` times.

    Args:
        labels: one label per example (any sortable dtype).
        num_clients: number of parts.
        alpha: Dirichlet concentration, > 0.
        seed: seeds the draws.
        min_size: the fewest examples any client may get.
        max_retries: draws to try before giving up.

    Raises:
        ConfigError: for bad arguments, or when no draw within ``max_retries`` gives
            every client ``min_size`` examples (raise alpha, lower min_size or
            num_clients).
    """
    y = _labels(labels)
    _check_clients(num_clients, y.size)
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise ConfigError("alpha", f"must be a finite number > 0, got {alpha!r}")
    if min_size < 0:
        raise ConfigError("min_size", f"must be >= 0, got {min_size}")
    if min_size * num_clients > y.size:
        raise ConfigError(
            "min_size",
            f"{num_clients} clients x {min_size} examples exceeds the {y.size} available",
        )
    if max_retries < 1:
        raise ConfigError("max_retries", f"must be at least 1, got {max_retries}")

    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
    smallest = 0
    for _ in range(max_retries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in by_class:
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(shares) * members.size).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(rng.permutation(members), cuts)):
                parts[client].append(chunk)
        merged = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        smallest = min(len(p) for p in merged)
        if smallest >= min_size:
            return merged
    raise ConfigError(
        "min_size",
        f"no Dirichlet(alpha={alpha}) split of {y.size} examples over {num_clients} clients "
        f"gave every client at least {min_size} examples in {max_retries} tries (smallest last: "
        f"{smallest}); raise alpha, lower min_size or num_clients",
    )


def shard_partition(
    labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int
) -> list[np.ndarray]:
    """McMahan et al.'s pathological split: each client gets ``shards_per_client`` shards.

    Examples are sorted by label (ties in a seeded random order), cut into
    ``num_clients * shards_per_client`` shards of near-equal size, and the shards are
    dealt to clients in a seeded random order. With 2 shards per client most clients
    see at most two labels (MNIST in the paper: 100 clients, 200 shards of 300).
    """
    y = _labels(labels)
    _check_clients(num_clients, y.size)
    if (
        isinstance(shards_per_client, bool)
        or not isinstance(shards_per_client, int)
        or shards_per_client < 1
    ):
        raise ConfigError(
            "shards_per_client", f"must be a positive integer, got {shards_per_client!r}"
        )
    num_shards = num_clients * shards_per_client
    if num_shards > y.size:
        raise ConfigError(
            "shards_per_client",
            f"{num_clients} x {shards_per_client} = {num_shards} shards exceed the "
            f"{y.size} examples; lower shards_per_client or num_clients",
        )
    rng = np.random.default_rng(seed)
    tie_break = rng.permutation(y.size)
    by_label = tie_break[np.argsort(y[tie_break], kind="stable")]
    shards = np.array_split(by_label, num_shards)
    dealt = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [
        np.sort(np.concatenate([shards[s] for s in row])).astype(np.int64) for row in dealt
    ]
