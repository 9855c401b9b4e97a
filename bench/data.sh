#!/usr/bin/env bash
# The input pipeline beside PyTorch's DataLoader (pyarrow + PIL) over the same Parquet files, at 1
# and 2 loader threads; mnist-cnn's training from Parquet beside the in-memory path (bench/data.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests
source scripts/env.sh
exec python bench/data.py "$@"
