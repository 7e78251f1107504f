"""`TorchClient`'s optimizer step: torch's own optimizers stepped past their wrappers,
with the same updates and state, and every hook or wrapper still honoured."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.optim import optimizer as torch_optimizer  # noqa: E402

from fedloom.client_sdk.torch_trainer import _stepper  # noqa: E402

OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-nesterov-decay": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                    weight_decay=1e-3),
    "sgd-maximize-dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5,
                                                        dampening=0.1, maximize=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _train(model: Any, step: Callable[[], object], steps: int = 4) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        x = torch.randn(8, 6, generator=generator)
        y = torch.randint(0, 3, (8,), generator=generator)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step()


def _same_state(a: Any, b: Any) -> bool:
    state_a, state_b = a.state_dict()["state"], b.state_dict()["state"]
    return state_a.keys() == state_b.keys() and all(
        state_a[k].keys() == state_b[k].keys()
        and all(torch.equal(torch.as_tensor(state_a[k][n]), torch.as_tensor(state_b[k][n]))
                for n in state_a[k])
        for k in state_a)


@pytest.mark.parametrize("name", OPTIMIZERS, ids=list(OPTIMIZERS))
def test_the_lean_step_makes_the_same_updates_and_state_as_step(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plain, lean = _model(), _model()
    plain_opt, lean_opt = OPTIMIZERS[name](plain.parameters()), OPTIMIZERS[name](lean.parameters())
    _train(plain, plain_opt.step)
    wrapped: list[int] = []  # the class's (wrapped) step: the lean path must not call it
    real = type(lean_opt).step
    monkeypatch.setattr(type(lean_opt), "step",
                        lambda self, *a, **k: (wrapped.append(1), real(self, *a, **k))[1])
    _train(lean, _stepper(lean_opt))
    assert not wrapped
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), lean.parameters(),
                                                 strict=True))
    assert _same_state(plain_opt, lean_opt)
    assert all(not p.requires_grad or p.grad is not None for p in lean.parameters())
    assert torch.is_grad_enabled()  # the grad mode is restored


def test_a_step_hook_is_honoured_even_when_registered_after_the_stepper() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = _stepper(optimizer)
    _train(model, step, steps=1)
    calls: list[str] = []
    pre = optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    post = optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    _train(model, step, steps=2)
    assert calls == ["pre", "post", "pre", "post"]
    pre.remove()
    post.remove()
    _train(model, step, steps=1)
    assert len(calls) == 4


def test_a_global_step_hook_is_honoured() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    calls: list[int] = []
    handle = torch_optimizer.register_optimizer_step_post_hook(
        lambda *_: calls.append(1))
    try:
        _train(model, _stepper(optimizer), steps=3)
    finally:
        handle.remove()
    assert calls == [1, 1, 1]


def test_an_lr_schedulers_wrapper_still_sees_the_step() -> None:
    # The scheduler wraps the instance's step to learn that it was called; skipping
    # that wrapper would make it warn that it stepped before the optimizer.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, _stepper(optimizer), steps=1)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


class _Halving(torch.optim.SGD):
    """A subclass with a step of its own: never bypassed."""

    def step(self, closure: Any = None) -> Any:
        self.halved = getattr(self, "halved", 0) + 1
        return super().step(closure)


@pytest.mark.parametrize("kind", ["subclass", "differentiable", "other"])
def test_other_optimizers_are_stepped_as_they_are(kind: str) -> None:
    model = _model()
    params = list(model.parameters())
    if kind == "subclass":
        optimizer = _Halving(params, lr=0.05)
    elif kind == "differentiable":
        optimizer = torch.optim.SGD(params, lr=0.05, differentiable=True)
    else:
        optimizer = torch.optim.RMSprop(params, lr=1e-2)
    before = copy.deepcopy(model)
    assert _stepper(optimizer) == optimizer.step
    if kind != "differentiable":  # (a differentiable step needs non-leaf parameters)
        _train(model, _stepper(optimizer), steps=2)
        assert not all(torch.equal(a, b) for a, b in zip(before.parameters(),
                                                         model.parameters(), strict=True))
    if kind == "subclass":
        assert optimizer.halved == 2
