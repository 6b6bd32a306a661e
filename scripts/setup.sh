#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: a venv in .venv with the project and its test tools.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "setup.sh: Python >= 3.11 is needed (found $("$PY" --version))" >&2; exit 2; }
if [[ ! -x .venv/bin/python ]]; then
    "$PY" -m venv .venv
fi
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test,report]'
    touch "$stamp"
fi
