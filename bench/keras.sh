#!/usr/bin/env bash
# A Keras model (the multi-worker tutorial's CNN, Keras 3 on its torch backend) under trainerd beside
# Keras's own fit (1 process) and the same model under PyTorch DDP (gloo, 2 workers), same session,
# and the first 20 losses beside Keras's train step. Builds trainerd and the plugin (release); Keras
# comes with setup. See bench/keras.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests --no-build
source scripts/env.sh
cargo build --release -p trainerd -p python-model
exec python bench/keras.py "$@"
