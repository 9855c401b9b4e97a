#!/usr/bin/env bash
# Sharded optimizer state (ZeRO stage 1) on 4 CPU workers: trainerd unsharded, trainerd
# --shard optimizer and --shard gradients (ZeRO stage 2), PyTorch DDP with ZeroRedundancyOptimizer (gloo) and plain DDP, training one
# 25.8 M-parameter MLP with Adam; per worker the optimizer-state bytes, peak RSS, examples/s, and
# the commit time of the whole state on local disk and on the S3 test server (SeaweedFS on
# loopback, which it starts). One invocation prints the table. Builds
# trainerd and the python-model plugin (release). See bench/sharded.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests --no-build
source scripts/env.sh
cargo build --release -p trainerd -p python-model
exec python bench/sharded.py "$@"
