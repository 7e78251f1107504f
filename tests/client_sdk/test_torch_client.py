"""`TorchClient`: weights in and out, training, config keys, devices (CUDA when present)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedloom.client_sdk.torch_trainer import (  # noqa: E402
    TorchClient,
    load_weights,
    resolve_device,
    state_dict_to_weights,
)
from fedloom.errors import ConfigError  # noqa: E402
from fedloom.weights import Weights  # noqa: E402

CUDA = torch.cuda.is_available()


def _data(n: int = 256, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A linearly separable 2-class problem in 8 dimensions, in batches of 32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return [(x[i : i + 32], y[i : i + 32]) for i in range(0, n, 32)]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def _client(device: str = "cpu", **kwargs) -> TorchClient:  # type: ignore[no-untyped-def]
    data = _data()
    return TorchClient(_model(), data, data, device=device, **kwargs)


def test_weights_follow_the_state_dict_names_order_and_dtypes() -> None:
    model = _model()
    weights = state_dict_to_weights(model.state_dict())
    assert list(weights) == list(model.state_dict())
    # BatchNorm's counter is an int64 buffer and must stay one.
    assert weights["1.num_batches_tracked"].dtype == np.int64
    assert weights["0.weight"].dtype == np.float32
    # A copy, not a view: training the model later must not change it.
    before = weights["0.weight"].copy()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    np.testing.assert_array_equal(weights["0.weight"], before)


def test_a_bfloat16_model_is_refused_naming_the_tensor_and_the_fix() -> None:
    # numpy has no bfloat16: torch's own "Got unsupported ScalarType BFloat16" named
    # neither the tensor nor what to do.
    model = _model()
    model[3].to(torch.bfloat16)
    client = TorchClient(model, _data(), device="cpu")
    with pytest.raises(ValueError, match=r"tensor '3.weight' \(torch.bfloat16\) cannot be sent"
                                         r".*keep the parameters in float32 and train in "
                                         "bfloat16 under torch.autocast"):
        client.get_weights()


def test_load_weights_round_trips_and_checks_the_layout() -> None:
    source, target = _model(seed=1), _model(seed=2)
    weights = state_dict_to_weights(source.state_dict())
    load_weights(target, weights)
    assert state_dict_to_weights(target.state_dict()).allclose(weights, rtol=0, atol=0)
    with pytest.raises(ValueError, match="missing"):
        load_weights(target, Weights({k: v for k, v in weights.items() if k != "0.bias"}))
    wrong_shape = dict(weights)
    wrong_shape["0.bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="shape"):
        load_weights(target, Weights(wrong_shape))
    wrong_dtype = dict(weights)
    wrong_dtype["0.bias"] = weights["0.bias"].astype(np.float64)
    with pytest.raises(ValueError, match="dtype"):
        load_weights(target, Weights(wrong_dtype))


def test_fit_lowers_the_loss_and_reports_examples() -> None:
    client = _client()
    start = client.get_weights()
    before = client.evaluate(start, {})
    out = client.fit(start, {"local_epochs": 3, "seed": 0})
    after = client.evaluate(out.weights, {})
    assert out.num_examples == 256  # examples per epoch, not per fit
    assert after.loss < 0.7 * before.loss
    assert after.metrics["accuracy"] > 0.9
    assert not out.weights.allclose(start, rtol=0, atol=1e-6)


def test_evaluate_reports_the_share_of_argmax_hits_as_accuracy_for_a_classifier() -> None:
    client = _client()
    out = client.evaluate(client.get_weights(), {})
    client.model.eval()
    with torch.no_grad():  # the reference: every batch's argmax against its labels
        hits = sum(int((client.model(x).argmax(dim=1) == y).sum()) for x, y in _data())
    assert out.metrics["accuracy"] == pytest.approx(hits / 256)
    assert out.num_examples == 256


def _mse_on_flat(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs.squeeze(1) - targets) ** 2).mean()


@pytest.mark.parametrize(("outputs", "targets", "loss_fn"), [
    (1, torch.zeros(64, 1), torch.nn.functional.mse_loss),  # broadcast to 64 x 64: 16.0
    (1, torch.zeros(64), _mse_on_flat),
    (3, torch.zeros(64, 3), torch.nn.functional.mse_loss),
    (1, torch.zeros(64, dtype=torch.long), _mse_on_flat),
    (2, torch.eye(2)[torch.arange(64) % 2], torch.nn.functional.binary_cross_entropy_with_logits),
], ids=["(N,1) on (N,1)", "(N,1) on float (N,)", "(N,3) on (N,3)", "one column on labels",
        "multi-label (N,2) on float (N,2)"])
def test_evaluate_reports_no_accuracy_when_the_model_does_not_classify(
        outputs: int, targets: torch.Tensor, loss_fn) -> None:  # type: ignore[no-untyped-def]
    """Only scores (N, C), C >= 2, against integer labels (N,) have an accuracy: a
    regression's argmax compared with its targets gave numbers such as 16.0."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    client = TorchClient(torch.nn.Linear(8, outputs), [(x, targets)], loss_fn=loss_fn,
                         device="cpu")
    out = client.evaluate(client.get_weights(), {})
    assert "accuracy" not in out.metrics and out.metrics == {}
    with torch.no_grad():
        assert out.loss == pytest.approx(float(loss_fn(client.model(x), targets)), rel=1e-6)
    assert out.num_examples == 64


def test_fit_is_reproducible_with_a_seed_and_starts_from_the_given_weights() -> None:
    client = _client()
    start = client.get_weights()
    first = client.fit(start, {"seed": 3}).weights
    client.fit(first, {"seed": 9})  # the model now holds other weights...
    again = client.fit(start, {"seed": 3}).weights  # ...which fit must overwrite
    assert again.allclose(first, rtol=0, atol=0)


def test_config_keys_change_training() -> None:
    client = _client()
    start = client.get_weights()
    one = client.fit(start, {"seed": 0, "local_epochs": 1})
    two = client.fit(start, {"seed": 0, "local_epochs": 2})
    assert not one.weights.allclose(two.weights, rtol=0, atol=1e-6)
    tiny = client.fit(start, {"seed": 0, "lr": 1e-6})
    # lr 1e-6 barely moves the weights; the default 0.05 moves them far more.
    moved_tiny = max(np.abs(tiny.weights[k] - start[k]).max() for k in ("0.weight",))
    moved_default = max(np.abs(one.weights[k] - start[k]).max() for k in ("0.weight",))
    assert moved_tiny < 1e-3 < moved_default
    eta_l = client.fit(start, {"seed": 0, "eta_l": 1e-6})  # FedOpt's name for it
    assert eta_l.weights.allclose(tiny.weights, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="local_epochs"):
        client.fit(start, {"local_epochs": 0})


def test_proximal_term_pulls_towards_the_global_model_and_is_reported() -> None:
    client = _client()
    start = client.get_weights()
    free = client.fit(start, {"seed": 0, "local_epochs": 3})
    held = client.fit(start, {"seed": 0, "local_epochs": 3, "proximal_mu": 10.0})
    assert held.metrics["proximal_mu"] == 10.0
    assert "proximal_mu" not in free.metrics

    params = [name for name, _ in client.model.named_parameters()]  # not BN's buffers

    def distance(w: Weights) -> float:
        return float(sum(np.sum((w[k] - start[k]) ** 2) for k in params))

    assert distance(held.weights) < 0.5 * distance(free.weights)


def test_device_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    with pytest.raises(ConfigError, match="device"):
        resolve_device("not-a-device")
    if not CUDA:
        with pytest.raises(ConfigError, match="no GPU"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="local_epochs"):
        _client(local_epochs=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_training_matches_cpu_training() -> None:
    cpu, gpu = _client("cpu"), _client("cuda")
    assert next(gpu.model.parameters()).is_cuda
    start = cpu.get_weights()
    on_cpu = cpu.fit(start, {"seed": 0, "local_epochs": 2})
    on_gpu = gpu.fit(start, {"seed": 0, "local_epochs": 2})
    # Weights come back to host memory as numpy, with the same layout.
    assert list(on_gpu.weights) == list(on_cpu.weights)
    # Different kernels, same math: close, not bitwise.
    assert on_gpu.weights.allclose(on_cpu.weights, rtol=1e-3, atol=1e-3)
    # Evaluation on the GPU gives the CPU's answer (to one example of 256), and the two
    # epochs of training helped: the start model scores about 0.32, the trained ~0.85.
    gpu_accuracy = gpu.evaluate(on_gpu.weights, {}).metrics["accuracy"]
    cpu_accuracy = cpu.evaluate(on_cpu.weights, {}).metrics["accuracy"]
    assert abs(gpu_accuracy - cpu_accuracy) <= 1 / 256
    assert gpu_accuracy > cpu.evaluate(start, {}).metrics["accuracy"] + 0.3


def _hand_loop(epochs: int, optimizer_cls: type = torch.optim.SGD) -> Weights:
    """`TorchClient.fit`'s training written out plainly (torch's own ``zero_grad``)."""
    model, data = _model(), _data()
    torch.manual_seed(5)
    optimizer = optimizer_cls(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        for x, y in data:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
    return state_dict_to_weights(model.state_dict())


def test_training_equals_a_plain_torch_loop_and_drops_gradients_between_steps() -> None:
    client = _client()
    out = client.fit(client.get_weights(), {"seed": 5, "local_epochs": 2})
    expected = _hand_loop(2)
    assert out.weights.allclose(expected, rtol=0, atol=0)  # 16 steps, bit for bit


def test_an_optimizer_with_its_own_zero_grad_has_it_called_every_step() -> None:
    calls = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none=set_to_none)

    client = _client(optimizer_factory=lambda p: Counting(p, lr=0.05, momentum=0.9))
    out = client.fit(client.get_weights(), {"seed": 5, "local_epochs": 2})
    assert calls == [True] * 16
    assert out.weights.allclose(_hand_loop(2, Counting), rtol=0, atol=0)


def test_fit_trains_in_train_mode_after_an_evaluation_left_the_model_in_eval() -> None:
    client = _client()
    start = client.get_weights()
    client.evaluate(start, {})
    assert not client.model.training and not client.model[1].training
    out = client.fit(start, {"seed": 0})
    assert client.model.training and client.model[1].training
    # batch norm's running statistics move only in train mode
    assert not np.allclose(out.weights["1.running_mean"], start["1.running_mean"])


def test_train_in_place_leaves_the_trained_weights_in_the_module() -> None:
    client = _client()
    start = client.get_weights()
    fitted = client.fit(start, {"seed": 2, "max_update_norm": 1e6})
    load_weights(client.model, start)
    examples, metrics = client.train_in_place({"seed": 2, "max_update_norm": 1e6})
    assert examples == fitted.num_examples == 256
    assert metrics == {"train_loss": fitted.metrics["train_loss"]}  # fit adds update_norm
    assert client.get_weights().allclose(fitted.weights, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="max_update_norm"):
        client.train_in_place({"max_update_norm": -1.0})


class _CountingTo(torch.nn.Sequential):
    """A module that counts its ``to`` calls (each walks every submodule)."""

    moves = 0

    def to(self, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        type(self).moves += 1
        return super().to(*args, **kwargs)


def test_a_model_already_on_the_device_is_not_walked_again_per_client() -> None:
    # Simulations build a client per partition on one shared module: each build used
    # to walk the whole module to "move" it where it already was.
    shared = _CountingTo(torch.nn.Linear(8, 2))
    data = _data()
    clients = [TorchClient(shared, data, device="cpu") for _ in range(3)]
    assert _CountingTo.moves == 0 and all(c.model is shared for c in clients)
    if CUDA:  # a module elsewhere is still moved
        TorchClient(shared, data, device="cuda")
        assert _CountingTo.moves == 1 and next(shared.parameters()).is_cuda


def test_the_default_loss_is_cross_entropy() -> None:
    client = _client()
    logits, labels = torch.randn(5, 2), torch.tensor([0, 1, 1, 0, 1])
    assert torch.equal(client.loss_fn(logits, labels),
                       torch.nn.CrossEntropyLoss()(logits, labels))


def test_a_server_cannot_ask_for_more_epochs_than_the_client_allows() -> None:
    # 10**9 local epochs would hold a device for days; the task fails instead, at once.
    client = _client(max_local_epochs=5)
    weights = client.get_weights()
    for asked in (10**9, 1e300, 6, 0):
        with pytest.raises(ConfigError, match=r"local_epochs: must be in 1\.\.5"):
            client.fit(weights, {"local_epochs": asked})
    client.fit(weights, {"local_epochs": 5})
    client.fit(weights, {"local_epochs": 2.0})  # a whole number written as a float
    for odd in (2.7, True, "2"):  # 2.7 was cut to 2 epochs without a word
        with pytest.raises(ConfigError, match="local_epochs: must be a whole number of "
                                              f"epochs, got {odd!r}"):
            client.fit(weights, {"local_epochs": odd})
    with pytest.raises(ConfigError, match="max_local_epochs"):
        _client(local_epochs=3, max_local_epochs=2)


class _DrawingLoss:
    """Cross-entropy that notes a draw of torch's default generator at each call."""

    def __init__(self) -> None:
        self.draws: list[float] = []

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.draws.append(float(torch.rand(1)))
        return torch.nn.functional.cross_entropy(outputs, targets)


@pytest.mark.parametrize("from_server", [True, False])
def test_the_servers_seed_stays_inside_fit(from_server: bool) -> None:
    # The seed is the server's to choose: draws inside training are then predictable to
    # it (privacy noise must come from the application's own secret generator), and the
    # process's generator is left as fit found it; with seed_from_server=False training
    # is not reseeded and draws on from the process's generator.
    loss = _DrawingLoss()
    client = _client(loss_fn=loss, seed_from_server=from_server)
    torch.manual_seed(99)
    torch.rand(3)
    state = torch.get_rng_state()
    client.fit(client.get_weights(), {"seed": 1234})
    assert torch.equal(torch.get_rng_state(), state) is from_server
    torch.manual_seed(1234)
    replay = float(torch.rand(1))
    assert (loss.draws[0] == replay) is from_server


def test_without_a_seed_fits_draw_on_from_the_process_generator() -> None:
    # Nothing seeded, nothing restored: each round's shuffling and dropout differ, as
    # they would in any training loop.
    loss = _DrawingLoss()
    client = _client(loss_fn=loss)
    weights = client.get_weights()
    client.fit(weights, {})
    client.fit(weights, {})
    per_fit = len(loss.draws) // 2
    assert loss.draws[:per_fit] != loss.draws[per_fit:]
