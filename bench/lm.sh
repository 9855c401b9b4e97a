#!/usr/bin/env bash
# A language model as its users train it: the GPT example on raw text with AdamW, a warmup and a
# cosine, trainerd beside PyTorch DDP (gloo) and eager; and raw text to packed blocks, trainerd's
# pipeline beside datasets' map-and-group recipe. Both tables from one invocation. Builds trainerd
# and the python-model plugin (release); datasets comes with setup --tests. See bench/lm.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests --no-build
source scripts/env.sh
cargo build --release -p trainerd -p python-model
exec python bench/lm.py "$@"
