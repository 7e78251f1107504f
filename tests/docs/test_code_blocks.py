"""The code blocks of README.md and docs/*.md work as shown.

Each block is checked by its language; a marker comment ``<!-- test: ... -->`` just
above the fence says how, where a language needs one:

- ``python``: every block compiles. It also runs, in a process of its own (this venv's
  Python, an empty temporary folder, `PYTHON_TIMEOUT_S`), unless marked
  ``<!-- test: compile-only: REASON -->`` (it needs a server, a network, your data...);
  an unmarked block runs, so no block is left unchecked without a reason in the doc.
- ``toml``: every block parses, and its marker names what it is:
  ``<!-- test: server -->`` loads as ``fedloom server --config BLOCK`` would (a block
  that sets no TLS itself is loaded with ``--tls-cert/--tls-key/--tls-client-ca``, as a
  fragment of a secured server's file); ``<!-- test: scenario -->`` loads as
  ``fedloom simulate BLOCK`` would; ``<!-- test: parse-only: REASON -->`` parses only.
- ``bash``, ``sh``, ``console``: every ``fedloom ...`` command parses with fedloom's own
  argument parsers and spells each ``--flag`` in full, as the parser names it.
- ``json``: a JSON document, or JSON Lines (one document per line, as log examples are).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from doc_blocks import Block, blocks, commands, option_strings, parser_chain

from fedloom.cli import build_parser, server_config_from_args
from fedloom.simulations.cli import _parser as simulate_parser
from fedloom.simulations.scenario import load_scenario

PYTHON_TIMEOUT_S = 60
COMPILE_ONLY = "compile-only:"
PARSE_ONLY = "parse-only:"
SHELLS = ("bash", "sh", "console")

ALL = blocks()


def _of(*langs: str) -> list[Block]:
    return [block for block in ALL if block.lang in langs]


def _params(selected: list[Block]) -> list[object]:
    return [pytest.param(block, id=block.name) for block in selected]


def test_the_documents_have_blocks_of_every_checked_kind() -> None:
    # Guards the extraction: a broken fence pattern would otherwise check nothing.
    langs = {block.lang for block in ALL}
    assert {"python", "toml", "bash", "json", "console"} <= langs
    assert sum(len(commands(b)) for b in _of(*SHELLS)) >= 10


@pytest.mark.parametrize("block", _params(_of("python")))
def test_python_block(block: Block, tmp_path: Path) -> None:
    compile(block.code, block.name, "exec")
    if block.marker is not None:
        assert block.marker.startswith(COMPILE_ONLY), (
            f"{block.name}: marker {block.marker!r}: a python block runs unless marked "
            f"'<!-- test: {COMPILE_ONLY} REASON -->'")
        assert block.marker.removeprefix(COMPILE_ONLY).strip(), f"{block.name}: no reason"
        return
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=PYTHON_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name} ran past {PYTHON_TIMEOUT_S} s: make it smaller, or mark "
                    f"it '{COMPILE_ONLY} REASON'")
    assert done.returncode == 0, f"{block.name} failed:\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("block", _params(_of("toml")))
def test_toml_block(block: Block, tmp_path: Path) -> None:
    data = tomllib.loads(block.code)
    path = tmp_path / "block.toml"
    path.write_text(block.code, encoding="utf-8")
    marker = block.marker or ""
    if marker == "server":
        argv = ["server", "--config", str(path)]
        if "tls" not in data and "insecure" not in data:
            argv += ["--tls-cert", "server.pem", "--tls-key", "server.key",
                     "--tls-client-ca", "ca.pem"]
        server_config_from_args(build_parser().parse_args(argv))
    elif marker == "scenario":
        load_scenario(path)
    else:
        assert marker.startswith(PARSE_ONLY) and marker.removeprefix(PARSE_ONLY).strip(), (
            f"{block.name}: marker {block.marker!r}: a toml block is marked "
            f"'<!-- test: server -->', '<!-- test: scenario -->' or "
            f"'<!-- test: {PARSE_ONLY} REASON -->'")


@pytest.mark.parametrize("block", _params(_of(*SHELLS)))
def test_fedloom_commands(block: Block) -> None:
    for words in commands(block):
        if Path(words[0]).name != "fedloom":
            continue
        argv, shown = words[1:], shlex.join(words)
        root = build_parser()
        if argv[:1] == ["simulate"]:  # fedloom.cli hands the rest to its own parser
            root, argv = simulate_parser(), argv[1:]
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            try:
                root.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{block.name}: `{shown}`: {errors.getvalue().strip()}")
        known = set().union(*map(option_strings, parser_chain(root, argv)))
        for word in argv:
            flag = word.partition("=")[0]
            assert not flag.startswith("--") or flag in known, (
                f"{block.name}: `{shown}`: {flag} is not a flag of this command "
                "(argparse would take it as an abbreviation)")


@pytest.mark.parametrize("block", _params(_of("json")))
def test_json_block(block: Block) -> None:
    try:
        json.loads(block.code)
    except json.JSONDecodeError:
        for number, line in enumerate(block.code.splitlines(), 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    pytest.fail(f"{block.name}: neither one JSON document nor JSON Lines: "
                                f"line {number}: {exc}")
