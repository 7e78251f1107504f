"""Drive Flower 1.42's message-API strategies directly, as an oracle for ours.

Builds reply `Message`s the way Flower 1.42 expects them (TaskIdentity set first; a reply
is ``Message(content, reply_to=instruction)``), and generates random rounds: several
tensors of different shapes (a 0-d one included), float32, unequal ``num_examples``.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from fedloom import ClientUpdate, Weights

SHAPES = [(4, 3), (5,), (), (2, 2, 2)]


def setup_flower() -> None:
    """Let Messages be built outside a running app, and quiet Flower's INFO logging.

    Also skips the ``gc.collect()`` that ``ArrayRecord.to_numpy_ndarrays(keep_input=False)``
    runs per array (memory housekeeping, no effect on values): under hypothesis's heap it
    costs about 60 ms a call and would dominate the suite.
    """
    import types

    import flwr.app.message.arrayrecord as arrayrecord_module
    from flwr.supercore.task_identity import TaskIdentity

    arrayrecord_module.gc = types.SimpleNamespace(collect=lambda: 0)  # type: ignore[assignment]

    TaskIdentity.run_id = 1
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = 1
    logging.getLogger("flwr").setLevel(logging.WARNING)


def replies(client_weights: list[dict[str, np.ndarray]], num_examples: list[int]) -> list:
    """One train reply per client, carrying its full weights and ``num-examples``."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    out = []
    for i, (arrays, n) in enumerate(zip(client_weights, num_examples, strict=True)):
        instruction = Message(RecordDict(), dst_node_id=i + 1, message_type="train")
        content = RecordDict({
            "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": n}),
        })
        out.append(Message(content, reply_to=instruction))
    return out


def to_dict(record) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {k: a.numpy() for k, a in record.items()}


@dataclasses.dataclass
class Round:
    deltas: list[Weights]
    num_examples: list[int]

    def updates(self, base_round: int) -> list[ClientUpdate]:
        return [ClientUpdate(f"c{i}", d, n, base_round)
                for i, (d, n) in enumerate(zip(self.deltas, self.num_examples, strict=True))]


def initial_weights(rng: np.random.Generator, shapes: list[tuple[int, ...]]) -> Weights:
    return Weights({f"t{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)})


def random_round(
    rng: np.random.Generator, shapes: list[tuple[int, ...]], num_clients: int, scale: float = 0.3
) -> Round:
    deltas = [
        Weights({f"t{i}": (scale * rng.normal(size=s)).astype(np.float32)
                 for i, s in enumerate(shapes)})
        for _ in range(num_clients)
    ]
    num_examples = [int(x) for x in rng.integers(1, 200, size=num_clients)]
    return Round(deltas, num_examples)


def client_weights(current: dict[str, np.ndarray], rnd: Round) -> list[dict[str, np.ndarray]]:
    """What each client would send Flower: the current model plus its delta."""
    return [{k: current[k] + d[k] for k in current} for d in rnd.deltas]


def assert_close(ours: Weights, flower: dict[str, np.ndarray], rtol: float, atol: float) -> None:
    assert list(ours) == list(flower)
    for k in ours:
        assert ours[k].shape == np.shape(flower[k]), k
        np.testing.assert_allclose(ours[k], flower[k], rtol=rtol, atol=atol, err_msg=k)
