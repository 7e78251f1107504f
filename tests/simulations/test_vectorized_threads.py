"""``[engine] threads``: the vectorized engine's batched computation on several torch
threads, with the results it gives on one (within its tolerance), the same on every
run, and the caller's thread count restored."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedloom.errors import ConfigError  # noqa: E402
from fedloom.simulations.runner import run_scenario  # noqa: E402
from fedloom.simulations.scenario import scenario_from_mapping  # noqa: E402
from fedloom.simulations.vectorized import VectorizedFitter  # noqa: E402


def _scenario(threads: int) -> Any:
    return scenario_from_mapping({
        "num_clients": 20, "clients_per_round": 10, "rounds": 2, "progress": False,
        "seed": 3, "local_epochs": 2,
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 2},
        "engine": {"name": "vectorized", "chunk_size": 10, "threads": threads},
    })


def test_threads_give_the_one_thread_results_and_the_same_on_every_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[int] = []
    train = VectorizedFitter._train

    def spy(self: VectorizedFitter, *args: Any) -> Any:
        used.append(torch.get_num_threads())
        return train(self, *args)

    monkeypatch.setattr(VectorizedFitter, "_train", spy)
    before = torch.get_num_threads()
    one, two, again = (run_scenario(_scenario(n), None) for n in (1, 2, 2))
    assert used == [1, 1, 2, 2, 2, 2]  # a chunk a round, on the threads asked for
    assert torch.get_num_threads() == before
    assert one.weights is not None and two.weights is not None and again.weights is not None
    for name in one.weights:
        np.testing.assert_allclose(two.weights[name], one.weights[name], rtol=1e-4, atol=1e-5)
        assert np.array_equal(two.weights[name], again.weights[name])


@pytest.mark.parametrize(("engine", "match"), [
    ({"name": "vectorized", "threads": 0}, r"engine\.threads.*at least 1"),
    ({"name": "local", "threads": 2},
     r"engine\.threads.*\"vectorized\" only, not 'local'.*threads = 1"),
    ({"name": "flower", "threads": 2}, r"engine\.threads.*not 'flower'"),
])
def test_threads_serve_the_vectorized_engine_only(engine: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        scenario_from_mapping({"engine": engine})
