"""Comparing fitters' results: the same `FitOutput`, bit for bit."""

from __future__ import annotations

import numpy as np

from fedloom.client_sdk import FitOutput


def assert_same_output(actual: FitOutput | Exception, expected: FitOutput | Exception) -> None:
    """Both are `FitOutput`s with equal weights (bit for bit), examples and metrics."""
    assert isinstance(actual, FitOutput), actual
    assert isinstance(expected, FitOutput), expected
    assert list(actual.weights) == list(expected.weights)
    for name in expected.weights:
        np.testing.assert_array_equal(actual.weights[name], expected.weights[name])
    assert actual.num_examples == expected.num_examples
    assert actual.metrics == expected.metrics
