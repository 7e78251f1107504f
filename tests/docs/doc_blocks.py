"""The fenced code blocks of the repository's Markdown, and the commands in them.

A block's *marker* is an HTML comment ``<!-- test: ... -->`` (one line or several) that
ends on the last non-blank line above its opening fence (GitHub does not render it);
what it may say depends on the block's language (see tests/docs/test_code_blocks.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<lang>[^`\s]*)")
_MARKER = re.compile(r"^<!--\s*test:\s*(?P<text>.*?)\s*-->$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"|", "||", "&&", ";", "&"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, code and marker text."""

    path: Path
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    marker: str | None  # the text after "test:", None without a marker

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(paths: list[Path] = DOCUMENTS) -> list[Block]:
    """Every fenced block of ``paths``, in document order."""
    found = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            opening = _FENCE.match(lines[index])
            if opening is None:
                index += 1
                continue
            fence, indent = opening["fence"], len(opening["indent"])
            end = index + 1
            while end < len(lines) and not lines[end].strip().startswith(fence):
                end += 1
            code = "\n".join(line[indent:] for line in lines[index + 1:end]) + "\n"
            found.append(Block(path, index + 1, opening["lang"].lower(), code,
                               _marker_above(lines, index)))
            index = end + 1
    return found


def _marker_above(lines: list[str], index: int) -> str | None:
    end = index - 1
    while end >= 0 and not lines[end].strip():
        end -= 1
    if end < 0 or not lines[end].rstrip().endswith("-->"):
        return None
    start = end
    while start > 0 and "<!--" not in lines[start]:
        start -= 1
    match = _MARKER.match(" ".join(line.strip() for line in lines[start:end + 1]))
    return match["text"] if match else None


def commands(block: Block) -> list[list[str]]:
    """The command lines of a shell block, each as its words, environment assignments
    left out; a ``console`` block's commands are its ``$ `` lines."""
    text = block.code.replace("\\\n", " ")
    lines = text.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    out = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word in _SEPARATORS:
                if command:
                    out.append(command)
                command = []
            elif command or not _ASSIGNMENT.match(word):
                command.append(word)
    return out


def parser_chain(root: argparse.ArgumentParser, argv: list[str]) -> list[argparse.ArgumentParser]:
    """The parsers ``argv`` passes through: ``root``, then each subcommand's."""
    chain = [root]
    for word in argv:
        subcommands = [a for a in chain[-1]._actions
                       if isinstance(a, argparse._SubParsersAction)]
        if subcommands and word in subcommands[0].choices:
            chain.append(subcommands[0].choices[word])
    return chain


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}
