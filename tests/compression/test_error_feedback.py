"""Error feedback: nothing a lossy codec drops is lost, only delayed, and the residual
survives a restart of the client without ever being sent."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from fedloom import Weights
from fedloom.compression import ErrorFeedback, decode, make_codec


def _updates(count: int, seed: int = 0) -> list[Weights]:
    rng = np.random.default_rng(seed)
    return [Weights({"w": rng.normal(size=(40, 5)).astype(np.float32),
                     "steps": np.array([i], np.int64)}) for i in range(count)]


def test_what_was_sent_plus_the_residual_is_everything_updated() -> None:
    codec = make_codec("topk", fraction=0.05)
    feedback = ErrorFeedback(codec)
    rng = np.random.default_rng(1)
    sent = np.zeros((40, 5))
    updates = _updates(30)
    for update in updates:
        encoded = feedback.encode(update, rng)
        decoded = decode(codec, update.specs(), encoded)
        sent += decoded["w"]
        np.testing.assert_array_equal(decoded["steps"], update["steps"])  # integers as is
    total = sum(np.asarray(u["w"], np.float64) for u in updates)
    np.testing.assert_allclose(sent + feedback.residual["w"], total, rtol=0, atol=1e-4)
    # The residual stays bounded: top-k keeps sending the largest accumulated values.
    assert np.max(np.abs(feedback.residual["w"])) < np.max(np.abs(total))


def test_without_feedback_top_k_loses_what_it_drops() -> None:
    codec = make_codec("topk", fraction=0.05)
    updates = _updates(30)
    rng = np.random.default_rng(1)
    plain = sum(np.asarray(decode(codec, u.specs(), ErrorFeedback(codec).encode(u, rng))["w"],
                           np.float64) for u in updates)
    with_feedback = ErrorFeedback(codec)
    fed = sum(np.asarray(decode(codec, u.specs(), with_feedback.encode(u, rng))["w"],
                         np.float64) for u in updates)
    total = sum(np.asarray(u["w"], np.float64) for u in updates)
    assert np.linalg.norm(fed - total) < 0.5 * np.linalg.norm(plain - total)


def test_the_residual_survives_a_restart_and_is_written_atomically(tmp_path: Path) -> None:
    path = tmp_path / "client" / "feedback.npz"
    codec = make_codec("topk", fraction=0.1)
    first = ErrorFeedback(codec, path)
    first.encode(_updates(1)[0], np.random.default_rng(0))
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    again = ErrorFeedback(codec, path)
    assert sorted(again.residual) == ["w"]
    np.testing.assert_array_equal(again.residual["w"], first.residual["w"])
    again.reset()
    assert not path.exists() and again.residual == {}


def test_a_residual_of_another_model_is_dropped(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "feedback.npz"
    codec = make_codec("topk", fraction=0.1)
    ErrorFeedback(codec, path).encode(_updates(1)[0], np.random.default_rng(0))
    other = Weights({"w": np.ones((3, 3), np.float32)})
    feedback = ErrorFeedback(codec, path)
    with caplog.at_level(logging.WARNING, logger="fedloom.compression"):
        encoded = feedback.encode(other, np.random.default_rng(0))
    assert "does not match this model" in caplog.text
    sent = decode(codec, other.specs(), encoded)["w"]
    np.testing.assert_allclose(sent + feedback.residual["w"], np.ones((3, 3)), atol=1e-7)


def test_an_unreadable_residual_file_starts_from_zero(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "feedback.npz"
    path.write_bytes(b"not an npz file")
    with caplog.at_level(logging.WARNING, logger="fedloom.compression"):
        feedback = ErrorFeedback(make_codec("topk"), path)
    assert feedback.residual == {} and "cannot read" in caplog.text


@pytest.mark.parametrize("keep", [0, 100])
def test_a_truncated_residual_file_starts_from_zero(tmp_path: Path, keep: int,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # A torn write (a full disk, a power cut) leaves a zero-length or cut .npz: numpy
    # raises EOFError or BadZipFile there, which crashed every restart of the client.
    path = tmp_path / "feedback.npz"
    codec = make_codec("topk", fraction=0.1)
    ErrorFeedback(codec, path).encode(_updates(1)[0], np.random.default_rng(0))
    path.write_bytes(path.read_bytes()[:keep])
    with caplog.at_level(logging.WARNING, logger="fedloom.compression"):
        feedback = ErrorFeedback(codec, path)
    assert feedback.residual == {} and "cannot read" in caplog.text


def test_a_residual_file_with_non_finite_values_starts_from_zero(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Carried into every update, it made each one unencodable: top-k fell back to plain
    # float32 for good, blaming the (finite) update.
    path = tmp_path / "feedback.npz"
    codec = make_codec("topk", fraction=0.1)
    ErrorFeedback(codec, path).encode(_updates(1)[0], np.random.default_rng(0))
    with np.load(path) as data:  # the saved file, with a NaN put in its one tensor
        saved = {name: np.array(data[name]) for name in data.files}
    saved["t0"][0] = np.nan
    with path.open("wb") as fh:
        np.savez(fh, **saved)
    with caplog.at_level(logging.WARNING, logger="fedloom.compression"):
        again = ErrorFeedback(codec, path)
    assert again.residual == {}
    assert "cannot read" in caplog.text and "holds non-finite values" in caplog.text


def test_a_residual_that_cannot_be_saved_stays_in_memory(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    # The state folder is a file (or read-only, or full): the update still goes out.
    blocker = tmp_path / "state"
    blocker.write_text("a file where the folder should be")
    feedback = ErrorFeedback(make_codec("topk", fraction=0.1), blocker / "feedback.npz")
    update = _updates(1)[0]
    with caplog.at_level(logging.WARNING, logger="fedloom.compression"):
        encoded = feedback.encode(update, np.random.default_rng(0))
    assert "cannot save the error-feedback residual" in caplog.text
    sent = decode(make_codec("topk", fraction=0.1), update.specs(), encoded)["w"]
    np.testing.assert_allclose(sent + feedback.residual["w"], update["w"], atol=1e-6)
