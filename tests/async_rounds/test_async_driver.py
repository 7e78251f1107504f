"""Asynchronous rounds (FedBuff) on the server's real coordinator, arrivals scripted.

Each model version the server commits must equal an independent numpy statement of
FedBuff's rule over the updates in the order they arrived; the tasks it hands out must
carry the version they train on; the staleness it records must be the versions that
passed in between.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from async_support import Harness, async_config
from fedbuff import Arrival, committed_versions, fedbuff_reference

# (client, num_examples) in arrival order; 3 clients, buffer_size 2.
ORDER = [(0, 10), (1, 30), (2, 20), (0, 10), (1, 30), (2, 20), (2, 20), (0, 10)]


PARAMS = {"fedavg": {}, "fedavgm": {"server_momentum": 0.9},
          "fedadam": {"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}}


@pytest.mark.parametrize("strategy", sorted(PARAMS))
def test_versions_equal_numpy_fedbuff_over_scripted_arrivals(tmp_path: Path,
                                                              strategy: str) -> None:
    async def main() -> tuple[Harness, list[Arrival]]:
        harness = Harness(async_config(tmp_path / "state", num_rounds=4, strategy=strategy,
                                       strategy_params=PARAMS[strategy]))
        harness.start()
        arrivals: list[Arrival] = []
        try:
            for i, (client, examples) in enumerate(ORDER):
                arrivals.append(await harness.answer(client, examples))
                if (i + 1) % 2 == 0:  # a step: let it commit before the next arrival
                    await harness.committed((i + 1) // 2)
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)
        finally:
            await harness.stop()
        return harness, arrivals

    harness, arrivals = asyncio.run(main())
    # Tasks train the version current when they were issued: the first three version
    # 0, and later ones fell behind the steps taken meanwhile (staleness happened).
    assert [a.base_version for a in arrivals[:3]] == [0, 0, 0]
    assert sum(1 for i, a in enumerate(arrivals) if i // 2 > a.base_version) >= 3
    params = PARAMS[strategy]
    adam = ((params["eta"], params["beta_1"], params["beta_2"], params["tau"])
            if strategy == "fedadam" else None)
    want = fedbuff_reference(harness.initial, arrivals, buffer_size=2,
                             momentum=params.get("server_momentum", 0.0), adam=adam)
    history = harness.coordinator.history
    assert [r.num_updates for r in history] == [2, 2, 2, 2]
    on_disk = committed_versions(Path(harness.config.state_dir))
    for version in range(1, 5):
        got = on_disk[version]
        for name in got:
            np.testing.assert_allclose(got[name], want[version][name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"version {version} {name}")
        # The fit metrics' staleness is the example-weighted mean of the step's updates.
        step = arrivals[2 * (version - 1): 2 * version]
        mean = sum(a.num_examples * (version - 1 - a.base_version) for a in step) / sum(
            a.num_examples for a in step)
        assert history[version - 1].fit["staleness"] == pytest.approx(mean)
