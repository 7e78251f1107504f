"""Help text for strategy settings, read from each class's Google-style ``Args:`` section.

Strategy settings are constructor arguments, so the docstring that documents them for
Python users is also what ``fedloom server --help`` prints (`describe_strategies`);
configuration dataclasses keep theirs in field metadata instead
(`fedloom.settings.described`). Values are checked by the kernel's
`fedloom.settings.coerce`, as every configured value is.
"""

from __future__ import annotations

import inspect
import re
from typing import Any


def argument_docs(obj: Any) -> dict[str, str]:
    """Descriptions from the ``Args:`` section of a Google-style docstring, by name."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    current: str | None = None
    entry = re.compile(r"^    (\w+)(?: \([^)]*\))?: (.*)$")
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break  # the next section (e.g. "Raises:") or prose
        match = entry.match(line)
        if match:
            current = match.group(1)
            out[current] = match.group(2).strip()
        elif current is not None and line.startswith("        "):
            out[current] += " " + line.strip()
    return out


def summary_line(obj: Any) -> str:
    """The first line of an object's docstring."""
    doc = inspect.getdoc(obj) or ""
    return doc.splitlines()[0] if doc else ""
