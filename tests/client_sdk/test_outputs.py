"""`FitOutput` and `EvaluateOutput` check what a `Client` returns when they are made, so
that a wrong one fails its task with a message naming the fix, not the SDK later on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedloom.client_sdk import EvaluateOutput, FitOutput
from fedloom.weights import Weights


@pytest.mark.parametrize("weights", [{"w": np.zeros(3)}, [np.zeros(3)], np.zeros(3)],
                         ids=["dict", "list", "array"])
def test_fit_weights_that_are_not_weights_are_refused_naming_the_wrap(weights: Any) -> None:
    with pytest.raises(TypeError, match=r"FitOutput.weights must be a fedloom.weights.Weights, "
                                        r"not \w+: wrap the arrays, FitOutput\(Weights\(arrays\)"):
        FitOutput(weights, 10)
    wrapped = FitOutput(Weights({"w": np.zeros(3)}), 10)
    assert list(wrapped.weights) == ["w"]


def _fit(num_examples: Any) -> FitOutput:
    return FitOutput(Weights({"w": np.zeros(3)}), num_examples)


def _evaluate(num_examples: Any) -> EvaluateOutput:
    return EvaluateOutput(0.5, num_examples)


@pytest.mark.parametrize("make", [_fit, _evaluate], ids=["fit", "evaluate"])
@pytest.mark.parametrize("count", [10, np.int64(10), np.int32(10), np.uint8(10)],
                         ids=["int", "int64", "int32", "uint8"])
def test_num_examples_takes_a_numpy_integer_as_a_python_int(make: Any, count: Any) -> None:
    """``len`` of an array or a numpy sum is a count: both outputs take it, as an int."""
    out = make(count)
    assert out.num_examples == 10 and type(out.num_examples) is int


@pytest.mark.parametrize("make", [_fit, _evaluate], ids=["fit", "evaluate"])
@pytest.mark.parametrize("count", [10.5, 10.0, np.float64(10.0), True, np.True_, "10", None],
                         ids=["float", "whole float", "float64", "bool", "numpy bool", "str",
                              "none"])
def test_num_examples_that_is_not_an_integer_is_refused_naming_the_fix(
        make: Any, count: Any) -> None:
    """Refused whatever its value: a float count used to fail the push, outside the
    task's error handling, and end the client's run."""
    with pytest.raises(TypeError, match=r"Output.num_examples must be an int, not \w+ "
                                        r"\(.*\): pass the number of examples as int\(n\)"):
        make(count)


@pytest.mark.parametrize("make", [_fit, _evaluate], ids=["fit", "evaluate"])
@pytest.mark.parametrize("count", [0, -1, np.int64(0)])
def test_num_examples_must_be_positive(make: Any, count: Any) -> None:
    with pytest.raises(ValueError, match="num_examples must be positive, got"):
        make(count)


@pytest.mark.parametrize("loss", [0.25, 1, np.float32(0.25), np.float64(0.25)])
def test_an_evaluation_loss_is_kept_as_a_python_float(loss: Any) -> None:
    out = EvaluateOutput(loss, 10)
    assert out.loss == float(loss) and type(out.loss) is float


@pytest.mark.parametrize("loss", ["0.5", b"0.5", True, None, np.zeros(2)],
                         ids=["str", "bytes", "bool", "none", "array"])
def test_an_evaluation_loss_that_is_not_a_number_is_refused_naming_the_fix(loss: Any) -> None:
    with pytest.raises(TypeError, match=r"EvaluateOutput.loss must be a number, not \w+ "
                                        r"\(.*\): pass the mean loss as float\(loss\)"):
        EvaluateOutput(loss, 10)


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), np.float32("-inf")])
def test_a_non_finite_evaluation_loss_fails_the_task_with_its_reason(loss: Any) -> None:
    # Sent, the server refuses it as malformed and strikes the client, round after round.
    with pytest.raises(ValueError, match="EvaluateOutput.loss is .*inf|EvaluateOutput.loss "
                                         "is nan: the model's loss on this client's data is "
                                         r"not finite \(has it diverged\?\)"):
        EvaluateOutput(loss, 10)

