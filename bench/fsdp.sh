#!/usr/bin/env bash
# A decoder-only transformer of about 100 M parameters (gpt.py) on 4 CPU workers: trainerd
# unsharded, --shard optimizer and --shard gradients, beside PyTorch FSDP2 (fully_shard per block,
# gloo) on the same module, weights and batches; per worker the model-state bytes (buddy copies
# apart), peak RSS, tokens/s, and the first 20 losses against FSDP2's. One invocation prints the
# table. Builds trainerd and the python-model plugin (release). See bench/fsdp.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests --no-build
source scripts/env.sh
cargo build --release -p trainerd -p python-model
exec python bench/fsdp.py "$@"
