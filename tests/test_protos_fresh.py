"""The committed generated code equals what protos/generate.sh produces now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(
        ["bash", str(ROOT / "protos" / "generate.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHON": sys.executable,
             "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")},
    )
    generated = sorted((tmp_path / "fedloom" / "v1").glob("*_pb2*"))
    assert generated, "generate.sh produced nothing"
    for path in generated:
        committed = ROOT / "protos" / "fedloom" / "v1" / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run protos/generate.sh and commit the result"
        )


def test_import_walls() -> None:
    """Imports run one way (docs/architecture.md): each wing imports only what its row of
    the table allows; the kernel imports no wing (its `fedloom` command excepted)."""
    import re

    walls = {
        "strategies": r"grpc|torch|flwr|fedloom\.(server|client_sdk|protos)",
        "fedloom": r"grpc|google\.protobuf|torch|flwr"
        r"|fedloom\.(server|client_sdk|strategies|protos|simulations)",
        "server": r"torch|flwr|fedloom\.client_sdk",
        "client_sdk": r"flwr|fedloom\.(server|strategies)",
        "protos": r"torch|flwr|fedloom\.(server|client_sdk|strategies|simulations)",
        "simulations": r"grpc|google\.protobuf|fedloom\.protos",
    }
    pattern = r"^\s*(from|import)\s+({})"
    for folder, forbidden in walls.items():
        for path in (ROOT / folder).rglob("*.py"):
            if folder == "fedloom" and path.name == "cli.py":
                continue
            if folder == "protos" and path.relative_to(ROOT / folder).parts[0] == "conformance":
                continue  # a development tool, not in the wheel: composes codec and strategies
            for line in path.read_text().splitlines():
                assert not re.match(pattern.format(forbidden), line), f"{path}: {line}"
