"""Fixtures of the operations tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """`fedloom.cli.main` configures the root logger; put it back for the tests that
    follow."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
