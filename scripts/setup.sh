#!/usr/bin/env bash
# Creates .venv and installs distkit with its dev extras. Idempotent: a second run only checks.
# torch is pinned by constraints.txt so that no install step can pull a newer (CUDA, several GB) build;
# A GPU machine installs its CUDA torch first and edits constraints.txt to match.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.distkit-setup
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/pip install --quiet --disable-pip-version-check "$(grep -E "^torch==" constraints.txt)"
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
echo "$want" > "$stamp"
