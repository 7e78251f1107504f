"""An in-process Flower ``Grid`` that runs a ClientApp per node: bridge tests without Ray."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


def set_task_identity() -> None:
    """Messages built outside a running app need a run id (Flower checks it)."""
    TaskIdentity.run_id = 1
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = 0


class FakeGrid(Grid):
    """Nodes with random-looking ids; node k holds partition ``partitions[k]``.

    A ClientApp that raises yields an error reply, as Flower's simulation backend does.
    Replies come back in reverse order, to show aggregation does not depend on it.
    """

    def __init__(self, app: ClientApp, num_nodes: int, first_id: int = 9_000_000_017) -> None:
        set_task_identity()
        self.app = app
        self.node_ids = [first_id + 7919 * k for k in range(num_nodes)]
        self.contexts = {
            node: Context(run_id=1, node_id=node,
                          node_config={"partition-id": k, "num-partitions": num_nodes},
                          state=RecordDict(), run_config={})
            for k, node in enumerate(self.node_ids)
        }
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for message in messages:
            self.sent.append(message)
            context = self.contexts[message.metadata.dst_node_id]
            try:
                replies.append(self.app(message, context))
            except Exception as exc:
                replies.append(Message(Error(code=1, reason=str(exc)), reply_to=message))
        self.replies.extend(replies)
        return list(reversed(replies))
