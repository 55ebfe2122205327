#!/usr/bin/env bash
# Install the test dependencies into the active Python and run the whole suite.
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
ruff check domain adapters app simulator tests
lint-imports
# pytest's exit 5 (no tests collected) fails this script like any other non-zero status.
python -m pytest "$@"
