"""A plain Flower ClientApp: a small MLP on one partition of scikit-learn's digits.

Written the way Flower 1.42's quickstarts write one (message API: ``@app.train()`` and
``@app.evaluate()``); it knows nothing of fedloom. It lives in a module of its own so
that Ray's workers import it by name (a ClientApp defined in the script that starts
the simulation cannot be unpickled there).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import ClientApp
from sklearn.datasets import load_digits


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@functools.cache
def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, ...]:
    """Train and test tensors of one IID partition of the digits (``x_train, y_train,
    x_test, y_test``); cached, since Flower calls the app once per message."""
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    rows = np.array_split(order, num_partitions)[partition_id]
    x = torch.from_numpy((digits.data[rows] / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target[rows].astype(np.int64))
    cut = len(rows) * 4 // 5
    return x[:cut], y[:cut], x[cut:], y[cut:]


def _partition(context: Context) -> tuple[torch.Tensor, ...]:
    # Flower's simulation gives every virtual node these two keys.
    node = context.node_config
    return load_data(int(node["partition-id"]), int(node["num-partitions"]))


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)  # several nodes share the machine's cores
    x, y, _, _ = _partition(context)
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    config = msg.content["config"]
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config.get("lr", 0.05)),
                                momentum=0.9)
    generator = torch.Generator().manual_seed(int(config.get("seed", 0)))
    model.train()
    for _ in range(int(config.get("local_epochs", 1))):
        for batch in torch.randperm(len(y), generator=generator).split(32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"train_loss": loss.item(), "num-examples": len(y)}),
    })
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    _, _, x, y = _partition(context)
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.eval()
    with torch.no_grad():
        outputs = model(x)
    metrics = {
        "eval_loss": torch.nn.functional.cross_entropy(outputs, y).item(),
        "eval_acc": (outputs.argmax(dim=1) == y).float().mean().item(),
        "num-examples": len(y),
    }
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
