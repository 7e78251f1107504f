"""`run_scenario`: run a `Scenario` on its engine and write its history, plot and model.

>>> from fedloom.simulations.scenario import Scenario
>>> history = run_scenario(Scenario(num_clients=4, clients_per_round=2, rounds=1,
...                                 progress=False), out_dir=None)
>>> [r.round for r in history.rounds]
[0, 1]

With ``out_dir`` set it writes ``history.json``, ``history.csv``, ``history.png`` and
``final.safetensors`` there (see `fedloom.simulations.history`). Every run is timed on
the scenario's virtual clock (``[speed]``, ``over_selection``); ``[rounds] mode =
"async"`` runs FedBuff (`fedloom.simulations.local_async`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from fedloom.client_sdk.torch_trainer import TorchClient
from fedloom.simulations.clock import SyncClock
from fedloom.simulations.compression import SimulatedCompression
from fedloom.simulations.fitting import RoundFitter
from fedloom.simulations.history import History, RoundRecord, prepare_out_dir
from fedloom.simulations.job import Job
from fedloom.simulations.local_async import run_local_async
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.scenario import Scenario
from fedloom.strategies import Strategy
from fedloom.types import Metrics
from fedloom.weights import Weights

if TYPE_CHECKING:  # flwr is optional (fedloom[flower]); the local engine runs without it
    from flwr.app import Context
    from flwr.clientapp import ClientApp

logger = logging.getLogger(__name__)


def run_scenario(scenario: Scenario, out_dir: str | Path | None,
                 on_round: Callable[[RoundRecord], None] | None = None, *,
                 out_setting: str = "out_dir") -> History:
    """Run ``scenario`` on ``scenario.engine`` and, when ``out_dir`` is given, write
    history.json, history.csv, history.png and final.safetensors there. ``on_round``
    is called with each finished round's record (after the progress display).

    An ``out_dir`` is created (or refused, naming ``out_setting``) once the scenario
    is built, before the run starts (a refused scenario leaves none); result files of an
    earlier run there are replaced, with a warning naming them. A run stopped by
    Ctrl-C or an error writes the rounds it finished, and the model after the last of
    them, to ``out_dir`` before the exception goes on, with a note on it saying so.

    Raises:
        ConfigError: when the scenario cannot be built (unknown strategy setting, a
            partition that leaves a client too few examples...), or ``out_dir`` cannot
            be created or written.
    """
    job = Job.from_scenario(scenario)
    strategy = job.build_strategy()  # validate before anything starts
    initial = job.initial_weights()
    if out_dir is not None:  # a folder that cannot take the results fails before training
        replaced = prepare_out_dir(out_dir, out_setting)
        if replaced:
            logger.warning("%s: this run replaces %s of an earlier run", out_dir,
                           ", ".join(replaced))

    def evaluate(_round: int, weights: Weights) -> Metrics:
        return job.central_evaluate(weights)

    so_far = History(scenario.engine, weights=initial, scenario=scenario.to_dict())
    started = time.perf_counter()
    try:
        with _progress(scenario) as show:
            def each_round(record: RoundRecord) -> None:
                so_far.rounds.append(record)
                show(record)
                if on_round is not None:
                    on_round(record)

            def keep(weights: Weights) -> None:
                so_far.weights = weights

            if scenario.engine != "flower":
                history = _run_local(job, strategy, initial, evaluate, each_round, keep)
            else:
                history = _run_flower(job, strategy, initial, evaluate, each_round, keep)
    except BaseException as exc:  # Ctrl-C or an error mid-run: keep the finished rounds
        if out_dir is not None and so_far.rounds:
            so_far.wall_s = time.perf_counter() - started
            _write_so_far(so_far, out_dir, exc)
        raise
    history.scenario = scenario.to_dict()
    if out_dir is not None:
        history.write(out_dir)
    return history


def _write_so_far(so_far: History, out_dir: str | Path, exc: BaseException) -> None:
    """Write the rounds a stopped run finished, and its model after the last of them,
    and say so in a note on ``exc`` (the CLI prints it; a traceback shows it)."""
    last = so_far.rounds[-1].round
    try:
        so_far.write(out_dir)
    except Exception as failure:  # the run's own error stays the one raised
        exc.add_note(f"its results so far could not be written to {out_dir}: {failure}")
        return
    exc.add_note(f"rounds 0..{last} and the model after round {last} are written "
                 f"to {out_dir}/")


def _run_local(
    job: Job, strategy: Strategy, initial: Weights,
    evaluate: Callable[[int, Weights], Metrics], on_round: Callable[[RoundRecord], None],
    on_model: Callable[[Weights], None],
) -> History:
    scenario = job.scenario
    client_fn = job.client_fn()  # fits run one at a time: one module serves every client

    secure = None
    if scenario.secure_aggregation.enabled:  # SecAgg+ in-process
        from fedloom.simulations.local_secure import LocalSecureAggregation

        secure = LocalSecureAggregation(scenario.secure_aggregation, scenario.secure_dropout,
                                        run_id=scenario.name, seed=scenario.seed)
    threads = torch.get_num_threads()
    # One thread per client, as Ray's actors run (OMP_NUM_THREADS=1): the same kernels
    # on every engine; the vectorized engine's batched computation may use more.
    torch.set_num_threads(scenario.engine_options.threads)
    try:
        if scenario.rounds_config.asynchronous:
            return run_local_async(
                strategy, client_fn, initial,
                num_clients=scenario.num_clients, num_rounds=scenario.rounds,
                rounds=scenario.rounds_config, speed=scenario.speed_model(),
                base_seed=scenario.seed, fit_defaults=job.fit_defaults(),
                evaluate_fn=evaluate, on_round=on_round, on_model=on_model,
            )
        fitter = make_fitter(job, client_fn)
        try:
            history = run_local(
                strategy, client_fn, initial,
                num_clients=scenario.num_clients, num_rounds=scenario.rounds,
                base_seed=scenario.seed, fit_defaults=job.fit_defaults(),
                evaluate_fn=evaluate, on_round=on_round, on_model=on_model,
                secure_aggregation=secure,
                clock=sync_clock(scenario),
                evaluate_every=scenario.rounds_config.evaluate_every, fitter=fitter,
                compression=SimulatedCompression(scenario.compression, scenario.seed),
            )
        finally:
            fitter.close()
        history.engine = scenario.engine
        return history
    finally:
        torch.set_num_threads(threads)


def make_fitter(job: Job, client_fn: Callable[[int], TorchClient]) -> RoundFitter:
    """How the scenario's engine trains a round's clients (`fedloom.simulations.fitting`):
    vectorized, over this process and worker processes, or one after another in this
    process (on the module they share, `fedloom.simulations.lean`)."""
    scenario = job.scenario
    if scenario.engine == "vectorized":
        from fedloom.simulations.vectorized import VectorizedFitter

        return VectorizedFitter.from_job(job, chunk_size=scenario.engine_options.chunk_size)
    if scenario.engine_options.workers > 1:  # this process trains too: N processes in all
        from fedloom.simulations.parallel import ParallelFitter

        return ParallelFitter(job, scenario.engine_options.workers - 1, train_here=True)
    from fedloom.simulations.lean import LeanFitter

    return LeanFitter(client_fn)


def sync_clock(scenario: Scenario) -> SyncClock:
    """The virtual clock of the scenario's synchronous rounds (either engine)."""
    return SyncClock(scenario.speed_model(), over_selection=scenario.over_selection,
                     seed=scenario.seed)


def job_client_app(job: Job) -> ClientApp:
    """A Flower ``ClientApp`` serving the job's clients (one torch thread each)."""
    from fedloom.simulations.flower_client import partition_id, to_client_app

    cache: dict[int, TorchClient] = {}  # per Ray worker process, once unpickled

    def client_fn(context: Context) -> TorchClient:
        torch.set_num_threads(1)
        index = partition_id(context)
        if index not in cache:
            cache[index] = job.make_client(index)
        return cache[index]

    return to_client_app(client_fn)


def _run_flower(
    job: Job, strategy: Strategy, initial: Weights,
    evaluate: Callable[[int, Weights], Metrics], on_round: Callable[[RoundRecord], None],
    on_model: Callable[[Weights], None],
) -> History:
    from fedloom.simulations.flower_engine import run_flower

    scenario, flower = job.scenario, job.scenario.flower
    quiet = scenario.progress and not flower.verbose
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if quiet:
        flwr_logger.setLevel(logging.WARNING)
    try:
        return run_flower(
            strategy, job_client_app(job), initial,
            num_clients=scenario.num_clients, num_rounds=scenario.rounds,
            base_seed=scenario.seed, fit_defaults=job.fit_defaults(),
            evaluate_fn=evaluate, on_round=on_round, on_model=on_model,
            backend_config=flower.backend_config(), timeout_s=flower.timeout_s,
            verbose=flower.verbose, clock=sync_clock(scenario),
            evaluate_every=scenario.rounds_config.evaluate_every,
            compression=SimulatedCompression(scenario.compression, scenario.seed),
        )
    finally:
        flwr_logger.setLevel(level)


def _describe(record: RoundRecord) -> str:
    parts = [f"round {record.round}"]
    for key, label in (("test_accuracy", "acc"), ("test_loss", "loss"),
                       ("train_loss", "train"), ("num_failures", "failed"),
                       ("virtual_time_s", "virtual s")):
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{label} {value:.4f}")
        elif isinstance(value, int) and value:
            parts.append(f"{label} {value}")
    return " · ".join(parts)


@contextlib.contextmanager
def _progress(scenario: Scenario) -> Iterator[Callable[[RoundRecord], None]]:
    """A rich progress bar over the rounds; yields the engine's ``on_round``."""
    if not scenario.progress:
        yield lambda _record: None
        return
    progress = Progress(
        TextColumn(f"[bold]{scenario.name}[/] ({scenario.engine})"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    with progress:
        task = progress.add_task("starting", total=scenario.last_round)

        def on_round(record: RoundRecord) -> None:
            progress.update(task, completed=record.round, description=_describe(record))

        yield on_round
