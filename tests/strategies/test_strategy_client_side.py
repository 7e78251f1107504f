"""The client half of two strategies, in `TorchClient`: FedProx's proximal term and the
update-norm bound (clipping on the client, what secure aggregation needs).

The proximal term is checked against plain numpy SGD on least squares, written from Li et
al. (2020): the local objective is ``mean((X w - y)^2) + mu/2 ||w - w_global||^2``, so
each step is ``w <- w - lr * (2/b X_b^T (X_b w - y_b) + mu (w - w_global))``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedloom import ClientUpdate, ConfigError, Weights  # noqa: E402
from fedloom.client_sdk import TorchClient  # noqa: E402
from fedloom.strategies import FedProx, NormBoundedStrategy, clip_update, update_norm  # noqa: E402

LR = 0.05


def least_squares_client(seed: int = 0) -> tuple[TorchClient, list[tuple[np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    batches = [(rng.normal(size=(4, 3)).astype(np.float32),
                rng.normal(size=(4, 1)).astype(np.float32)) for _ in range(3)]
    loader = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    model = torch.nn.Linear(3, 1, bias=False)
    client = TorchClient(model, loader, loss_fn=torch.nn.MSELoss(), device="cpu",
                         optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR))
    return client, batches


def numpy_fedprox(w0: np.ndarray, batches, mu: float, epochs: int,  # type: ignore[no-untyped-def]
                  task_losses: list[float] | None = None) -> np.ndarray:
    w = w0.astype(np.float64).ravel().copy()
    anchor = w.copy()
    for _ in range(epochs):
        for x, y in batches:
            x64, y64 = x.astype(np.float64), y.astype(np.float64).ravel()
            if task_losses is not None:
                task_losses.append(float(np.mean((x64 @ w - y64) ** 2)))
            grad = 2.0 / len(y64) * x64.T @ (x64 @ w - y64) + mu * (w - anchor)
            w -= LR * grad
    return w


@pytest.mark.parametrize(("key", "mu"), [("proximal_mu", 0.0), ("proximal_mu", 0.5),
                                         ("proximal_mu", 3.0), ("proximal-mu", 3.0)])
def test_proximal_term_matches_the_papers_objective(key: str, mu: float) -> None:
    client, batches = least_squares_client()
    w0 = Weights({"weight": np.array([[0.5, -1.0, 2.0]], np.float32)})
    out = client.fit(w0, {key: mu, "local_epochs": 2})
    expected = numpy_fedprox(w0["weight"], batches, mu, epochs=2)
    np.testing.assert_allclose(out.weights["weight"].ravel(), expected, rtol=1e-5, atol=1e-6)
    if mu > 0:
        assert out.metrics["proximal_mu"] == mu  # echoed: the server counts it as applied
    else:
        assert "proximal_mu" not in out.metrics
    # The proximal term pulls towards w0: a larger mu ends closer to it.
    if mu > 0:
        plain = numpy_fedprox(w0["weight"], batches, 0.0, epochs=2)
        start = w0["weight"].ravel()
        assert np.linalg.norm(expected - start) < np.linalg.norm(plain - start)


def test_train_loss_is_the_task_loss_without_the_term() -> None:
    client, batches = least_squares_client()
    w0 = Weights({"weight": np.array([[0.5, -1.0, 2.0]], np.float32)})
    out = client.fit(w0, {"proximal_mu": 3.0, "local_epochs": 2})
    losses: list[float] = []
    numpy_fedprox(w0["weight"], batches, 3.0, epochs=2, task_losses=losses)
    # Equal batches: the mean of the per-step task losses (the term would add
    # mu/2 ||w - w0||^2 > 0 from the second step on).
    assert out.metrics["train_loss"] == pytest.approx(np.mean(losses), rel=1e-5)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), "x", True])
def test_bad_mu_is_refused(bad: object) -> None:
    client, _ = least_squares_client()
    w0 = Weights({"weight": np.zeros((1, 3), np.float32)})
    with pytest.raises(ConfigError, match="proximal_mu"):
        client.fit(w0, {"proximal_mu": bad})  # type: ignore[dict-item]


def test_fedprox_counts_a_client_that_ignores_mu() -> None:
    """Two TorchClients echo mu; a client that does not is counted by the strategy."""
    strategy = FedProx(proximal_mu=0.5)
    w0 = Weights({"weight": np.array([[0.5, -1.0, 2.0]], np.float32)})
    config = strategy.configure_fit(1, w0, []).config
    assert config["proximal_mu"] == 0.5
    updates = []
    for seed in (0, 1):
        client, _ = least_squares_client(seed)
        out = client.fit(w0, config)
        updates.append(ClientUpdate(f"torch{seed}", out.weights.subtract(w0), out.num_examples,
                                    0, out.metrics))
    updates.append(ClientUpdate("ignores", updates[0].delta, 12, 0, {"train_loss": 1.0}))
    result = strategy.aggregate_fit(1, w0, updates)
    assert result.metrics["num_ignored_proximal_mu"] == 1


def bn_client() -> TorchClient:
    """A model with an integer buffer (BatchNorm's num_batches_tracked)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    rng = np.random.default_rng(2)
    loader = [(torch.from_numpy(rng.normal(size=(8, 6)).astype(np.float32)),
               torch.from_numpy(rng.integers(0, 3, size=8))) for _ in range(4)]
    return TorchClient(model, loader, device="cpu",
                       optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.5))


@pytest.mark.parametrize("bound", [1e-3, 0.05, 0.3, 1e6])
def test_client_clips_its_update_to_the_bound(bound: float) -> None:
    client = bn_client()
    w0 = client.get_weights()
    unclipped = client.fit(w0, {"seed": 3})
    raw_delta = unclipped.weights.subtract(w0)
    out = client.fit(w0, {"seed": 3, "max_update_norm": bound})
    delta = out.weights.subtract(w0)  # as the SDK computes it before upload
    assert out.metrics["update_norm"] == pytest.approx(update_norm(raw_delta), rel=1e-6)
    assert update_norm(delta) <= bound  # what the server measures: never above
    expected = clip_update(raw_delta, bound)  # the strategies' definition
    for name, arr in delta.items():
        if arr.dtype.kind == "f":
            np.testing.assert_allclose(arr, expected[name], rtol=1e-3, atol=1e-7)  # f32 ulp
        else:  # integer buffers are not scaled
            assert np.array_equal(arr, raw_delta[name])
    if update_norm(raw_delta) <= bound:
        assert out.weights is not None and all(
            np.array_equal(out.weights[k], unclipped.weights[k]) for k in w0)


def test_a_clipping_client_passes_a_rejecting_server() -> None:
    client = bn_client()
    w0 = client.get_weights()
    strategy = NormBoundedStrategy(FedProx(), 0.05, "reject")
    config = strategy.configure_fit(1, w0, []).config
    out = client.fit(w0, {**config, "seed": 3})
    update = ClientUpdate("c", out.weights.subtract(w0), out.num_examples, 0, out.metrics)
    result = strategy.aggregate_fit(1, w0, [update, update])
    assert result.metrics["num_rejected"] == 0 and result.weights is not None


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), "big", False])
def test_bad_bound_is_refused(bad: object) -> None:
    client = bn_client()
    with pytest.raises(ConfigError, match="max_update_norm"):
        client.fit(client.get_weights(), {"max_update_norm": bad})  # type: ignore[dict-item]
