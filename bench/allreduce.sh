#!/usr/bin/env bash
# All-reduce latency and bus bandwidth: trainerd's ring beside PyTorch gloo, same session.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-build
source scripts/env.sh
exec python bench/allreduce.py "$@"
