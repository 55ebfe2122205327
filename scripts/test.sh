#!/usr/bin/env bash
# Install the test dependencies into the active Python and run the whole suite.
# torch first and pinned. NOTE: where pip's default index resolves torch==2.13.0 to the CUDA build (Linux x86-64:
# several GB of nvidia-* packages), install the CPU build first from PyTorch's CPU wheel index (README, Quick
# start): the pin accepts the installed 2.13.0+cpu and pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The router of the multi-host tests (tests/app/test_router_replicas.py), pinned in the `router` extra,
# in a venv of its own (it needs openai<3; the tests use the current client).
python -m venv .venv-router
.venv-router/bin/python -m pip install -q "$(python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["router"][0])')"
ruff check domain adapters app simulator tests
lint-imports
# pytest's exit 5 (no tests collected) fails this script like any other non-zero status.
# One worker per core, each test file whole on one worker (--dist loadfile): a file's module-scoped fixtures
# (a synthesized checkpoint, a warmed executor) are built once, and the Triton-interpreter files, most of
# the time, run side by side. PYTEST_WORKERS=0 runs everything in this process.
python -m pytest -n "${PYTEST_WORKERS:-auto}" --dist loadfile "$@"
