"""ClientApp: 'training' adds a constant to every weight (moves bytes, costs no CPU)."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content.array_records["arrays"].to_numpy_ndarrays()
    new = [a + np.float32(0.001) for a in arrays]
    content = RecordDict(
        {"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 10})}
    )
    return Message(content=content, reply_to=msg)
