"""`FitOutput` and `EvaluateOutput` check what a `Client` returns when they are made, so
that a wrong one fails its task with a message naming the fix, not the SDK later on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedloom.client_sdk import FitOutput
from fedloom.weights import Weights


@pytest.mark.parametrize("weights", [{"w": np.zeros(3)}, [np.zeros(3)], np.zeros(3)],
                         ids=["dict", "list", "array"])
def test_fit_weights_that_are_not_weights_are_refused_naming_the_wrap(weights: Any) -> None:
    with pytest.raises(TypeError, match=r"FitOutput.weights must be a fedloom.weights.Weights, "
                                        r"not \w+: wrap the arrays, FitOutput\(Weights\(arrays\)"):
        FitOutput(weights, 10)
    wrapped = FitOutput(Weights({"w": np.zeros(3)}), 10)
    assert list(wrapped.weights) == ["w"]
