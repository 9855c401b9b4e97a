#!/usr/bin/env bash
# Builds trainerd (release) and runs bench/single_worker.py with the same PyTorch it links.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
exec python bench/single_worker.py "$@"
