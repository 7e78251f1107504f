#!/usr/bin/env bash
# fedloom's two set-up commands on a fresh machine (Python 3.11, pip, gcc):
#   bash run.sh demo    # install into .venv (first time), then run the federated demo
#   bash run.sh test    # install into .venv (first time), then run the test suite
set -euo pipefail
cd "$(dirname "$0")"
venv=${FEDLOOM_VENV:-.venv}
if [ ! -x "$venv/bin/fedloom" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -e ".[dev]"
  touch "$venv/.installed"
fi
cmd=${1:-demo}
shift || true
case "$cmd" in
  demo) exec "$venv/bin/fedloom" demo "$@" ;;
  test) exec "$venv/bin/python" -m pytest "$@" ;;
  *) echo "usage: bash run.sh demo|test [args...]" >&2; exit 2 ;;
esac
