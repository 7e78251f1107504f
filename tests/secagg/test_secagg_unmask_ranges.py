"""The server's unmasking over ranges of the vector, run by a thread pool's ``map``: the
same sums as one sequential pass, with and without dropped clients, and the plaintext
weighted sum within one quantum per client."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from secagg_driver import ids_of, make_inputs, pki, run, setup_round

from fedloom.secagg import RoundId, SecAggConfig, SecAggServer, Stage
from fedloom.secagg._unmask import RANGE_WORDS

CONFIG = SecAggConfig(enabled=True, neighbours=4, threshold=3, bits=20, max_weight=100.0,
                      max_participants=16)
LENGTH = RANGE_WORDS + 1003  # two ranges, the second partial (and not block-aligned at its end)


@pytest.mark.parametrize("drop", [False, True])
def test_threaded_ranges_unmask_exactly_like_one_pass(drop: bool) -> None:
    ids = ids_of(7)
    inputs = make_inputs(ids, LENGTH, seed=3, scale=0.5)
    drop_at = {ids[2]: Stage.MASKED_INPUT} if drop else {}
    sums = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for map_fn in (map, pool.map):
            rnd = setup_round(CONFIG, inputs, RoundId("run", 1, 7))
            rnd.server = SecAggServer(rnd.server.setup, verifier=pki().verifier,
                                      map_fn=map_fn)
            run(rnd, drop_at=drop_at)
            sums.append(rnd.server.result)
    sequential, threaded = sums
    assert np.array_equal(sequential.weighted_sum, threaded.weighted_sum)
    assert sequential.survivors == threaded.survivors
    assert (ids[2] in sequential.dropped) is drop
    survivors = [c for c in ids if c not in drop_at]
    weights = np.array([inputs[c][1] / CONFIG.max_weight for c in survivors])
    clipped = np.stack([np.clip(inputs[c][0], -CONFIG.clip_range, CONFIG.clip_range)
                        for c in survivors])
    expected = weights @ clipped
    assert np.abs(threaded.weighted_sum - expected).max() <= len(survivors) * CONFIG.quantum
    assert np.abs(threaded.weighted_sum - expected).max() > 0  # it was quantized
