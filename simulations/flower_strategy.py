"""A fedloom `Strategy` as a Flower message-API strategy (``flwr.serverapp.strategy``).

`FlowerStrategy` drops any fedloom strategy (FedAvg, the FedOpt family, the robust
rules...) into a Flower ``ServerApp``; Flower's own ``Strategy.start`` runs the loop.
What it adds to Flower's behaviour, by design:

- **seeded sampling**: clients are chosen by the fedloom strategy's seeded sampler
  (Flower's own strategies use an unseeded ``random.sample``; central DP samples
  secretly, `fedloom.strategies.ClientSampler.secret`). To sample by partition
  rather than by Flower's random node ids, the bridge asks each new node once for its
  ``partition-id`` (the ``query.fedloom_identity`` message that `to_client_app`
  answers; see "Identity" below) and presents it as `plan.client_info`;
- **a seed per (client, round)** in every fit config (`plan.client_fit_config`);
- **deterministic aggregation order**: replies are folded in the plan's order, not in
  arrival order, so float sums do not depend on scheduling;
- **deltas**: replies carry new weights (Flower's convention); the bridge turns each
  into the delta from the round's global model, which is what fedloom strategies take.
  A failed, malformed or non-finite reply is skipped and counted in ``num-failures``;
- **a virtual clock** (optional, `fedloom.simulations.clock.SyncClock`): each round is
  timed from the clients' speeds, and under over-selection only the clients that would
  answer first are sent a train message, as on the local engine;
- **evaluate_every**: federated evaluation every that many rounds and in the last.

Example — a ``ServerApp`` running fedloom's FedAvg over ClientApps from
`to_client_app` (over plain Flower ClientApps, add ``identify_nodes=False``)::

    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from fedloom.strategies import FedAvg, SelectionConfig
    from fedloom.simulations.flower_strategy import FlowerStrategy

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        selection = SelectionConfig(fraction_fit=0.1, seed=0)
        strategy = FlowerStrategy(FedAvg(selection=selection), base_seed=0)
        result = strategy.start(grid, ArrayRecord(initial_state_dict), num_rounds=5,
                                train_config=ConfigRecord({"local_epochs": 1}))

Identity, and plain Flower ClientApps. Sampling by partition needs each node's
``partition-id`` before the first round is sampled, and only the node knows it (its
node config; the ServerApp sees Flower's random node ids and nothing else). So the
bridge asks, with one query per new node, and only when ``identify_nodes`` says the
ClientApps answer it: a plain Flower ClientApp has no handler for the query, and
Flower logs such a message as an ERROR with a traceback in every node, which reads as
a crash. `run_flower` knows its ClientApp and sets ``identify_nodes`` to
`answers_identity_query` of it; a ``ServerApp`` of your own passes
``identify_nodes=False`` for plain Flower ClientApps. Alternatives weighed and left:
reading the identity off the first train replies comes too late (round 1 is sampled
before any reply), and Flower's simulation keeps its node-to-partition map to itself.

A node not identified (not asked, or no answer) is still used, under the client id
``node-<node id>`` and with its node id as the seed index: sampling is then seeded but
depends on Flower's random node ids, so two runs differ. A virtual clock needs
identified nodes (its speed model is indexed by partition id).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerBaseStrategy

from fedloom.errors import AggregationError, PrivacyBudgetExhausted
from fedloom.fit_config import FLOWER_SERVER_ROUND
from fedloom.simulations._records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    IDENTITY_MESSAGE_TYPE,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    arrays_to_weights,
    config_to_record,
    metrics_to_record,
    record_to_config,
    weights_to_arrays,
)
from fedloom.simulations.clock import SyncClock
from fedloom.simulations.compression import CompressionSpec, SimulatedCompression
from fedloom.simulations.history import with_privacy_spent
from fedloom.simulations.plan import client_fit_config, client_info, to_update
from fedloom.strategies import Strategy
from fedloom.types import (
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    EvaluateResult,
    Metrics,
    Scalar,
)
from fedloom.weights import Weights

logger = logging.getLogger(__name__)

FitCallback = Callable[[int, AggregateResult, int], None]
EvaluateCallback = Callable[[int, Metrics], None]


#: Times the identity query is sent to nodes that have not answered it yet.
IDENTIFY_ATTEMPTS = 5


class FlowerStrategy(FlowerBaseStrategy):
    """Adapts a fedloom `Strategy` to Flower's message-API ``Strategy``.

    Args:
        strategy: the fedloom strategy; it samples, configures and aggregates.
        base_seed: the run seed from which each client's per-round ``seed`` derives.
        fit_defaults: client settings sent with every fit (e.g. ``local_epochs``, ``lr``);
            the strategy's own fit config and Flower's ``train_config`` override them.
        min_available_nodes: wait for this many connected nodes before sampling.
        identify_nodes: ask each new node its ``partition-id`` (the ClientApps must
            answer the query: `to_client_app`'s do; see the module docstring). False
            for plain Flower ClientApps: no query, nodes known by their node ids.
        identify_timeout: seconds to wait for nodes' answers to the identity query (a
            node that answers with an error is asked again within them).
        on_fit_round: called as ``(server_round, result, num_failures)`` after each
            aggregation (progress displays, history, checkpoints).
        on_evaluate_round: called as ``(server_round, metrics)`` after each federated
            evaluation that had results.
        clock: times the rounds on a virtual clock and picks who trains under
            over-selection (its ``last`` is the round's timing once configured); its
            speed model is indexed by partition id, so every node must say its own.
        evaluate_every: rounds between federated evaluations (and the last round).
        num_rounds: the run's rounds (for ``evaluate_every``'s last round).
        compression: the codecs between clients and server, applied here
            (`fedloom.simulations.compression`): clients receive the decoded broadcast,
            and each reply's delta is encoded and decoded before the strategy sees it.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        base_seed: int = 0,
        fit_defaults: Mapping[str, Scalar] | None = None,
        min_available_nodes: int = 2,
        identify_nodes: bool = True,
        identify_timeout: float = 120.0,
        on_fit_round: FitCallback | None = None,
        on_evaluate_round: EvaluateCallback | None = None,
        clock: SyncClock | None = None,
        evaluate_every: int = 1,
        num_rounds: int = 0,
        compression: SimulatedCompression | None = None,
    ) -> None:
        if clock is not None and not identify_nodes:
            raise ValueError("a clock times clients by partition id, which only the identity "
                             "query gives: use identify_nodes=True with fedloom ClientApps")
        self.strategy = strategy
        self.compression = compression if compression is not None else SimulatedCompression(
            CompressionSpec(), base_seed)
        self.base_seed = base_seed
        self.fit_defaults: dict[str, Scalar] = dict(fit_defaults or {})
        self.min_available_nodes = min_available_nodes
        self.identify_nodes = identify_nodes
        self.identify_timeout = identify_timeout
        self.on_fit_round = on_fit_round
        self.on_evaluate_round = on_evaluate_round
        self.clock = clock
        self.evaluate_every = evaluate_every
        self.num_rounds = num_rounds
        self.current: Weights | None = None
        self.received: Weights | None = None  # the round's broadcast, as clients decode it
        self.stopped_reason = ""  # set when the privacy budget ended the run early
        self._client_of_node: dict[int, ClientInfo] = {}
        self._node_of_client: dict[str, int] = {}
        self._seed_index: dict[str, int] = {}
        self._plan_order: list[str] = []

    def summary(self) -> None:
        logger.info("FlowerStrategy over %r (base seed %d)", self.strategy, self.base_seed)

    # -- nodes -----------------------------------------------------------------------
    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        waited = False
        while len(nodes := sorted(grid.get_node_ids())) < self.min_available_nodes:
            if not waited:
                logger.info("waiting for %d nodes (%d connected)", self.min_available_nodes,
                            len(nodes))
                waited = True
            time.sleep(0.1)
        return nodes

    def _clients(self, grid: Grid) -> list[ClientInfo]:
        """The connected nodes as fedloom clients, asking new nodes who they are."""
        nodes = self._wait_for_nodes(grid)
        new = [n for n in nodes if n not in self._client_of_node]
        if new:
            answered = self._identify(grid, new)
            for node in new:
                if node in answered:
                    info, seed_index = client_info(answered[node]), answered[node]
                else:
                    info, seed_index = ClientInfo(f"node-{node}", f"node-{node}"), node
                if info.client_id in self._node_of_client:
                    raise ValueError(
                        f"two Flower nodes claim partition {info.client_id}: give each "
                        "SuperNode its own --node-config partition-id"
                    )
                self._client_of_node[node] = info
                self._node_of_client[info.client_id] = node
                self._seed_index[info.client_id] = seed_index
        connected = set(nodes)
        return [info for node, info in self._client_of_node.items() if node in connected]

    def _identify(self, grid: Grid, nodes: list[int]) -> dict[int, int]:
        """The partition id of each of ``nodes`` that says it (see the module docstring)."""
        if not self.identify_nodes:
            logger.info("%d new nodes known by their Flower node ids (identify_nodes=False)",
                        len(nodes))
            return {}
        # A node asked while the machine is busy (Ray still starting workers) may answer
        # with an error or not in time: ask the silent ones again, within one deadline.
        answered: dict[int, int] = {}
        pending = list(nodes)
        deadline = time.monotonic() + self.identify_timeout
        for _ in range(IDENTIFY_ATTEMPTS):
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            queries = [Message(RecordDict(), dst_node_id=n, message_type=IDENTITY_MESSAGE_TYPE)
                       for n in pending]
            for reply in grid.send_and_receive(queries, timeout=remaining):
                if reply.has_error():
                    continue
                for record in reply.content.config_records.values():
                    value = record.get(PARTITION_ID_KEY)
                    if isinstance(value, int) and not isinstance(value, bool):
                        answered[reply.metadata.src_node_id] = value
            pending = [n for n in pending if n not in answered]
        if pending and self.clock is not None:
            raise RuntimeError(
                f"nodes {pending[:5]} did not say their partition-id within "
                f"{self.identify_timeout:g} s (identify_timeout); the virtual clock needs "
                "every node's: are the ClientApps fedloom's (to_client_app)?")
        for node in pending:
            logger.warning("node %d did not say its partition-id; using its node id (for "
                           "plain Flower ClientApps, pass identify_nodes=False)", node)
        return answered

    # -- train -----------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        current = arrays_to_weights(arrays)
        self.current = current
        if self.stopped_reason:
            return []
        clients = self._clients(grid)
        try:
            plan = self.strategy.configure_fit(server_round, current, clients)
        except PrivacyBudgetExhausted as exc:
            # Flower's loop runs its num_rounds; from here on no round is sent out.
            logger.warning("run ends before round %d: %s", server_round, exc)
            self.stopped_reason = str(exc)
            return []
        training = plan.client_ids
        if self.clock is not None:  # over-selection: only the updates that count train
            training = self.clock.round(server_round, plan.client_ids, clients,
                                        index_of=self._seed_index.__getitem__).client_ids
        self._plan_order = list(training)
        self.received = self.compression.broadcast(current)
        if self.received is not current:
            arrays = weights_to_arrays(self.received)
        defaults = {**self.fit_defaults, **record_to_config(config)}
        messages = []
        for cid in training:
            fit_config = client_fit_config(
                plan.config,
                base_seed=self.base_seed,
                client_index=self._seed_index[cid],
                server_round=server_round,
                defaults=defaults,
            )
            fit_config[FLOWER_SERVER_ROUND] = server_round  # what Flower's strategies send
            content = RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: config_to_record(fit_config)})
            messages.append(
                Message(content, dst_node_id=self._node_of_client[cid],
                        message_type=MessageType.TRAIN)
            )
        return messages

    def _ordered(self, replies: Iterable[Message]) -> list[tuple[str, Message]]:
        rank = {cid: i for i, cid in enumerate(self._plan_order)}
        known = []
        for reply in replies:
            info = self._client_of_node.get(reply.metadata.src_node_id)
            if info is not None:
                known.append((info.client_id, reply))
        known.sort(key=lambda pair: rank.get(pair[0], len(rank)))
        return known

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        current, received = self.current, self.received
        if current is None or received is None:
            raise RuntimeError("aggregate_train before configure_train")
        if self.stopped_reason:
            return None, None
        ordered = self._ordered(replies)
        failures, taken = [0], [0]

        def updates() -> Iterator[ClientUpdate]:
            for cid, reply in ordered:
                update = _to_update(cid, reply, received, server_round)
                if update is None:
                    failures[0] += 1
                else:
                    taken[0] += 1
                    yield self.compression.update(update, self._seed_index[cid], server_round)

        try:
            result = self.strategy.aggregate_fit(server_round, current, updates())
        except AggregationError as exc:  # the server's rule: the round failed, go on
            result = AggregateResult.failed(exc, taken[0])
        result = with_privacy_spent(result, self.strategy)
        failures[0] += len(self._plan_order) - len(ordered)  # no reply at all
        metrics = metrics_to_record({**result.metrics, "num-failures": failures[0]})
        if self.on_fit_round is not None:
            self.on_fit_round(server_round, result, failures[0])
        if result.weights is None:
            logger.warning("round %d failed: %s; the global model is unchanged", server_round,
                           result.reason)
            return None, metrics
        self.current = result.weights
        return weights_to_arrays(result.weights), metrics

    # -- evaluate --------------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.evaluates(server_round):
            return []
        current = arrays_to_weights(arrays)
        plan = self.strategy.configure_evaluate(server_round, current, self._clients(grid))
        record = config_to_record({**record_to_config(config), **plan.config,
                                   FLOWER_SERVER_ROUND: server_round})
        content = RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: record})
        return [
            Message(content, dst_node_id=self._node_of_client[cid],
                    message_type=MessageType.EVALUATE)
            for cid in plan.client_ids
        ]

    def evaluates(self, server_round: int) -> bool:
        """Whether round ``server_round`` is evaluated (``evaluate_every``, and the last)."""
        return server_round % self.evaluate_every == 0 or server_round == self.num_rounds

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        results = []
        for cid, reply in self._ordered(replies):
            result = _to_evaluate_result(cid, reply)
            if result is not None:
                results.append(result)
        if not results:
            return None
        metrics = self.strategy.aggregate_evaluate(server_round, results)
        if self.on_evaluate_round is not None:
            self.on_evaluate_round(server_round, metrics)
        return metrics_to_record(metrics)


def _metrics_of(reply: Message) -> dict[str, Scalar] | None:
    records = list(reply.content.metric_records.values())
    return record_to_config(records[0]) if len(records) == 1 else None


def _num_examples(metrics: dict[str, Scalar]) -> int | None:
    n = metrics.pop(NUM_EXAMPLES_KEY, None)
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        return None
    return n


def _to_update(
    cid: str, reply: Message, current: Weights, server_round: int
) -> ClientUpdate | None:
    """The reply as a `ClientUpdate` (a delta), or None when it is unusable."""
    if reply.has_error():
        logger.warning("client %s failed: %s", cid, reply.error.reason)
        return None
    metrics = _metrics_of(reply)
    arrays = list(reply.content.array_records.values())
    if metrics is None or len(arrays) != 1:
        logger.warning("client %s: reply lacks one ArrayRecord and one MetricRecord", cid)
        return None
    n = _num_examples(metrics)
    try:
        if n is None:
            raise ValueError("num-examples is missing or not a positive integer")
        return to_update(cid, arrays_to_weights(arrays[0]), n, metrics, current, server_round)
    except (ValueError, TypeError) as exc:
        logger.warning("client %s: unusable reply: %s", cid, exc)
        return None


def _to_evaluate_result(cid: str, reply: Message) -> EvaluateResult | None:
    if reply.has_error():
        return None
    metrics = _metrics_of(reply)
    if metrics is None:
        return None
    n = _num_examples(metrics)
    loss = metrics.pop("loss", metrics.pop("eval_loss", None))
    if n is None or isinstance(loss, bool) or not isinstance(loss, int | float):
        return None
    try:
        return EvaluateResult(cid, n, float(loss), metrics)
    except ValueError:
        return None
