"""Adaptive server optimizers of the FedOpt family (Reddi et al., "Adaptive Federated
Optimization", ICLR 2021, Algorithm 2): Adagrad, Adam and Yogi on the server.

With ``Δ_t`` the round's mean delta (Reddi et al.'s pseudo-gradient, negated; it equals
Flower's ``aggregated - current``), every variant keeps

    m_t = beta_1 * m_{t-1} + (1 - beta_1) * Δ_t
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)

and differs only in the second moment:

- Adagrad: ``v_t = v_{t-1} + Δ_t²``;
- Adam:    ``v_t = beta_2 * v_{t-1} + (1 - beta_2) * Δ_t²``;
- Yogi:    ``v_t = v_{t-1} - (1 - beta_2) * Δ_t² * sign(v_{t-1} - Δ_t²)`` (Zaheer et al.,
  "Adaptive Methods for Nonconvex Optimization", NeurIPS 2018).

Moments start at ``m = 0`` and ``v = initial_accumulator`` (Reddi et al. ask for
``v_{-1} >= tau²``; Flower starts at 0, our default, so configurations carry over).
Moments are float64 and part of `state_dict`, with the number of steps taken.

Integer tensors (buffers such as ``num_batches_tracked``) get no adaptive step: the
mean delta is added as it is, the FedAvg rule. Boolean tensors never reach here.

Where Flower 1.42 departs from the paper: its FedAdam multiplies ``eta`` by the Adam
bias correction ``sqrt(1 - beta_2^(r+1)) / (1 - beta_1^(r+1))`` with ``r`` the server
round; Reddi et al. have no bias correction. `ServerAdam`'s ``bias_correction`` chooses:
``"none"`` (the paper, default), ``"adam"`` (Kingma and Ba's, with ``t`` the number of
server steps taken, this one included) or ``"flower"`` (Flower's, with ``t + 1``: it
equals Flower's ``server_round + 1`` when rounds count from 1 and every round produced
a model; Flower counts failed rounds too, we count steps).
"""

from __future__ import annotations

import abc
import math
from typing import Literal

import numpy as np

from fedloom.errors import ConfigError
from fedloom.strategies._base import ServerOptimizer, StateDict, check_finite_step
from fedloom.strategies._state import (
    Buffers,
    buffer_for,
    buffers_from_state,
    buffers_to_state,
    check_buffer_names,
)
from fedloom.weights import Weights

BiasCorrection = Literal["none", "adam", "flower"]
BIAS_CORRECTIONS: tuple[str, ...] = ("none", "adam", "flower")


def _check_unit_interval(setting: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(setting, f"must be in [0, 1), got {value}")


def _check_positive(setting: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(setting, f"must be a positive number, got {value}")


class AdaptiveServerOptimizer(ServerOptimizer):
    """The shared FedOpt step; subclasses define the second-moment update.

    Args:
        eta: server learning rate, > 0.
        beta_1: first-moment decay in [0, 1) (0: no momentum).
        beta_2: second-moment decay in [0, 1) (unused by Adagrad).
        tau: adaptivity (added to ``sqrt(v)``), > 0.
        initial_accumulator: starting value of ``v``, >= 0.
    """

    def __init__(
        self,
        *,
        eta: float,
        beta_1: float,
        beta_2: float,
        tau: float,
        initial_accumulator: float = 0.0,
    ) -> None:
        _check_positive("eta", eta)
        _check_unit_interval("beta_1", beta_1)
        _check_unit_interval("beta_2", beta_2)
        _check_positive("tau", tau)
        if not (math.isfinite(initial_accumulator) and initial_accumulator >= 0):
            raise ConfigError(
                "initial_accumulator", f"must be a number >= 0, got {initial_accumulator}"
            )
        self.eta = float(eta)
        self.beta_1 = float(beta_1)
        self.beta_2 = float(beta_2)
        self.tau = float(tau)
        self.initial_accumulator = float(initial_accumulator)
        self._m: Buffers | None = None
        self._v: Buffers | None = None
        self._steps = 0

    @property
    def steps(self) -> int:
        """How many server steps this optimizer has taken."""
        return self._steps

    @abc.abstractmethod
    def second_moment(self, v: np.ndarray, delta_squared: np.ndarray) -> np.ndarray:
        """Return ``v_t`` from ``v_{t-1}`` and ``Δ_t²`` (float64 arrays)."""

    def learning_rate(self, step: int) -> float:
        """The server learning rate of step ``step`` (1-based); ``eta`` unless corrected."""
        return self.eta

    def step(self, current: Weights, mean_delta: Weights) -> Weights:
        names = list(current)
        check_buffer_names(self._m, names, "first moment")
        check_buffer_names(self._v, names, "second moment")
        step = self._steps + 1
        lr = self.learning_rate(step)
        new_m: Buffers = {}
        new_v: Buffers = {}
        out: list[tuple[str, np.ndarray]] = []
        for name, arr in current.items():
            delta = mean_delta[name]
            if arr.dtype.kind != "f":
                out.append((name, (arr + delta.astype(arr.dtype)).astype(arr.dtype)))
                continue
            d = delta.astype(np.float64)
            m_prev = buffer_for(self._m, name, arr, 0.0, "first moment")
            v_prev = buffer_for(self._v, name, arr, self.initial_accumulator, "second moment")
            m = self.beta_1 * m_prev + (1.0 - self.beta_1) * d
            v = self.second_moment(v_prev, d * d)
            new_m[name], new_v[name] = m, v
            new = arr.astype(np.float64) + lr * m / (np.sqrt(v) + self.tau)
            out.append((name, new.astype(arr.dtype)))
        result = check_finite_step(Weights(out), first_moment=new_m, second_moment=new_v)
        # State changes only once the whole step has succeeded.
        self._m, self._v, self._steps = new_m, new_v, step
        return result

    def state_dict(self) -> StateDict:
        return {"steps": self._steps, "m": buffers_to_state(self._m),
                "v": buffers_to_state(self._v)}

    def load_state_dict(self, state: StateDict) -> None:
        unknown = set(state) - {"steps", "m", "v"}
        if unknown:
            raise ValueError(f"{type(self).__name__} state has unknown keys {sorted(unknown)}")
        steps = state.get("steps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 0:
            raise ValueError(f"{type(self).__name__} state: steps must be an int >= 0")
        self._m = buffers_from_state(state.get("m"), "first moment")
        self._v = buffers_from_state(state.get("v"), "second moment")
        self._steps = int(steps)


class ServerAdagrad(AdaptiveServerOptimizer):
    """FedAdagrad's server step: ``v_t = v_{t-1} + Δ_t²`` (Reddi et al., 2021)."""

    def second_moment(self, v: np.ndarray, delta_squared: np.ndarray) -> np.ndarray:
        return v + delta_squared


class ServerAdam(AdaptiveServerOptimizer):
    """FedAdam's server step: ``v_t = beta_2 v_{t-1} + (1 - beta_2) Δ_t²`` (Reddi et al.).

    Args:
        bias_correction: ``"none"`` (Reddi et al., default), ``"adam"`` (Kingma and Ba)
            or ``"flower"`` (Flower 1.42's exponent ``t + 1``); see the module docstring.
            The other arguments are `AdaptiveServerOptimizer`'s.
    """

    def __init__(
        self,
        *,
        eta: float,
        beta_1: float,
        beta_2: float,
        tau: float,
        initial_accumulator: float = 0.0,
        bias_correction: BiasCorrection = "none",
    ) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau,
                         initial_accumulator=initial_accumulator)
        if bias_correction not in BIAS_CORRECTIONS:
            raise ConfigError(
                "bias_correction",
                f"must be one of {', '.join(map(repr, BIAS_CORRECTIONS))}, "
                f"got {bias_correction!r}",
            )
        self.bias_correction: BiasCorrection = bias_correction

    def second_moment(self, v: np.ndarray, delta_squared: np.ndarray) -> np.ndarray:
        return self.beta_2 * v + (1.0 - self.beta_2) * delta_squared

    def learning_rate(self, step: int) -> float:
        if self.bias_correction == "none":
            return self.eta
        t = float(step + 1 if self.bias_correction == "flower" else step)
        return self.eta * math.sqrt(1.0 - self.beta_2**t) / (1.0 - self.beta_1**t)


class ServerYogi(AdaptiveServerOptimizer):
    """FedYogi's server step (Reddi et al., 2021; Yogi by Zaheer et al., 2018).

    ``v_t = v_{t-1} - (1 - beta_2) Δ_t² sign(v_{t-1} - Δ_t²)``: ``v`` moves additively
    towards ``Δ²``, so it cannot grow as fast as Adam's after a large delta.
    """

    def second_moment(self, v: np.ndarray, delta_squared: np.ndarray) -> np.ndarray:
        return v - (1.0 - self.beta_2) * delta_squared * np.sign(v - delta_squared)
