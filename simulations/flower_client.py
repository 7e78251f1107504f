"""A fedloom `Client` as a Flower ``ClientApp`` (message API, flwr 1.42).

`to_client_app` builds a ``ClientApp`` that answers Flower's ``train`` and ``evaluate``
messages by calling a fedloom client, plus the identity query (``query.fedloom_identity``)
with which `FlowerStrategy` learns which partition each Flower node holds
(`answers_identity_query` tells whether an app has that handler). Replies
follow Flower's conventions (new weights under ``"arrays"``, a ``MetricRecord`` with
``"num-examples"``), so the app also serves Flower's own strategies.

Example — a `TorchClient` per partition, run with Flower's FedAvg or `FlowerStrategy`::

    from flwr.app import Context
    from fedloom.simulations import datasets, models, partition
    from fedloom.simulations.flower_client import to_client_app

    data = datasets.load_digits()
    parts = partition.iid_partition(len(data.y_train), 10, seed=0)

    def client_fn(context: Context):
        idx = parts[int(context.node_config["partition-id"])]
        return models.make_torch_client(data.x_train[idx], data.y_train[idx])

    app = to_client_app(client_fn)      # a flwr.clientapp.ClientApp

Limits: the fedloom client is built by ``client_fn`` for every message (as Flower's own
``client_fn`` is); cache inside ``client_fn`` when construction is costly.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedloom.client_sdk._client import Client
from fedloom.errors import ConfigError
from fedloom.simulations._records import (
    ARRAYS_KEY,
    IDENTITY_MESSAGE_TYPE,
    METRICS_KEY,
    PARTITION_ID_KEY,
    arrays_to_weights,
    metrics_to_record,
    record_to_config,
    weights_to_arrays,
)
from fedloom.types import Scalar
from fedloom.weights import Weights

ClientFactory = Callable[[Context], Client]


def _unpack(message: Message) -> tuple[Weights, dict[str, Scalar]]:
    content = message.content
    arrays = list(content.array_records.values())
    if len(arrays) != 1:
        raise ValueError(f"expected one ArrayRecord in the instruction, got {len(arrays)}")
    configs = list(content.config_records.values())
    config = record_to_config(configs[0]) if configs else {}
    return arrays_to_weights(arrays[0]), config


def partition_id(context: Context) -> int:
    """The node's ``partition-id`` from its node config (set by Flower's simulation)."""
    value = context.node_config.get(PARTITION_ID_KEY)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            "node_config.partition-id",
            "missing: run under Flower's simulation or start the SuperNode with "
            "--node-config 'partition-id=N'",
        )
    return int(value)


def answers_identity_query(app: ClientApp) -> bool:
    """Whether ``app`` has a handler for the bridge's identity query.

    True for apps from `to_client_app` and for any app that registers
    ``@app.query("fedloom_identity")`` itself; False for a plain Flower app, which would
    fail on the query (and Flower would log that failure as an ERROR).
    """
    # Flower 1.42 keeps the handlers by message type and offers no public lookup;
    # the flwr pin (<1.43) and the engine-equality tests guard this read.
    handlers = getattr(app, "_registered_funcs", {})
    return IDENTITY_MESSAGE_TYPE in handlers


def to_client_app(client_fn: ClientFactory) -> ClientApp:
    """A Flower ``ClientApp`` whose train/evaluate call the client ``client_fn`` builds.

    Args:
        client_fn: builds the fedloom `Client` for a node from its Flower ``Context``
            (``context.node_config["partition-id"]`` says which data shard it holds).
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        weights, config = _unpack(message)
        out = client_fn(context).fit(weights, config)
        content = RecordDict(
            {
                ARRAYS_KEY: weights_to_arrays(out.weights),
                METRICS_KEY: metrics_to_record(out.metrics, out.num_examples),
            }
        )
        return Message(content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        weights, config = _unpack(message)
        out = client_fn(context).evaluate(weights, config)
        record = metrics_to_record({**out.metrics, "loss": out.loss}, out.num_examples)
        return Message(RecordDict({METRICS_KEY: record}), reply_to=message)

    @app.query("fedloom_identity")
    def identity(message: Message, context: Context) -> Message:
        record = ConfigRecord({PARTITION_ID_KEY: partition_id(context)})
        return Message(RecordDict({"identity": record}), reply_to=message)

    return app
