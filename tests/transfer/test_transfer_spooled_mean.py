"""The streaming mean over spooled uploads (the server's path) against numpy.

Updates go through the server's own receive path (`Spool`: chunks, digest, finite
check) into files; `WeightedMeanAggregator` then reads them a window at a time. The
reference is a float64 numpy weighted mean computed from the same arrays in memory.
Small windows and a small own-mapping threshold make every code path run on small
tensors: several windows with a short last one, groups, the direct mean of a single
group, the in-place float64 -> float32 finalize, integer rounding, 0-d and empty.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import random_weights

from fedloom import ClientUpdate, RoundAbortedError, Weights
from fedloom.payload import BlockSource, PayloadInfo, iter_chunks, serialize
from fedloom.server.uploads import Spool, SpooledWeights
from fedloom.strategies import FedAvg, WeightedMeanAggregator
from fedloom.strategies import _mean as mean_module

SHAPES = {
    "conv": ((3, 4, 5), np.float32),  # 60 values: several windows of 7
    "half": ((9,), np.float16),
    "wide": ((6,), np.float64),
    "steps": ((), np.int64),
    "count": ((4,), np.int32),
    "scalar": ((), np.float32),
    "empty": ((0, 3), np.float32),
}


@pytest.fixture(autouse=True)
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mean_module, "WINDOW", 7)
    monkeypatch.setattr(mean_module, "OWN_MAPPING_BYTES", 64)  # "conv" gets a mapping


def make_weights(rng: np.random.Generator) -> Weights:
    return random_weights(SHAPES, rng)


def spool(folder: Path, weights: Weights) -> SpooledWeights:
    payload = serialize(weights)
    receiver = Spool(folder, PayloadInfo.describe(weights.specs(), payload), 64)
    for offset, data in iter_chunks(payload, 64):
        receiver.feed(offset, data)
    return receiver.finish()


def updates(rng: np.random.Generator, n: int) -> list[tuple[Weights, int]]:
    return [(make_weights(rng), int(rng.integers(1, 1000))) for _ in range(n)]


def reference(current: Weights, ups: list[tuple[Weights, int]]) -> dict[str, np.ndarray]:
    """current + sum(n_i * delta_i) / sum(n_i), in float64, cast back per tensor."""
    total = sum(n for _, n in ups)
    out = {}
    for name, arr in current.items():
        mean = np.sum([n * d[name].astype(np.float64) for d, n in ups], axis=0) / total
        if arr.dtype.kind in "iu":
            out[name] = arr + np.rint(mean).astype(arr.dtype)
        else:
            out[name] = (arr + mean.astype(arr.dtype)).astype(arr.dtype)
    return out


def assert_matches(got: Weights, want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        if arr.dtype.kind in "iu":
            np.testing.assert_array_equal(got[name], arr, err_msg=name)
        else:
            tol = 2e-3 if arr.dtype == np.float16 else 1e-6
            np.testing.assert_allclose(got[name], arr, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("n", [1, 3, 16, 17, 40])
def test_spooled_fedavg_equals_numpy(tmp_path: Path, n: int) -> None:
    rng = np.random.default_rng(n)
    current = make_weights(rng)
    ups = updates(rng, n)
    stream = (
        ClientUpdate(f"c{i}", spool(tmp_path, d), k, 0) for i, (d, k) in enumerate(ups)
    )
    result = FedAvg().aggregate_fit(1, current, stream)
    assert result.weights is not None
    assert_matches(result.weights, reference(current, ups))


def test_spooled_and_in_memory_paths_agree_and_mix(tmp_path: Path) -> None:
    """Both paths use exact float64 products and sums: same result, mixed or not."""
    rng = np.random.default_rng(7)
    current = make_weights(rng)
    ups = updates(rng, 20)
    in_memory = FedAvg().aggregate_fit(
        1, current, [ClientUpdate(f"c{i}", d, k, 0) for i, (d, k) in enumerate(ups)]
    )
    mixed = FedAvg().aggregate_fit(
        1,
        current,
        [
            ClientUpdate(f"c{i}", spool(tmp_path, d) if i % 3 else d, k, 0)
            for i, (d, k) in enumerate(ups)
        ],
    )
    assert in_memory.weights is not None and mixed.weights is not None
    assert_matches(mixed.weights, reference(current, ups))
    for name in current:
        np.testing.assert_allclose(mixed.weights[name], in_memory.weights[name], rtol=1e-7)


def test_arrival_order_does_not_change_the_model(tmp_path: Path) -> None:
    """A resumed round sees its updates in another order; the model must not move.

    Exact float64 products and float64 sums make float32, float16 and integer results
    identical (the float64 rounding of a sum is far below their precision); a float64
    tensor's last bits follow the order, as with any floating sum."""
    rng = np.random.default_rng(3)
    current = make_weights(rng)
    spooled = [(spool(tmp_path, d), k) for d, k in updates(rng, 6)]
    results = []
    for order in itertools.islice(itertools.permutations(range(6)), 0, 720, 97):
        ups = [ClientUpdate(f"c{i}", spooled[i][0], spooled[i][1], 0) for i in order]
        result = FedAvg().aggregate_fit(1, current, ups)
        assert result.weights is not None
        results.append(result.weights)
    for other in results[1:]:
        for name, arr in results[0].items():
            if arr.dtype == np.float64:
                np.testing.assert_allclose(other[name], arr, rtol=1e-14, err_msg=name)
            else:
                np.testing.assert_array_equal(other[name], arr, err_msg=name)


def test_spooled_updates_wait_as_files_in_bounded_groups(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    current = make_weights(rng)
    ups = [(spool(tmp_path, d), k) for d, k in updates(rng, 10)]
    assert all(isinstance(d, BlockSource) for d, _ in ups)
    open_before = len(os.listdir("/proc/self/fd"))
    aggregator = WeightedMeanAggregator(group_size=4)
    aggregator.start(current)
    for i, (d, k) in enumerate(ups):
        aggregator.accumulate(ClientUpdate(f"c{i}", d, k, 0))
        assert len(vars(aggregator)["_waiting"]) == (i + 1) % 4  # folded every 4th
    mean = aggregator.finalize()
    assert mean.delta is not None and mean.num_updates == 10
    assert len(os.listdir("/proc/self/fd")) == open_before  # every reader closed


def test_an_aborted_stream_leaves_the_strategy_usable(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    current = make_weights(rng)
    ups = updates(rng, 5)
    strategy = FedAvg()
    before = strategy.state_dict()

    def stream():  # type: ignore[no-untyped-def]
        for i, (d, k) in enumerate(ups[:3]):
            yield ClientUpdate(f"c{i}", spool(tmp_path, d), k, 0)
        raise RoundAbortedError("deadline")

    with pytest.raises(RoundAbortedError):
        strategy.aggregate_fit(1, current, stream())
    assert strategy.state_dict() == before
    again = strategy.aggregate_fit(
        2, current, [ClientUpdate("a", spool(tmp_path, d), k, 0) for d, k in ups]
    )
    assert again.weights is not None
    assert_matches(again.weights, reference(current, ups))


def test_a_truncated_spool_file_is_an_error_not_zeros(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    current = make_weights(rng)
    spooled = spool(tmp_path, make_weights(rng))
    with open(spooled._path, "r+b") as fh:  # a damaged disk
        fh.truncate(40)
    with pytest.raises(OSError, match="shorter than its layout"):
        FedAvg().aggregate_fit(1, current, [ClientUpdate("a", spooled, 3, 0)])


def _mean_with(fold_threads: int, current: Weights, spooled: list[tuple[SpooledWeights, int]],
               group_size: int = mean_module.GROUP_SIZE) -> Weights:
    aggregator = WeightedMeanAggregator(group_size=group_size, fold_threads=fold_threads)
    aggregator.start(current)
    for i, (d, k) in enumerate(spooled):
        aggregator.accumulate(ClientUpdate(f"c{i}", d, k, 0))
    mean = aggregator.finalize()
    assert mean.delta is not None
    return mean.delta


@pytest.mark.parametrize("group_size", [3, mean_module.GROUP_SIZE])  # running sums, direct
def test_threaded_fold_equals_one_thread_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group_size: int
) -> None:
    """Threads take runs of one window from a shared queue: every element is still
    summed the same way, so the mean is identical, not merely close."""
    monkeypatch.setattr(mean_module, "MIN_WINDOWS_PER_THREAD", 1)
    monkeypatch.setattr(mean_module, "WINDOWS_PER_TAKE", 1)
    rng = np.random.default_rng(13)
    current = make_weights(rng)
    ups = updates(rng, 20)  # two blocks of BLOCK_ROWS rows
    spooled = [(spool(tmp_path, d), k) for d, k in ups]
    one = _mean_with(1, current, spooled, group_size)
    for threads in (2, 3):
        many = _mean_with(threads, current, spooled, group_size)
        for name, arr in one.items():
            np.testing.assert_array_equal(many[name], arr, err_msg=f"{name}, {threads} threads")


def test_a_threaded_fold_reports_a_thread_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mean_module, "MIN_WINDOWS_PER_THREAD", 1)
    monkeypatch.setattr(mean_module, "WINDOWS_PER_TAKE", 1)
    rng = np.random.default_rng(2)
    current = make_weights(rng)
    spooled = spool(tmp_path, make_weights(rng))
    with open(spooled._path, "r+b") as fh:  # the tail of "conv" is gone
        fh.truncate(120)
    with pytest.raises(OSError, match="shorter than its layout"):
        _mean_with(2, current, [(spooled, 3)])


def test_fold_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="fold_threads"):
        WeightedMeanAggregator(fold_threads=0)
    assert 1 <= WeightedMeanAggregator().fold_threads <= mean_module.MAX_FOLD_THREADS
