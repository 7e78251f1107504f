"""Text from a peer, made safe for a log line or a terminal.

A client's failure message or leave reason, a client's metric strings, a server's
status details: each ends up in a log or on an operator's terminal. Written as they
came, a newline forges a log line of the writer's choosing and an escape sequence
drives the terminal. `one_line` keeps printable characters and writes every other one
as its Python escape (``\\n``, ``\\x1b``), so nothing is lost and nothing is obeyed.
"""

from __future__ import annotations


def one_line(text: object, limit: int | None = None) -> str:
    """``text`` (``str()`` of it; None is "") on one line, control and other
    non-printable characters escaped, cut to ``limit`` characters (marked) if given."""
    raw = "" if text is None else str(text)
    safe = raw if raw.isprintable() else "".join(
        c if c.isprintable() else repr(c)[1:-1] for c in raw)
    if limit is not None and len(safe) > limit:
        return safe[:limit] + "... (cut)"
    return safe
