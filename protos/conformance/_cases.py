"""The inputs of the conformance vectors: tensors, updates, values and fixed ids.

`fedloom.protos.conformance.generate` turns them into vectors with fedloom's own code;
each description says what its vector shows a second implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedloom.messages import Session
from fedloom.types import Scalar

#: (name, wire dtype, values as nested lists in C order, or one number for shape []).
TensorRows = Sequence[tuple[str, str, Any]]

PAYLOADS: tuple[tuple[str, int, TensorRows], ...] = (
    ("A float32 model: a 2-D weight, a bias and a scalar (shape []). The tensors are in "
     "the model's order, which is not the order of their names. 7-byte chunks split "
     "values across chunks; -0.0 keeps its sign bit.",
     7,
     [("layer1.weight", "float32", [[0.1, -0.5, 1.0], [2.5, -0.0, 3.25]]),
      ("layer1.bias", "float32", [0.0, 1e-3, -7.0]),
      ("temperature", "float32", 0.75)]),
    ("Every width of integer and float: each tensor's bytes follow the previous one's with "
     "no padding or alignment (the int32 tensor starts at an odd offset); bool is one byte, "
     "0 or 1; float16 holds a subnormal (2**-24).",
     16,
     [("steps", "int64", [0, -1, 2**40]),
      ("mask", "uint8", [0, 1, 127, 128, 255]),
      ("index", "int32", [-(2**31), 7]),
      ("moments", "float64", [[1 / 3, -2.0], [1e300, 5e-324]]),
      ("half", "float16", [1.0, -65504.0, 2**-24]),
      ("flags", "bool", [True, False]),
      ("small", "int8", [-128, 127]),
      ("wide", "uint16", [65535]),
      ("big", "uint32", [4294967295]),
      ("huge", "uint64", [2**53])]),
    ("Tensors with no elements are listed in the header and add no bytes. A payload no "
     "larger than chunk_size travels as one chunk.",
     1024,
     [("empty", "float32", np.zeros((0,), np.float32)),
      ("k", "int16", [-3, 300]),
      ("grid", "float32", np.zeros((2, 0, 3), np.float32))]),
    ("A payload of 0 bytes: its header (with the SHA-256 of no bytes) travels alone; no "
     "chunk follows.",
     1024,
     [("empty", "float32", np.zeros((0,), np.float32))]),
)

FEDAVGS: tuple[tuple[str, TensorRows, tuple[tuple[int, TensorRows], ...]], ...] = (
    ("Two clients, float32: the mean of two products is rounded once, whichever comes "
     "first.",
     [("dense.weight", "float32", [[0.5, -1.25, 2.0], [0.1, 3.0, -0.3]]),
      ("dense.bias", "float32", [0.0, 0.25, -0.75]),
      ("scale", "float32", 1.5)],
     ((30, [("dense.weight", "float32", [[0.1, -0.2, 0.3], [-0.05, 0.0, 0.125]]),
            ("dense.bias", "float32", [0.01, -0.01, 0.5]),
            ("scale", "float32", -0.1)]),
      (10, [("dense.weight", "float32", [[-0.3, 0.6, 0.9], [0.2, -1.0, 0.0]]),
            ("dense.bias", "float32", [0.0, 0.02, -0.5]),
            ("scale", "float32", 0.7)]))),
    ("Three clients: integer means rounded half to even (2.5 -> 2, -0.5 -> 0, 1.5 -> 2, "
     "0.75 -> 1, -2.5 -> -2); float64 and float32 values whose products and sums are all "
     "exact, so any order of the sum gives these bits.",
     [("num_batches_tracked", "int64", [10, 10, 10, 10, 10]),
      ("running_var", "float64", [1.0, 0.5, -2.0]),
      ("w", "float32", [0.25, -4.0])],
     ((1, [("num_batches_tracked", "int64", [4, -1, 3, 1, -5]),
           ("running_var", "float64", [0.5, 0.25, 1.0]),
           ("w", "float32", [0.5, 1.0])]),
      (1, [("num_batches_tracked", "int64", [6, -1, 3, 2, -5]),
           ("running_var", "float64", [0.25, -0.75, 2.0]),
           ("w", "float32", [-0.25, 0.5])]),
      (2, [("num_batches_tracked", "int64", [0, 0, 0, 0, 0]),
           ("running_var", "float64", [-0.125, 0.5, 0.5]),
           ("w", "float32", [0.125, -1.5])]))),
)

VALUES: tuple[tuple[str, Scalar], ...] = (
    ("bool true", True),
    ("bool false: a oneof member is written even at its default value", False),
    ("int 0: written (oneof), zigzag varint 0", 0),
    ("int -1: sint64, zigzag encoded as 1", -1),
    ("int 1: zigzag 2", 1),
    ("int 150: zigzag 300, a two-byte varint", 150),
    ("int -2**63, the smallest sint64", -(2**63)),
    ("int 2**63 - 1, the largest sint64", 2**63 - 1),
    ("float 0.5: a double, 8 bytes little-endian", 0.5),
    ("float -0.0: the sign bit travels", -0.0),
    ("float 0.1 (the double nearest to it)", 0.1),
    ("string, empty: written (oneof)", ""),
    ("string: UTF-8", "h\u00e9llo \u2713"),
    ("bytes, empty", b""),
    ("bytes", b"\x00\xff\x10"),
)

#: Fixed stand-ins for what the server draws at random (ids, the session secret).
SESSION = Session("5c0ffee0d15ea5e5", bytes(range(32)))
RUN_ID = "20260101-120000-a1b2c3"
TASK_ID = "9f86d081884c7d659a2feaa0c55ad015"
