#!/usr/bin/env bash
# The Python model plugin on the small GPT example: trainerd beside PyTorch DDP (2 workers) and
# PyTorch eager (1 worker), same session, and the time a step waits for its token batch. Builds
# trainerd and the plugin (release); pyarrow and tokenizers come with setup --tests. See
# bench/python_model.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests --no-build
source scripts/env.sh
cargo build --release -p trainerd -p python-model
exec python bench/python_model.py "$@"
