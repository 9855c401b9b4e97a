#!/usr/bin/env bash
# Checkpoint commit throughput beside dd and torch.save, and step time with commits in flight.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
exec python bench/checkpoint.py "$@"
