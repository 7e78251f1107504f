"""`VectorizedFitter` against the serial reference, the real `TorchClient`.

Every expected value comes from `Job.make_client(i).fit` (or from `run_local` with its
default serial fitter), never from stored numbers.

Tolerance: training runs in float32, and a batched matrix product sums in another
order than the one-client product, so the two differ by float rounding, about 1e-7
per step on these weights (magnitudes ~0.01..1). A few steps of SGD, Adam or a few
rounds of FedAdam (whose server step amplifies a tiny delta by at most eta / tau = 100)
stay well inside ``rtol = 1e-4, atol = 1e-5``; a wrong batch, step or learning rate
moves the weights by 1e-3 or more.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from fedloom.client_sdk import FitOutput
from fedloom.errors import ConfigError
from fedloom.simulations._functional_train import ChunkPlan, ClientPlan, ClientShuffle
from fedloom.simulations.fitting import FitTask
from fedloom.simulations.job import Job
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.models import make_torch_client
from fedloom.simulations.scenario import scenario_from_mapping
from fedloom.simulations.vectorized import VectorizedFitter
from fedloom.weights import Weights

RTOL, ATOL = 1e-4, 1e-5


@functools.cache
def make_job(optimizer: str = "sgd", momentum: float = 0.9, partition: str = "dirichlet",
             num_clients: int = 30, strategy: tuple[tuple[str, Any], ...] = (),
             clients_per_round: int = 4) -> Job:
    """Digits over ``num_clients``; the Dirichlet split (alpha 0.3) gives shares of 5 to
    129 examples at 30 clients, so batches of 16 leave one client below a batch."""
    return Job.from_scenario(scenario_from_mapping({
        "num_clients": num_clients, "clients_per_round": clients_per_round, "rounds": 3,
        "progress": False, "local_epochs": 2,
        "partition": {"name": partition, "alpha": 0.3, "min_size": 1},
        "client": {"batch_size": 16, "optimizer": optimizer, "momentum": momentum},
        "strategy": {"name": "fedavg", **dict(strategy)},
    }))


def sizes(job: Job) -> list[int]:
    return [len(c.y) for c in job.clients]


def mixed_tasks(job: Job) -> list[FitTask]:
    """The smallest share (below one batch), middling and the largest ones, with
    configs that differ per task: seeds, epochs, lr / eta_l, FedProx, clipping."""
    order = np.argsort(sizes(job), kind="stable")
    chosen = [int(i) for i in (order[0], order[1], order[len(order) // 2], order[-1])]
    configs: list[dict[str, Any]] = [
        {"seed": 11, "local_epochs": 2},
        {"seed": 12, "local_epochs": 3, "lr": 0.1, "proximal_mu": 0.5},
        {"seed": 13, "local_epochs": 2, "eta_l": 0.02, "max_update_norm": 0.05},
        {"seed": 14, "local_epochs": 2, "proximal_mu": 0.1, "max_update_norm": 0.2},
    ]
    return [FitTask(i, c) for i, c in zip(chosen, configs, strict=True)]


def reference(job: Job, weights: Weights, task: FitTask) -> FitOutput:
    return job.make_client(task.index).fit(weights, dict(task.config))


def assert_same_fit(ours: FitOutput | Exception, expected: FitOutput) -> None:
    assert isinstance(ours, FitOutput), ours
    assert list(ours.weights) == list(expected.weights)
    for name, value in expected.weights.items():
        assert ours.weights[name].dtype == value.dtype
        np.testing.assert_allclose(ours.weights[name], value, rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    assert ours.num_examples == expected.num_examples
    assert list(ours.metrics) == list(expected.metrics)
    for key, metric in expected.metrics.items():
        assert ours.metrics[key] == pytest.approx(metric, rel=RTOL, abs=ATOL), key


def assert_same_weights(a: Weights, b: Weights) -> None:
    assert list(a) == list(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=RTOL, atol=ATOL, err_msg=name)


# -- 1. the batches: the real loader's, step by step ------------------------------------
LOADER_CASES = [(1, 1), (5, 2), (14, 1), (16, 2), (33, 3), (64, 2)]  # (examples, epochs)


def loader_batches(client: Any, epochs: int) -> list[list[int]]:
    """The example indices of each batch the client's loader yields over ``epochs``."""
    return [xb[:, 0].long().tolist() for _ in range(epochs) for xb, _ in client.train_loader]


def plan_batches(plan: ChunkPlan, position: int, offset: int) -> list[list[int]]:
    row = plan.order.index(position)
    return [(plan.index[s, row][plan.mask[s, row]] - offset).tolist()
            for s in range(len(plan.active)) if row < plan.active[s]]


@pytest.mark.parametrize("batch_size", [1, 5, 16, 32])
def test_plan_replays_the_loader_of_each_client_in_one_chunk(batch_size: int) -> None:
    clients: list[Any] = []  # _SeededTorchClient, with its shuffling generator
    shuffles, plans, offset = [], [], 0
    for n, epochs in LOADER_CASES:
        x = np.arange(n, dtype=np.float32).reshape(n, 1)  # feature = example index
        clients.append(make_torch_client(x, np.zeros(n, np.int64), batch_size=batch_size,
                                         model=torch.nn.Linear(1, 2), seed=5))
        shuffles.append(ClientShuffle(5))
        plans.append((n, offset, epochs))
        offset += n
    # First without a seed (from the construction seed), then reseeded twice, then
    # going on without one: the generator's whole history must match.
    for seed in (None, 123, 7, None):
        chunk = []
        for client, shuffle, (n, start, epochs) in zip(clients, shuffles, plans, strict=True):
            if seed is not None:
                client.generator.manual_seed(seed)
                shuffle.reseed(seed)
            chunk.append(ClientPlan(n, start, epochs, shuffle.orders(n, epochs)))
        plan = ChunkPlan(chunk, batch_size)
        for position, (client, (n, start, epochs)) in enumerate(
                zip(clients, plans, strict=True)):
            expected = loader_batches(client, epochs)
            assert plan_batches(plan, position, start) == expected
            assert plan.seen[plan.order.index(position)] == n * epochs


def test_plan_orders_clients_longest_first_and_pads_short_batches() -> None:
    shuffles = [ClientShuffle(0) for _ in range(3)]
    chunk = [ClientPlan(n, off, 1, s.orders(n, 1))
             for (n, off), s in zip([(3, 0), (20, 3), (9, 23)], shuffles, strict=True)]
    plan = ChunkPlan(chunk, batch_size=8)
    # batches of 8: 20 examples -> 8, 8, 4; 9 -> 8, 1; 3 -> 3 (width: min(8, 20))
    assert plan.order == [1, 2, 0]
    assert plan.active == [3, 2, 1]
    assert plan.index.shape == (3, 3, 8)
    assert plan.count[:, 0].tolist() == [8, 8, 4]
    assert plan.count[:, 2].tolist() == [3, 0, 0]
    assert plan.count[:, 1].tolist() == [8, 1, 0]
    assert plan.seen.tolist() == [20, 9, 3]
    # a padded slot is masked out but still points at a real row of the data
    assert (plan.index[2, 0, 4:] < 32).all() and not plan.mask[2, 0, 4:].any()


# -- 2. each task equals its client alone ----------------------------------------------
@pytest.mark.parametrize(("optimizer", "momentum"),
                         [("sgd", 0.9), ("sgd", 0.0), ("adam", 0.9)])
def test_each_task_equals_its_client_alone(optimizer: str, momentum: float) -> None:
    job = make_job(optimizer, momentum)
    weights = job.initial_weights()
    tasks = mixed_tasks(job)
    assert sizes(job)[tasks[0].index] < job.scenario.client.batch_size
    fitter = VectorizedFitter.from_job(job, chunk_size=len(tasks))
    results = list(fitter.fit(weights, tasks))
    expected = [reference(job, weights, task) for task in tasks]
    for ours, theirs in zip(results, expected, strict=True):
        assert_same_fit(ours, theirs)
    # the clipping bound is active: the reported norm lies above it
    norm = expected[2].metrics["update_norm"]
    assert isinstance(norm, float) and norm > 0.05
    clipped = results[2]
    assert isinstance(clipped, FitOutput)
    delta = clipped.weights.subtract(weights)
    assert np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in delta.values())) <= 0.05
    # one learning rate for the whole chunk takes another code path
    shared_lr = [FitTask(t.index, {k: v for k, v in t.config.items() if k not in ("lr", "eta_l")})
                 for t in tasks]
    for ours, task in zip(fitter.fit(weights, shared_lr), shared_lr, strict=True):
        assert_same_fit(ours, reference(job, weights, task))


def test_fits_without_a_seed_go_on_like_the_cached_client() -> None:
    job = make_job()
    weights = job.initial_weights()
    fitter, client = VectorizedFitter.from_job(job), job.make_client(3)
    for config in ({"local_epochs": 2}, {"local_epochs": 1}, {"seed": 9}, {}):
        (ours,) = fitter.fit(weights, [FitTask(3, config)])
        assert_same_fit(ours, client.fit(weights, dict(config)))


# -- 3. the engine: run_local with the fitter equals the serial run, round by round -------
ENGINE_CASES = [
    ("iid", ()),
    ("dirichlet", ()),
    ("iid", (("name", "fedprox"), ("proximal_mu", 0.1))),
    ("dirichlet", (("name", "fedprox"), ("proximal_mu", 0.1))),
    ("dirichlet", (("name", "fedadam"),)),
]


def round_models(job: Job, fitter: VectorizedFitter | None) -> tuple[list[Weights], Any]:
    shared = job.make_model()
    clients: dict[int, Any] = {}

    def client_fn(index: int) -> Any:  # as the runner builds them
        if index not in clients:
            clients[index] = job.make_client(index, model=shared)
        return clients[index]

    models: list[Weights] = []

    def keep(_round: int, weights: Weights) -> None:
        models.append(weights)

    history = run_local(job.build_strategy(), client_fn, job.initial_weights(),
                        num_clients=job.scenario.num_clients, num_rounds=job.scenario.rounds,
                        base_seed=job.scenario.seed, fit_defaults=job.fit_defaults(),
                        evaluate_fn=keep, fitter=fitter)
    return models, history


@pytest.mark.parametrize(("partition", "strategy"), ENGINE_CASES, ids=[
    "fedavg-iid", "fedavg-dirichlet", "fedprox-iid", "fedprox-dirichlet", "fedadam-dirichlet"])
def test_run_local_with_the_fitter_equals_the_serial_engine(
        partition: str, strategy: tuple[tuple[str, Any], ...]) -> None:
    job = make_job(partition=partition, num_clients=8, strategy=strategy)
    serial, serial_history = round_models(job, None)
    vectorized, history = round_models(job, VectorizedFitter.from_job(job, chunk_size=3))
    assert len(vectorized) == len(serial) == job.scenario.rounds + 1
    for ours, theirs in zip(vectorized, serial, strict=True):
        assert_same_weights(ours, theirs)
    for ours_record, record in zip(history.rounds[1:], serial_history.rounds[1:], strict=True):
        assert ours_record.get("train_loss") == pytest.approx(record.get("train_loss"),
                                                              rel=RTOL)
        assert ours_record.get("num_failures") == record.get("num_failures") == 0
    assert not serial[-1].allclose(serial[0], atol=1e-3)  # the runs did train


# -- 4. chunking changes nothing ---------------------------------------------------------
def test_chunk_size_does_not_change_results() -> None:
    job = make_job()
    weights = job.initial_weights()
    tasks = mixed_tasks(job) + [FitTask(i, {"seed": 100 + i, "lr": 0.01 * (i + 1)})
                                for i in range(5)]
    runs = {size: list(VectorizedFitter.from_job(job, chunk_size=size).fit(weights, tasks))
            for size in (1, 3, len(tasks) + 2)}
    for size in (1, 3):
        for ours, theirs in zip(runs[size], runs[len(tasks) + 2], strict=True):
            assert isinstance(theirs, FitOutput)
            assert_same_fit(ours, theirs)
    # the per-task learning rates are honoured inside one chunk too
    assert_same_fit(runs[len(tasks) + 2][-1], reference(job, weights, tasks[-1]))


# -- 5. refusals ----------------------------------------------------------------------------
class Branching(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


class Noisy(Branching):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + torch.randn_like(x))


class Counting(Branching):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.get_buffer("calls").add_(1)
        return self.linear(x)


class Tied(Branching):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.second(self.first(x)))


def sequential(*middle: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 16), *middle, torch.nn.Linear(16, 10))


class Centred(Branching):
    """Subtracts the batch's mean: each example's output depends on the others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x - x.mean(0))


@pytest.mark.parametrize(("model", "reason"), [
    (sequential(torch.nn.BatchNorm1d(16)), "BatchNorm1d at '1' keeps running statistics"),
    (sequential(torch.nn.BatchNorm1d(16, track_running_stats=False)),
     "BatchNorm1d at '1' normalises over the batch"),
    (Centred(), "output for one example changes with the other examples of its batch"),
    (sequential(torch.nn.Dropout(0.2)), "Dropout at '1' draws random masks"),
    (Branching(), "data-dependent control flow"),
    (Noisy(), "draws random numbers"),
    (Counting(), "buffer 'calls' changes during a training step"),
    (Tied(), "'second.weight' is a parameter shared under several names"),
])
def test_models_it_cannot_batch_are_refused_with_the_reason(
        model: torch.nn.Module, reason: str) -> None:
    job = make_job()
    with pytest.raises(ConfigError, match=reason) as caught:
        VectorizedFitter(model, job.clients, batch_size=16, lr=0.05, momentum=0.9)
    assert caught.value.setting == "model"
    assert 'engine = "local"' in str(caught.value)


def test_per_example_normalisation_and_idle_dropout_train_as_alone() -> None:
    """LayerNorm normalises each example on its own, so padded short batches (batch
    size 16 over shares of 5 to 129 examples) change nothing: each task's weights are
    its `TorchClient`'s alone."""
    job = make_job()
    model = sequential(torch.nn.LayerNorm(16), torch.nn.Dropout(0.0))
    fitter = VectorizedFitter(model, job.clients, batch_size=16, lr=0.05, momentum=0.9,
                              seed=job.scenario.seed)
    weights = Weights({k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
    tasks = mixed_tasks(job)
    assert any(sizes(job)[task.index] % 16 for task in tasks)  # some batch is padded
    for ours, task in zip(fitter.fit(weights, tasks), tasks, strict=True):
        data = job.clients[task.index]
        alone = make_torch_client(data.x, data.y, batch_size=16, lr=0.05, momentum=0.9,
                                  seed=job.scenario.seed, model=copy.deepcopy(model))
        assert_same_fit(ours, alone.fit(weights, dict(task.config)))


@pytest.mark.parametrize(("setting", "changes"), [
    ("chunk_size", {"chunk_size": 0}),
    ("chunk_size", {"chunk_size": True}),
    ("optimizer", {"optimizer": "rmsprop"}),
    ("batch_size", {"batch_size": 0}),
    ("momentum", {"momentum": 1.0}),
    ("lr", {"lr": 0.0}),
])
def test_bad_settings_are_refused(setting: str, changes: dict[str, Any]) -> None:
    job = make_job()
    arguments: dict[str, Any] = {"batch_size": 16, "lr": 0.05, "momentum": 0.9, **changes}
    with pytest.raises(ConfigError) as caught:
        VectorizedFitter(job.make_model(), job.clients, **arguments)
    assert caught.value.setting == setting


# -- 6. a failing task is data ------------------------------------------------------------
def test_a_failing_task_yields_its_exception_in_its_slot() -> None:
    job = make_job()
    weights = job.initial_weights()
    good = [FitTask(2, {"seed": 1}), FitTask(5, {"seed": 2}), FitTask(7, {"seed": 3})]
    tasks: Sequence[FitTask] = [good[0], FitTask(999, {"seed": 1}), good[1],
                                FitTask(4, {"seed": 4, "local_epochs": 0}), good[2]]
    results = list(VectorizedFitter.from_job(job, chunk_size=2).fit(weights, tasks))
    assert isinstance(results[1], IndexError)
    assert isinstance(results[3], ConfigError) and results[3].setting == "local_epochs"
    for ours, task in zip([results[0], results[2], results[4]], good, strict=True):
        assert_same_fit(ours, reference(job, weights, task))


def test_weights_that_do_not_fit_the_model_fail_every_task() -> None:
    job = make_job()
    wrong = Weights({"w": np.zeros(3, np.float32)})
    results = list(VectorizedFitter.from_job(job).fit(wrong, [FitTask(0, {}), FitTask(1, {})]))
    assert [type(r) for r in results] == [ValueError, ValueError]


def test_a_closed_fitter_refuses_to_fit() -> None:
    job = make_job()
    fitter = VectorizedFitter.from_job(job)
    fitter.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(fitter.fit(job.initial_weights(), [FitTask(0, {})]))


# -- 7. CUDA ----------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_cpu_results() -> None:
    job = make_job("adam")
    weights = job.initial_weights()
    tasks = mixed_tasks(job)
    on_cpu = list(VectorizedFitter.from_job(job, device="cpu").fit(weights, tasks))
    on_gpu = list(VectorizedFitter.from_job(job, device="cuda").fit(weights, tasks))
    for ours, theirs in zip(on_gpu, on_cpu, strict=True):
        assert isinstance(theirs, FitOutput)
        assert_same_fit(ours, theirs)
