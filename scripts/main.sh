#!/usr/bin/env bash
# Set-up (if needed) and the main job: a real run on 2 CPU processes under torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchrun --standalone --nproc_per_node=2 examples/quickstart.py "$@"
