"""`ParallelFitter` against the serial engine (each client's output bit for bit, each
round's model within a float32 ulp), its chunks, and its failure handling.

The reference is `SerialFitter` over the same job's clients, built as the local runner
builds them (one shared model, one torch thread). The workers build theirs from a
pickled copy of the job, so equal models mean the same code ran on the same data.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_fits import assert_same_output

from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.errors import ConfigError
from fedloom.simulations.fitting import FitTask, RoundFitter, SerialFitter
from fedloom.simulations.job import Job
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.parallel import ParallelFitter, chunk_sizes
from fedloom.simulations.scenario import scenario_from_mapping
from fedloom.strategies import Strategy
from fedloom.types import Config
from fedloom.weights import Weights

# 7 clients, 5 a round: 5 tasks do not divide among 2 or 3 workers.
SCENARIO = {"name": "parallel", "num_clients": 7, "clients_per_round": 5, "rounds": 3,
            "seed": 4, "progress": False}
TRAP = "trap"  # fit-config key: what a TrapClient does instead of (or before) training


class TrapClient(Client):
    """A job's client that, when its fit config asks, raises, dies, or waits for a file."""

    def __init__(self, inner: Client, index: int) -> None:
        self.inner, self.index = inner, index

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        trap = str(config.get(TRAP, ""))
        if trap == "raise":  # ConfigError does not survive pickling as itself
            raise ConfigError("lr", f"client {self.index} refuses")
        if trap == "pid":  # say which process fitted it
            out = self.inner.fit(weights, {k: v for k, v in config.items() if k != TRAP})
            return FitOutput(out.weights, out.num_examples, {**out.metrics, "pid": os.getpid()})
        if trap == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if trap.startswith("wait:"):
            deadline = time.monotonic() + 20
            while not Path(trap[5:]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never released this client")
                time.sleep(0.01)
        return self.inner.fit(weights, {k: v for k, v in config.items() if k != TRAP})

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return self.inner.evaluate(weights, config)


class TrapJob(Job):
    """A `Job` whose clients are `TrapClient`s (workers unpickle it from this module)."""

    # Any: a TrapClient is no TorchClient, which the base class promises.
    def make_client(self, index: int, model: torch.nn.Module | None = None) -> Any:
        return TrapClient(super().make_client(index, model=model), index)


@pytest.fixture(scope="module")
def job() -> TrapJob:
    made = TrapJob.from_scenario(scenario_from_mapping(SCENARIO))
    assert isinstance(made, TrapJob)
    return made


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The serial reference runs on one torch thread, as the local runner runs it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fitters(job: TrapJob) -> Iterator[dict[int | str, ParallelFitter]]:
    """One fitter per worker count, and one worker with this process training too
    (``"1+here"``), shared by the tests that leave them healthy."""
    made: dict[int | str, ParallelFitter] = {n: ParallelFitter(job, n) for n in (1, 2, 3)}
    made["1+here"] = ParallelFitter(job, 1, train_here=True)
    yield made
    for fitter in made.values():
        fitter.close()


def serial(job: Job) -> SerialFitter:
    return SerialFitter(job.client_fn())


def round_models(job: Job, strategy: Strategy, fitter: RoundFitter) -> list[Weights]:
    """The global model after each round (round 0: the initial one)."""
    models: list[Weights] = []

    def keep(_round: int, weights: Weights) -> None:
        models.append(weights.copy())

    reference = serial(job)
    run_local(strategy, reference.client_fn, job.initial_weights(),
              num_clients=job.scenario.num_clients, num_rounds=job.scenario.rounds,
              base_seed=job.scenario.seed, fit_defaults=job.fit_defaults(),
              evaluate_fn=keep, fitter=fitter)
    return models


def tasks_for(indices: list[int], traps: dict[int, str] | None = None) -> list[FitTask]:
    traps = traps or {}
    return [FitTask(i, {"seed": 100 + i, "local_epochs": 1,
                        **({TRAP: traps[i]} if i in traps else {})}) for i in indices]


@pytest.mark.parametrize("strategy_name", ["fedavg", "fedprox"])
@pytest.mark.parametrize("workers", [1, 2, 3, "1+here"])
def test_every_round_equals_the_serial_engine(
    job: TrapJob, fitters: dict[int | str, ParallelFitter], workers: int | str,
    strategy_name: str
) -> None:
    # The strategy runs in this process: the workers see only its fit configs (FedProx
    # sends proximal_mu, which changes every client's training).
    strategy_job = Job.from_scenario(scenario_from_mapping(
        {**SCENARIO, "strategy": {"name": strategy_name, "proximal_mu": 0.5}}
        if strategy_name == "fedprox" else SCENARIO))
    expected = round_models(job, strategy_job.build_strategy(), serial(job))
    actual = round_models(job, strategy_job.build_strategy(), fitters[workers])
    assert len(actual) == len(expected) == 4
    assert not np.array_equal(expected[3]["0.weight"], expected[0]["0.weight"])  # it trained
    for r, (got, want) in enumerate(zip(actual, expected, strict=True)):
        for name in want:  # the fold's float64 sums in another order: a float32 ulp
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-7,
                                       err_msg=f"round {r} {name}")
    again = round_models(job, strategy_job.build_strategy(), fitters[workers])
    for got, same in zip(actual, again, strict=True):  # deterministic for a seed
        for name in got:
            np.testing.assert_array_equal(got[name], same[name])


def test_fedprox_reference_differs_from_fedavg(job: TrapJob) -> None:
    """Keeps the FedProx case above meaningful: its proximal term changes the model."""
    fedprox = Job.from_scenario(scenario_from_mapping(
        {**SCENARIO, "strategy": {"name": "fedprox", "proximal_mu": 0.5}})).build_strategy()
    avg = round_models(job, job.build_strategy(), serial(job))
    prox = round_models(job, fedprox, serial(job))
    assert not np.array_equal(avg[1]["0.weight"], prox[1]["0.weight"])


def test_results_come_in_task_order(job: TrapJob, fitters: dict[int | str, ParallelFitter]) -> None:
    weights, tasks = job.initial_weights(), tasks_for([6, 0, 4, 2, 5, 1, 3])
    expected = list(serial(job).fit(weights, tasks))
    actual = list(fitters[3].fit(weights, tasks))
    assert len(actual) == len(tasks)
    for got, want in zip(actual, expected, strict=True):
        assert_same_output(got, want)
    # Clients hold different data, so a result in the wrong slot would differ.
    first, second = expected[0], expected[1]
    assert isinstance(first, FitOutput) and isinstance(second, FitOutput)
    assert not np.array_equal(first.weights["0.bias"], second.weights["0.bias"])


def test_first_result_arrives_while_another_worker_still_fits(
    job: TrapJob, fitters: dict[int | str, ParallelFitter], tmp_path: Path
) -> None:
    # Worker 1 fits client 1 only once this test has read client 0's result (from
    # worker 0); a fitter that waited for every worker would stall until the trap
    # gives up, and client 1's slot would hold its TimeoutError.
    release = tmp_path / "release"
    results = fitters[2].fit(job.initial_weights(),
                             tasks_for([0, 1, 2], {1: f"wait:{release}"}))
    first = next(results)
    release.touch()
    rest = list(results)
    assert isinstance(first, FitOutput)
    assert all(isinstance(r, FitOutput) for r in rest), rest


def test_a_client_exception_fills_its_slot_and_the_round_goes_on(
    job: TrapJob, fitters: dict[int | str, ParallelFitter]
) -> None:
    weights = job.initial_weights()
    tasks = tasks_for([0, 1, 2, 3, 4], {3: "raise"})
    expected = list(serial(job).fit(weights, tasks))
    actual = list(fitters[2].fit(weights, tasks))
    assert isinstance(expected[3], ConfigError)
    failed = actual[3]
    assert isinstance(failed, RuntimeError)
    assert str(failed) == "ConfigError: lr: client 3 refuses"
    assert 'raise ConfigError("lr"' in str(failed.__cause__)  # the worker's traceback
    for slot in (0, 1, 2, 4):
        assert_same_output(actual[slot], expected[slot])


def test_a_dead_worker_fails_its_tasks_and_is_replaced_for_the_next_round(
    job: TrapJob,
) -> None:
    weights = job.initial_weights()
    expected = list(serial(job).fit(weights, tasks_for([0, 1, 2, 3, 4])))
    others = set(multiprocessing.active_children())
    ours: set[int] = set()

    def note_children() -> set[multiprocessing.process.BaseProcess]:
        current = set(multiprocessing.active_children()) - others
        ours.update(p.pid for p in current if p.pid is not None)
        return current

    with ParallelFitter(job, 2) as fitter:
        note_children()
        # Chunks of 2, 1, 1 and 1 clients, all handed out at once (a small model's
        # round fits the window), least-loaded first: worker 0 gets clients 0, 1 and 3,
        # worker 1 clients 2 and 4. Worker 0 dies at its first client, so its chunks
        # fail and worker 1's stand, whatever the timing.
        results = list(fitter.fit(weights, tasks_for([0, 1, 2, 3, 4], {0: "kill"})))
        for slot in (0, 1, 3):
            assert isinstance(results[slot], RuntimeError)
            assert str(results[slot]) == (
                "worker 0 exited with code -9 while fitting clients 0, 1, 3")
        for slot in (2, 4):
            assert_same_output(results[slot], expected[slot])
        again = list(fitter.fit(weights, tasks_for([0, 1, 2, 3, 4])))
        for got, want in zip(again, expected, strict=True):
            assert_same_output(got, want)
        # A worker killed between rounds is replaced before the next one starts.
        (idle,) = [p for p in note_children() if p.name == "fedloom-fitter-0"]
        idle.kill()
        idle.join()
        after = list(fitter.fit(weights, tasks_for([0, 1, 2, 3, 4])))
        for got, want in zip(after, expected, strict=True):
            assert_same_output(got, want)
        note_children()
    assert len(ours) == 4  # two started, two replacements
    assert_reaped(ours)


def test_a_new_fit_discards_the_unread_rest_of_the_last_round(
    job: TrapJob, fitters: dict[int | str, ParallelFitter]
) -> None:
    weights = job.initial_weights()
    old = fitters[2].fit(weights, tasks_for([0, 1, 2, 3]))
    next(old)
    new_tasks = tasks_for([5, 6, 4])
    new = list(fitters[2].fit(weights, new_tasks))
    for got, want in zip(new, serial(job).fit(weights, new_tasks), strict=True):
        assert_same_output(got, want)
    with pytest.raises(RuntimeError, match="ended this round"):
        next(old)


@pytest.mark.parametrize("workers", [0, -1])
def test_fewer_than_one_worker_is_a_config_error(job: TrapJob, workers: int) -> None:
    with pytest.raises(ConfigError) as info:
        ParallelFitter(job, workers)
    assert info.value.setting == "workers"


def test_fork_is_refused(job: TrapJob) -> None:
    with pytest.raises(ConfigError) as info:
        ParallelFitter(job, 1, start_method="fork")
    assert info.value.setting == "start_method"


def test_close_reaps_workers_that_never_fitted_and_is_idempotent(job: TrapJob) -> None:
    # (The dead-worker test above closes workers that fitted, replacements included.)
    before = set(multiprocessing.active_children())
    with ParallelFitter(job, 2) as fitter:
        ours = {p.pid for p in set(multiprocessing.active_children()) - before}
        assert len(ours) == 2
    assert_reaped({pid for pid in ours if pid is not None})
    fitter.close()
    with pytest.raises(RuntimeError, match="closed"):
        fitter.fit(job.initial_weights(), tasks_for([0]))


def assert_reaped(pids: set[int]) -> None:
    """Each process has exited and was waited for: neither running nor a zombie."""
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize(("tasks", "workers", "rows", "expected"), [
    # a quarter of what is left, then less, down to a floor of 100 / 12 (and the rest)
    (100, 2, 10**6, [25, 19, 14, 11, 9, 9, 9, 4]),
    (10, 2, 10**6, [3, 2, 2, 1, 1, 1]),
    (3, 2, 10**6, [1, 1, 1]),
    (1, 4, 10**6, [1]),
    (100, 2, 7, [7] * 14 + [2]),  # the byte budget caps every chunk
    (100, 2, 1, [1] * 100),  # a large model: one client a chunk
])
def test_chunks_shrink_as_the_round_goes_on_within_the_byte_budget(
    tasks: int, workers: int, rows: int, expected: list[int]
) -> None:
    assert chunk_sizes(tasks, workers, rows) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 16), st.integers(1, 10**4))
def test_chunk_sizes_cover_the_round_and_never_grow(tasks: int, workers: int, rows: int) -> None:
    sizes = chunk_sizes(tasks, workers, rows)
    assert sum(sizes) == tasks and all(1 <= s <= rows for s in sizes)
    assert all(a >= b for a, b in itertools.pairwise(sizes))
    # The round ends on a small chunk (the floor at most), so no process is left
    # training a large one while the others wait.
    assert sizes[-1] <= math.ceil(tasks / (6 * workers))


def test_one_client_chunks_give_the_same_outputs(job: TrapJob) -> None:
    weights, tasks = job.initial_weights(), tasks_for([6, 0, 4, 2, 5, 1, 3])
    expected = list(serial(job).fit(weights, tasks))
    with ParallelFitter(job, 2, chunk_bytes=1) as fitter:
        actual = list(fitter.fit(weights, tasks))
    for got, want in zip(actual, expected, strict=True):
        assert_same_output(got, want)
    with pytest.raises(ConfigError) as info:
        ParallelFitter(job, 2, chunk_bytes=0)
    assert info.value.setting == "chunk_bytes"


def test_with_train_here_this_process_fits_while_the_worker_is_busy(
    job: TrapJob, fitters: dict[int | str, ParallelFitter], tmp_path: Path,
) -> None:
    # Chunks of two: the worker holds [0, 1] and [2, 3]; client 0 waits a second for
    # its release, and meanwhile this process fits [4, 5] and [6] itself. (A first
    # round starts both sides: the worker's imports, this process's first optimizer.)
    fitter, release = fitters["1+here"], tmp_path / "release"
    indices = [0, 1, 2, 3, 4, 5, 6]
    list(fitter.fit(job.initial_weights(), tasks_for(indices)))
    traps = {i: "pid" for i in indices[1:]} | {0: f"wait:{release}"}
    timer = threading.Timer(1.0, release.touch)
    timer.start()
    try:
        results = list(fitter.fit(job.initial_weights(), tasks_for(indices, traps)))
    finally:
        timer.cancel()
    pids = [r.metrics.get("pid") if isinstance(r, FitOutput) else r for r in results]
    worker = pids[1]
    assert worker != os.getpid()
    assert pids[1:] == [worker, worker, worker, os.getpid(), os.getpid(), os.getpid()]
    expected = list(serial(job).fit(job.initial_weights(), tasks_for(indices)))
    for got, want in zip(results, expected, strict=True):
        assert isinstance(got, FitOutput)
        assert_same_output(FitOutput(got.weights, got.num_examples,
                                     {k: v for k, v in got.metrics.items() if k != "pid"}),
                           want)
