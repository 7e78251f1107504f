"""Round planning shared by every engine: client identities, per-(client, round) seeds.

These functions are the whole contract that makes runs agree across engines (the local
engine, the Flower bridge and, for a test of deployment against simulation, the gRPC
server): the same `client_info` list fed to the same seeded fedloom strategy samples the
same clients; `client_fit_config` then gives each sampled client the same config,
whose ``seed`` comes from `fit_seed`.

>>> fit_seed(0, 3, 1) == fit_seed(0, 3, 1), fit_seed(0, 3, 1) == fit_seed(0, 3, 2)
(True, False)
>>> client_info(7)
ClientInfo(client_id='7', name='partition-000007', capabilities=frozenset())
>>> cfg = client_fit_config({"server_round": 1}, base_seed=0, client_index=7, server_round=1,
...                         defaults={"local_epochs": 2})
>>> sorted(cfg)
['local_epochs', 'seed', 'server_round']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedloom.fit_config import SEED
from fedloom.simulations._seeds import first_state_words
from fedloom.stacked import WeightsRow
from fedloom.types import ClientInfo, ClientUpdate, Metrics, Scalar
from fedloom.weights import Weights

#: A client's seed lies in [0, 2**31): valid for torch, numpy and 32-bit consumers.
SEED_BOUND = 2**31
_WORD = 2**32  # an int below it is one SeedSequence entropy word


def fit_seed(base_seed: int, client_index: int, server_round: int) -> int:
    """The seed client ``client_index`` trains with in round ``server_round``.

    ``SeedSequence([base_seed, client_index, server_round])`` hashed to 31 bits: distinct
    inputs give unrelated seeds (not ``base + index``, whose neighbours overlap), and
    any process can recompute it from the three integers alone.
    """
    for name, value in (
        ("base_seed", base_seed),
        ("client_index", client_index),
        ("server_round", server_round),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    entropy: list[int] | np.ndarray = [base_seed, client_index, server_round]
    if max(entropy) < _WORD:
        # The same entropy words (each int below 2**32 is one word), as a uint32 array,
        # which SeedSequence takes as it is instead of converting int by int.
        entropy = np.array(entropy, np.uint32)
    words = np.random.SeedSequence(entropy).generate_state(1)
    return int(words[0]) % SEED_BOUND


#: From this many clients on, `fit_seeds` hashes a round's seeds together (below it, one
#: SeedSequence each is faster: the batch costs about 50 us whatever its size).
_BATCH_FROM = 16


def fit_seeds(base_seed: int, client_indices: Sequence[int], server_round: int) -> list[int]:
    """`fit_seed` of each of ``client_indices`` in round ``server_round``: the same
    seeds, for a large round computed in one pass (`_seeds.first_state_words`)."""
    indices = [int(i) for i in client_indices]
    if len(indices) < _BATCH_FROM or min(base_seed, server_round, *indices) < 0 or max(
            base_seed, server_round, *indices) >= _WORD:
        return [fit_seed(base_seed, i, server_round) for i in indices]  # and its refusals
    entropy = np.empty((3, len(indices)), np.uint32)
    entropy[0], entropy[1], entropy[2] = base_seed, indices, server_round
    return (first_state_words(entropy) % np.uint32(SEED_BOUND)).tolist()


def client_id(client_index: int) -> str:
    """The fedloom client id of simulated client ``client_index`` (its partition id)."""
    return str(client_index)


def client_info(client_index: int) -> ClientInfo:
    """The `ClientInfo` a simulated client presents to the strategy.

    The name is zero-padded so that the sampler's (name, id) ordering is the numeric
    order of the partition ids.
    """
    return ClientInfo(client_id=client_id(client_index), name=f"partition-{client_index:06d}")


def client_infos(num_clients: int) -> tuple[ClientInfo, ...]:
    """`client_info` for partitions ``0 .. num_clients - 1``."""
    return tuple(client_info(i) for i in range(num_clients))


def client_fit_config(
    plan_config: Mapping[str, Scalar],
    *,
    base_seed: int,
    client_index: int,
    server_round: int,
    defaults: Mapping[str, Scalar] | None = None,
) -> dict[str, Scalar]:
    """The fit config one client receives: ``defaults``, then the plan's, then the seed.

    Args:
        plan_config: the strategy's `FitPlan.config` (its entries override ``defaults``).
        base_seed: the run's seed (a scenario's ``seed``).
        client_index: the client's partition id.
        server_round: the round, from 1.
        defaults: run-wide client settings (e.g. ``local_epochs``, ``lr``).
    """
    return client_fit_configs(plan_config, base_seed=base_seed, client_indices=[client_index],
                              server_round=server_round, defaults=defaults)[0]


def client_fit_configs(
    plan_config: Mapping[str, Scalar],
    *,
    base_seed: int,
    client_indices: Sequence[int],
    server_round: int,
    defaults: Mapping[str, Scalar] | None = None,
) -> list[dict[str, Scalar]]:
    """`client_fit_config` of each of ``client_indices`` (the rule lives here): the
    defaults, then the plan's config, merged once; then each client's seed."""
    shared: dict[str, Scalar] = {**(defaults or {}), **plan_config}
    return [{**shared, SEED: seed}
            for seed in fit_seeds(base_seed, client_indices, server_round)]


def to_update(
    client_id: str,
    new_weights: Weights,
    num_examples: int,
    metrics: Metrics,
    current: Weights,
    server_round: int,
) -> ClientUpdate:
    """A client's fit result as the `ClientUpdate` strategies take: the delta from
    ``current`` (the global model of round ``server_round - 1``).

    Raises:
        ValueError: the weights' layout differs from ``current``'s, a value is not
            finite, or ``num_examples`` is not positive.
    """
    if isinstance(new_weights, WeightsRow):  # a row of clients trained together
        stack = new_weights.stack.minus(current)  # one subtraction for the whole stack
        if not stack.finite_rows()[new_weights.row]:
            raise ValueError("the update has non-finite values")
        delta: Weights = WeightsRow(stack, new_weights.row)
    else:
        for name, arr in new_weights.items():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError(f"tensor {name!r} has non-finite values")
        delta = new_weights.subtract(current)
    return ClientUpdate(client_id, delta, num_examples, server_round - 1, metrics)
