#!/usr/bin/env bash
# Set-up (if needed) and the main job: DDP on 2 CPU processes under torchrun, training a small
# network on scikit-learn's bundled digits to >= 95 % validation accuracy (examples/train_digits.py).
# Checkpoints, metrics.csv and curves.png go to runs/digits (--out to change); fails below 95 %.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchrun --standalone --nproc_per_node=2 examples/train_digits.py "$@"
