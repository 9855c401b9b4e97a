#!/usr/bin/env bash
# Two-worker training throughput: trainerd beside PyTorch DDP and TensorFlow MWMS, same session.
# Installs TensorFlow (tensorflow-cpu, tf_keras) into its own virtualenv on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --workspace
source scripts/env.sh
export TF_VENV="$TRAINERD_CACHE/venv-tf"
if [ ! -e "$TF_VENV/.trainerd-complete" ]; then
    rm -rf "$TF_VENV" && python3 -m venv "$TF_VENV"
    "$TF_VENV/bin/pip" install -q --disable-pip-version-check tensorflow-cpu tf_keras
    touch "$TF_VENV/.trainerd-complete"
fi
exec python bench/multi_worker.py "$@"
