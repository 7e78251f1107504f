"""The in-process rows of `simulation.py`: the bare PyTorch loop and fedloom's engines.

- **bare PyTorch loop** (the limit): the same fits with nothing around them — tensors
  preloaded, the same MLP, per client: load the global weights into the module, a
  fresh SGD (lr 0.05, momentum 0.9), one shuffled epoch at batch 32 with its loss read
  back (as every engine reports ``train_loss``), then the update added into a torch
  running mean. No configs, no metrics, no layout checks, no float64 sums;
- **bare PyTorch loop (N processes)** (the parallel engine's limit): the bare loop in
  ``--workers`` spawned processes, each on its share of every round's clients, started
  together, with nothing sent between them;
- **local engine**: `run_local` with `LeanFitter`, as `fedloom simulate` runs it: one
  client after another on the module they share (the clients built before the timed
  rounds, as the bare loop's tensors are);
- **parallel engine**: `run_local` with `ParallelFitter` as `fedloom simulate` builds it
  for ``workers = --workers``: this process and ``--workers - 1`` worker processes,
  warmed by one untimed fit of every client;
- **vectorized engine**: `run_local` with `VectorizedFitter` (``torch.func``), on one
  torch thread, and (row "vectorized-threads") on ``--workers`` threads, as
  ``[engine] threads`` runs it.

Every fedloom row runs the same FedAvg over the same job as the Flower rows; each
phase times the rounds after its first, as `Phase` does for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, Literal

import numpy as np
import torch

from fedloom.simulations.fitting import FitTask, RoundFitter
from fedloom.simulations.history import RoundRecord
from fedloom.simulations.job import Job
from fedloom.simulations.lean import LeanFitter
from fedloom.simulations.local_engine import run_local
from fedloom.strategies import FedAvg, SelectionConfig


class Phase:
    """Timestamps of round ends for one (engine, clients-per-round) phase."""

    def __init__(self, engine: str, per_round: int) -> None:
        self.engine, self.per_round = engine, per_round
        self.start = time.perf_counter()
        self.ends: list[float] = []

    def round_done(self, *_: Any) -> None:
        self.ends.append(time.perf_counter())

    def result(self) -> dict[str, Any]:
        rounds = len(self.ends)
        if rounds < 2:
            raise ValueError("a phase needs at least 2 rounds (round 1 is warm-up)")
        steady_s = self.ends[-1] - self.ends[0]
        return {
            "engine": self.engine,
            "clients_per_round": self.per_round,
            "rounds": rounds,
            "first_round_s": self.ends[0] - self.start,
            "steady_s": steady_s,
            "steady_fits_per_s": (rounds - 1) * self.per_round / steady_s,
            "first_round_end": self.ends[0],
        }


def bare_loop_phase(job: Job, per_round: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """The limit: the phase's fits in a plain PyTorch loop (see the module docstring)."""
    n = job.scenario.num_clients
    data = [(torch.from_numpy(c.x), torch.from_numpy(c.y)) for c in job.clients]
    model = job.make_model()
    params = list(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    batch, generator = job.scenario.client.batch_size, torch.Generator()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        global_params = [p.detach().clone() for p in params]
    phase = Phase("bare PyTorch loop", per_round)
    for server_round in range(rounds):
        sums = [torch.zeros_like(p) for p in params]
        total = 0
        for index in rng.choice(n, per_round, replace=False):
            x, y = data[index]
            with torch.no_grad():
                for p, g in zip(params, global_params, strict=True):
                    p.copy_(g)
            optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
            generator.manual_seed(server_round * n + int(index))
            order = torch.randperm(len(y), generator=generator)
            train_loss = 0.0
            for start in range(0, len(y), batch):
                rows = order[start:start + batch]
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x[rows]), y[rows])
                loss.backward()
                optimizer.step()
                train_loss += float(loss.detach()) * len(rows)
            with torch.no_grad():
                for s, p, g in zip(sums, params, global_params, strict=True):
                    s.add_(p - g, alpha=len(y))
            total += len(y)
        with torch.no_grad():
            for g, s in zip(global_params, sums, strict=True):
                g.add_(s / total)
        phase.round_done()
    return phase.result()


def _bare_share(job: Job, per_round: int, rounds: int, seed: int) -> dict[str, Any]:
    """One process's part of `bare_processes_phase` (a worker's task)."""
    torch.set_num_threads(1)
    return bare_loop_phase(job, per_round, rounds, seed)


def bare_processes_phase(job: Job, per_round: int, rounds: int, pool: Any, processes: int
                         ) -> dict[str, Any]:
    """What ``processes`` cores give the bare loop: as many processes (``pool``'s), each
    running `bare_loop_phase` on its share of every round's clients, with nothing
    between them (no weights sent, no aggregate). The parallel engine's limit on this
    machine: cores that other work shares scale less than their number. Fits per second
    are all the processes' steady fits over the longest steady time."""
    share = max(1, per_round // processes)
    futures = [pool.submit(_bare_share, job, share, rounds, seed)
               for seed in range(processes)]
    parts = [f.result() for f in futures]
    steady_s = max(p["steady_s"] for p in parts)
    return {
        "engine": f"bare PyTorch loop ({processes} processes)",
        "clients_per_round": per_round,
        "rounds": rounds,
        "first_round_s": max(p["first_round_s"] for p in parts),
        "steady_s": steady_s,
        "steady_fits_per_s": (rounds - 1) * share * processes / steady_s,
        "first_round_end": min(p["first_round_end"] for p in parts),
    }


def engine_phase(
    job: Job, name: str, fitter: RoundFitter | Literal["lean"], per_round: int, rounds: int
) -> dict[str, Any]:
    """``rounds`` of FedAvg over ``per_round`` sampled clients with ``fitter``
    (``"lean"``: the local engine's, over clients sharing one module)."""
    n = job.scenario.num_clients
    client_fn = job.client_fn()
    if fitter == "lean":
        fitter = LeanFitter(client_fn)
        for index in range(n):  # built before the timed rounds, as the bare loop's tensors
            client_fn(index)
    phase = Phase(name, per_round)

    def on_round(record: RoundRecord) -> None:
        if record.round > 0:
            phase.round_done()

    run_local(
        FedAvg(selection=SelectionConfig(fraction_fit=per_round / n, min_fit_clients=per_round,
                                         fraction_evaluate=0.0, seed=0)),
        client_fn, job.initial_weights(), num_clients=n, num_rounds=rounds,
        fit_defaults=job.fit_defaults(), on_round=on_round, fitter=fitter,
    )
    return phase.result()


def threaded_phase(threads: int, *args: Any) -> dict[str, Any]:
    """`engine_phase` with ``threads`` torch threads (every other row runs on one)."""
    torch.set_num_threads(threads)
    try:
        return engine_phase(*args)
    finally:
        torch.set_num_threads(1)


#: The in-process rows, by the name ``--engines`` gives them ("bare-processes": the
#: bare loop in ``--workers`` processes, the parallel engine's limit).
IN_PROCESS = ("bare", "bare-processes", "local", "parallel", "vectorized",
              "vectorized-threads")


def in_process_phases(
    job: Job, plan: list[tuple[int, int]], repeats: int, workers: int, chunk_size: int,
    engines: Collection[str] = IN_PROCESS,
) -> list[dict[str, Any]]:
    """Each in-process row of ``engines`` for each (clients per round, rounds) of
    ``plan``, the rows alternating within each repeat so load changes hit them alike."""
    import concurrent.futures
    import multiprocessing

    from fedloom.simulations.parallel import ParallelFitter
    from fedloom.simulations.vectorized import VectorizedFitter

    torch.set_num_threads(1)
    pool = (concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"))
        if "bare-processes" in engines else None)
    if pool is not None:  # start the processes (import torch) untimed
        list(pool.map(_bare_share, [job] * workers, [1] * workers, [2] * workers,
                      range(workers)))
    parallel = (ParallelFitter(job, workers - 1, train_here=True)
                if "parallel" in engines else None)
    if parallel is not None:  # start the workers (import torch, build clients) untimed
        warm = [FitTask(i, {"seed": i}) for i in range(job.scenario.num_clients)]
        list(parallel.fit(job.initial_weights(), warm))
    vectorized = (VectorizedFitter.from_job(job, chunk_size=chunk_size)
                  if {"vectorized", "vectorized-threads"} & set(engines) else None)
    parallel_name = f"parallel engine ({workers} processes)"
    rows: list[tuple[str, Callable[[int, int], dict[str, Any]]]] = [
        ("bare", lambda k, r: bare_loop_phase(job, k, r)),
        ("bare-processes", lambda k, r: bare_processes_phase(job, k, r, pool, workers)),
        ("local", lambda k, r: engine_phase(job, "local engine", "lean", k, r)),
        ("parallel", lambda k, r: engine_phase(job, parallel_name, parallel, k, r)),
        ("vectorized", lambda k, r: engine_phase(job, "vectorized engine", vectorized, k, r)),
        ("vectorized-threads", lambda k, r: threaded_phase(
            workers, job, f"vectorized engine ({workers} threads)", vectorized, k, r)),
    ]
    rows = [(name, run) for name, run in rows if name in engines]
    results = []
    try:
        for rep in range(repeats):
            for _, run in rows if rep % 2 == 0 else rows[::-1]:
                for per_round, rounds in plan:
                    results.append(run(per_round, rounds))
    finally:
        for fitter in (parallel, vectorized):
            if fitter is not None:
                fitter.close()
        if pool is not None:
            pool.shutdown()
    return results
