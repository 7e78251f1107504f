"""Many clients' `Weights` as one stack: each tensor with a leading client axis.

An engine that trains clients together (`fedloom.simulations.vectorized`) produces
their new weights as stacks. `WeightsRow` is one client's row of a `WeightsStack`: an
ordinary `Weights` (views, no copies) for any code that takes one client at a time,
which code that can do better recognises: the delta of every row against the same
model is one subtraction per tensor (`WeightsStack.minus`, cached), and the weighted
mean folds the rows of one stack with one product per tensor
(`fedloom.strategies` ``WeightedMeanAggregator``) instead of one fold per client.

>>> import numpy as np
>>> stack = WeightsStack({"w": np.arange(6, dtype=np.float32).reshape(3, 2)})
>>> row = WeightsRow(stack, 1)
>>> row["w"].tolist(), len(stack)
([2.0, 3.0], 3)
>>> base = Weights({"w": np.ones(2, np.float32)})
>>> WeightsRow(stack.minus(base), 2)["w"].tolist()
[3.0, 4.0]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from fedloom.weights import TensorSpec, Weights, layout_mismatch


class WeightsStack:
    """Tensors of ``len(self)`` clients: ``arrays[name][i]`` is client ``i``'s tensor.

    Args:
        arrays: name -> array of shape ``(clients, *tensor shape)``, in the model's
            order, all with the same number of clients (broadcast views are fine).
        row_specs: one row's layout when the caller has it (checked against the
            arrays, not rebuilt from them).

    Raises:
        ValueError: no tensors, a scalar, client counts that differ, or ``row_specs``
            that are not the rows' layout.
    """

    __slots__ = ("_finite", "_minus", "arrays", "row_specs", "size")

    def __init__(self, arrays: Mapping[str, np.ndarray],
                 row_specs: tuple[TensorSpec, ...] | None = None) -> None:
        if not arrays:
            raise ValueError("a WeightsStack needs at least one tensor")
        sizes = {arr.shape[0] if arr.ndim else 0 for arr in arrays.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError("every tensor needs the same leading client axis of at least "
                             f"one client, got {sorted(sizes)}")
        self.arrays = dict(arrays)
        self.size = sizes.pop()
        #: one client's layout, shared by every row
        self.row_specs: tuple[TensorSpec, ...] = (
            Weights((k, v[0]) for k, v in self.arrays.items()).specs() if row_specs is None
            else _checked_row_specs(self.arrays, row_specs))
        self._minus: tuple[Weights, WeightsStack] | None = None
        self._finite: np.ndarray | None = None

    def __len__(self) -> int:
        return self.size

    def minus(self, base: Weights) -> WeightsStack:
        """Every row minus ``base`` (in each tensor's dtype), computed once per ``base``.

        Raises:
            ValueError: ``base`` has another layout than a row.
        """
        cached = self._minus
        if cached is not None and cached[0] is base:
            return cached[1]
        problem = layout_mismatch(base.specs(), self.row_specs)
        if problem:
            raise ValueError(f"weights: {problem}")
        # Rows flattened: one long inner loop per row rather than one per last axis.
        delta = WeightsStack({
            name: np.subtract(arr.reshape(self.size, -1), base[name].reshape(-1),
                              dtype=arr.dtype).reshape(arr.shape)
            for name, arr in self.arrays.items()}, row_specs=self.row_specs)
        self._minus = (base, delta)
        return delta

    def finite_rows(self) -> np.ndarray:
        """A bool per client: whether every value of its row is finite (computed once)."""
        if self._finite is None:
            finite = np.ones(self.size, np.bool_)
            for arr in self.arrays.values():
                if arr.dtype.kind == "f":
                    finite &= np.isfinite(arr).reshape(self.size, -1).all(axis=1)
            self._finite = finite
        return self._finite


def _checked_row_specs(arrays: Mapping[str, np.ndarray], row_specs: tuple[TensorSpec, ...]
                       ) -> tuple[TensorSpec, ...]:
    """``row_specs``, once the arrays' rows are checked to have that layout (a known
    layout is shared, not rebuilt: the engine makes a stack per round or chunk)."""
    if [spec.name for spec in row_specs] != list(arrays):
        raise ValueError("row_specs names differ from the arrays'")
    for spec in row_specs:
        arr = arrays[spec.name]
        if arr.shape[1:] != spec.shape or arr.dtype != spec.numpy_dtype:
            raise ValueError(f"{spec.name!r}: rows of {arr.dtype}{list(arr.shape[1:])}, "
                             f"row_specs say {spec.dtype}{list(spec.shape)}")
    return row_specs


class WeightsRow(Weights):
    """Row ``row`` of ``stack`` as a `Weights` of views (read-only by convention, as
    every `Weights`' arrays are). A view is made when a tensor is read: the weighted
    mean and the delta never read the rows one by one, so most rows make none."""

    __slots__ = ("row", "stack")

    def __init__(self, stack: WeightsStack, row: int) -> None:
        if not 0 <= row < len(stack):
            raise IndexError(f"row {row} of a stack of {len(stack)}")
        # No per-array checks: the stack's arrays are the engine's own, and the layout
        # is the stack's, shared by every row.
        self._layout = stack.row_specs
        self.stack, self.row = stack, row

    def __getitem__(self, name: str) -> np.ndarray:
        return self.stack.arrays[name][self.row]

    def __iter__(self) -> Iterator[str]:
        return iter(self.stack.arrays)

    def __len__(self) -> int:
        return len(self.stack.arrays)

    def specs(self) -> tuple[TensorSpec, ...]:
        return self._layout
