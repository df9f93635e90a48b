#!/usr/bin/env bash
# Set-up (if needed), the type check of src/ and the whole test suite. Extra arguments go to pytest
# (and skip the type check, for a quick run of a few tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
  .venv/bin/mypy  # configured in pyproject.toml: src/distkit, strict flags
fi
exec .venv/bin/python -m pytest "$@"
