#!/usr/bin/env bash
# Builds trainerd (release) and runs bench/precision.py with the same PyTorch it links.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
exec python bench/precision.py "$@"
