"""How `ParallelFitter` deals a round's chunks to its workers (`parallel._Schedule`),
with stand-in workers whose chunks finish when the test says: least-loaded first, at
most two in flight each, no further ahead than the window, in task order whatever
order they finish in, and the chunks of a dead worker failed while the rest go on."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from fedloom.simulations import parallel
from fedloom.simulations._parallel_worker import Taken
from fedloom.simulations.fitting import FitTask


class FakeWorker:
    """A worker whose chunks finish when `finish` says (or all fail with `die`)."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.pending: collections.deque[tuple[int, list[FitTask]]] = collections.deque()
        self.given: list[int] = []
        self.finished: set[int] = set()
        self.failure = ""
        self.waitables = [object()]

    @property
    def exited(self) -> bool:
        return bool(self.failure)

    def assign(self, chunk: int, tasks: list[FitTask]) -> None:
        self.pending.append((chunk, tasks))
        self.given.append(chunk)

    def ready(self) -> bool:
        return bool(self.failure) or (bool(self.pending) and self.pending[0][0] in self.finished)

    def take(self) -> list[Taken]:
        if self.failure:
            failed = [Taken(c, None, self.failure) for c, _ in self.pending]
            self.pending.clear()
            return failed
        chunk, _ = self.pending.popleft()
        return [Taken(chunk, f"chunk {chunk}".encode())]

    def die(self) -> None:
        clients = ", ".join(str(t.index) for _, tasks in self.pending for t in tasks)
        self.failure = f"worker {self.number} exited with code -9 while fitting clients {clients}"


class Script:
    """Finishes chunks as a real round would, in an order the test picks: each time the
    schedule waits, the next step of ``steps`` runs (a chunk finishes, or a worker dies)."""

    def __init__(self, workers: list[FakeWorker], steps: list[tuple[str, int]]) -> None:
        self.workers, self.steps = workers, collections.deque(steps)

    def wait(self, objects: list[Any], timeout: float | None = None) -> list[Any]:
        while timeout is None and not any(
                w.ready() for w in self.workers if w.waitables[0] in objects):
            kind, value = self.steps.popleft()
            if kind == "finish":
                next(w for w in self.workers if value in w.given).finished.add(value)
            else:
                self.workers[value].die()
        return [w.waitables[0] for w in self.workers if w.ready()]


def chunks(n: int) -> list[list[FitTask]]:
    return [[FitTask(i, {})] for i in range(n)]


def run(monkeypatch: pytest.MonkeyPatch, workers: list[FakeWorker], n: int,
        steps: list[tuple[str, int]], local: Any = None) -> list[Taken]:
    monkeypatch.setattr(parallel, "wait", Script(workers, steps).wait)
    window = 2 * (len(workers) + (local is not None))
    schedule = parallel._Schedule(workers, chunks(n), window, local)  # type: ignore[arg-type]
    return [schedule.next()[1] for _ in range(n)]


class Here:
    """This process's trainer: records which chunks (by first client) it trained."""

    def __init__(self) -> None:
        self.trained: list[int] = []

    def __call__(self, tasks: list[FitTask]) -> str:
        self.trained.append(tasks[0].index)
        return f"here {tasks[0].index}"


def test_this_process_trains_the_next_chunk_while_the_one_it_needs_is_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers, here = [FakeWorker(0)], Here()
    steps = [("finish", c) for c in (0, 1, 4, 5)]
    taken = run(monkeypatch, workers, 6, steps, local=here)
    assert [t.chunk for t in taken] == list(range(6))
    assert here.trained == [2, 3]  # while chunk 0 was out, up to the window
    assert workers[0].given == [0, 1, 4, 5]
    assert [t.message for t in taken] == [b"chunk 0", b"chunk 1", "here 2", "here 3",
                                          b"chunk 4", b"chunk 5"]


def test_with_every_worker_gone_this_process_trains_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers, here = [FakeWorker(0)], Here()
    taken = run(monkeypatch, workers, 6, [("die", 0)], local=here)
    assert [t.message is None for t in taken] == [True, True, False, False, False, False]
    assert taken[0].failure == "worker 0 exited with code -9 while fitting clients 0, 1"
    assert here.trained == [2, 3, 4, 5]


def test_chunks_go_least_loaded_first_within_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = [FakeWorker(0), FakeWorker(1)]
    monkeypatch.setattr(parallel, "wait", Script(workers, []).wait)
    schedule = parallel._Schedule(workers, chunks(9), window=4)  # type: ignore[arg-type]
    assert [w.given for w in workers] == [[0, 2], [1, 3]]  # two each, four ahead at most
    assert schedule.assigned == 4


def test_an_idle_worker_takes_the_next_chunk_and_results_keep_task_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = [FakeWorker(0), FakeWorker(1)]
    # Worker 0 is slow: worker 1 finishes chunks 1 and 3 before chunk 0 is done, then
    # waits (the window: four chunks ahead of the one the engine reads).
    steps = [("finish", 1), ("finish", 3), ("finish", 0)]
    monkeypatch.setattr(parallel, "wait", Script(workers, steps).wait)
    schedule = parallel._Schedule(workers, chunks(9), window=4)  # type: ignore[arg-type]
    _, first = schedule.next()
    assert first.chunk == 0 and first.message == b"chunk 0"
    assert workers[1].given == [1, 3, 4]  # the idle worker, not the next in turn
    assert workers[0].given == [0, 2]
    _, second = schedule.next()  # finished long ago: no wait
    assert second.chunk == 1
    assert workers[0].given == [0, 2, 5]  # both hold one now: the lower number


def test_every_chunk_comes_back_in_task_order_whatever_order_they_finish_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = [FakeWorker(0), FakeWorker(1), FakeWorker(2)]
    steps = [("finish", c) for c in (2, 1, 5, 0, 4, 3, 8, 7, 6, 9, 11, 10)]
    taken = run(monkeypatch, workers, 12, steps)
    assert [t.chunk for t in taken] == list(range(12))
    assert all(t.message == f"chunk {t.chunk}".encode() for t in taken)
    assert sorted(c for w in workers for c in w.given) == list(range(12))


def test_a_dead_workers_chunks_fail_and_the_others_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = [FakeWorker(0), FakeWorker(1)]
    steps = [("finish", 0), ("die", 0), ("finish", 1), ("finish", 3), ("finish", 5),
             ("finish", 6)]
    taken = run(monkeypatch, workers, 7, steps)
    failed = [t.chunk for t in taken if t.message is None]
    assert failed == [2, 4]  # what worker 0 held when it died
    assert taken[2].failure == "worker 0 exited with code -9 while fitting clients 2, 4"
    assert all(t.message is not None for t in taken if t.chunk not in (2, 4))
    assert workers[1].given == [1, 3, 5, 6]


def test_chunks_nobody_is_left_to_fit_fail_with_the_reasons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = [FakeWorker(0)]
    taken = run(monkeypatch, workers, 4, [("finish", 0), ("die", 0)])
    assert taken[0].message == b"chunk 0"
    assert [t.failure for t in taken[1:3]] == [
        "worker 0 exited with code -9 while fitting clients 1, 2"] * 2
    assert taken[3].message is None
    assert taken[3].failure == ("no worker left to fit clients 3 (worker 0 exited with "
                                "code -9 while fitting clients 1, 2)")


def test_the_window_counts_tasks_so_small_chunks_go_out_further_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The window bounds the tasks (weights) handed out ahead of the chunk the engine
    # reads next, not the chunks: five tasks are three chunks of 3, then 1 and 1, and
    # the chunk the engine reads next always goes out, whatever its size.
    workers = [FakeWorker(0), FakeWorker(1), FakeWorker(2)]
    sized = [[FitTask(i, {}) for i in range(n)] for n in (3, 1, 1, 2, 6)]
    steps = [("finish", 0), ("finish", 1), ("finish", 2), ("finish", 3)]
    monkeypatch.setattr(parallel, "wait", Script(workers, steps).wait)
    schedule = parallel._Schedule(workers, sized, window=5)  # type: ignore[arg-type]
    assert [w.given for w in workers] == [[0], [1], [2]]  # 3 + 1 + 1 tasks
    schedule.next()  # chunk 0 read: chunks 1..3 hold 4 tasks; chunk 4 would make 10
    assert [w.given for w in workers] == [[0, 3], [1], [2]]
    for _ in range(3):
        schedule.next()
    assert [w.given for w in workers] == [[0, 3, 4], [1], [2]]  # alone, over the window
