#!/usr/bin/env bash
# What a resume costs in memory on 4 CPU workers: trainerd unsharded and --shard optimizer (each
# worker reads its own ranges of the optimizer state from the commit), beside PyTorch DDP with
# ZeroRedundancyOptimizer resumed from its consolidated checkpoint (every rank loads it whole),
# training one 25.8 M-parameter MLP with Adam: per worker the peak RSS of the first run and of the
# resumed one. One invocation prints the table. Builds trainerd and the python-model plugin
# (release). See bench/resume.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests --no-build
source scripts/env.sh
cargo build --release -p trainerd -p python-model
exec python bench/resume.py "$@"
